"""The manifest of a checkpoint folder, and the check of a folder against it before anything is loaded.

Every folder hf_megatrain writes (a Trainer checkpoint) ends with ``megatrain_manifest.json``: each file with its
size and CRC-32, written last, so that a folder with a manifest is complete. ``verify_checkpoint`` checks a folder
against it before anything is loaded, so a corrupt or edited folder raises before any state is overwritten; a
folder with hf_megatrain state and no manifest is refused too (unless the caller accepts it knowingly). Recovery of
interrupted saves (``atomic.py``) calls it to tell a complete copy from a partial one.

CRC-32s come from the writers where they computed them over the bytes they wrote (``fast_io.recorded_crc32``), else
from one parallel read of the file (``read_into.crc32_files``).
"""

from __future__ import annotations

import json
import logging
import os
from typing import Collection

from ..core.progress import Progress, byte_progress
from .fast_io import recorded_crc32
from .names import MANIFEST, MASTER_PREFIX, OPTIMIZER_TENSORS, WEIGHTS_PREFIX, CheckpointError
from .read_into import crc32_files
from .safetensors_io import open_safetensors, read_json_key, weight_files, write_json

logger = logging.getLogger(__name__)

__all__ = ["file_crc32", "write_manifest", "manifest_crcs", "verify_checkpoint"]


def file_crc32(path: str, chunk: int = 64 << 20) -> str:
    """CRC-32 of a file's bytes (8 hex digits), read once in large chunks, ranges of a large file in parallel."""
    return crc32_files([path], chunk=chunk)[0]


def _crc32_all(paths: list[str], progress: Progress | None = None) -> list[str]:
    """CRC-32 of each file: all files and ranges of large ones read in parallel, every byte once (``read_into``)."""
    return crc32_files(paths, progress=progress)


def write_manifest(save_dir: str) -> None:
    """Record every file in ``save_dir`` with its size and CRC-32; ``verify_checkpoint`` checks against both, so
    a truncated file and a same-size corrupt one are refused before anything is loaded.

    The safetensors writers computed their files' CRC-32 over the bytes as they wrote them (``fast_io``): those
    files are not read back. Only the others (JSON, torch files, a file changed since it was written) are read."""
    names = [f for f in sorted(os.listdir(save_dir)) if os.path.isfile(os.path.join(save_dir, f)) and f != MANIFEST]
    sums = {f: recorded_crc32(os.path.join(save_dir, f)) for f in names}
    unknown = [f for f in names if sums[f] is None]
    sums.update(zip(unknown, _crc32_all([os.path.join(save_dir, f) for f in unknown])))
    files = {f: os.path.getsize(os.path.join(save_dir, f)) for f in names}
    write_json(os.path.join(save_dir, MANIFEST), {"format": 2, "files": files, "crc32": {f: sums[f] for f in names}})


# -- verifying ---------------------------------------------------------------------------------------------------------
def _plain_trainer_checkpoint(names: list[str]) -> bool:
    """A checkpoint of plain ``transformers.Trainer`` (its optimizer state, no hf_megatrain file): it never has a
    manifest, and loading its weights stays allowed (what can be checked is: the safetensors headers)."""
    return (not any(f.startswith("megatrain_") for f in names)
            and any(f.startswith(("optimizer.", "optimizer_")) for f in names))


def _unverified(path: str, why: str, allow_unverified: bool) -> None:
    if not allow_unverified:
        raise CheckpointError(f"{why}. Resume from another checkpoint, or accept this folder knowingly: "
                              "MegaTrainTrainingArguments(megatrain_allow_unverified_checkpoint=True), or "
                              "verify_checkpoint(path, allow_unverified=True)")
    logger.warning("hf_megatrain: %s; loading it anyway (allow_unverified)", why)


def verify_checkpoint(path: str, *, training_state: bool = True, allow_unverified: bool = False,
                      crc_on_load: Collection[str] = (), show_progress: bool = True) -> None:
    """Raise ``CheckpointError`` naming the first missing, corrupt or unexpected file of checkpoint folder ``path``.

    Folders hf_megatrain wrote carry ``megatrain_manifest.json`` (written last): every listed file must exist with
    its recorded size and CRC-32, and a file it does not list (say a second weight index put there later) is
    refused, since it could change what is loaded. A Trainer checkpoint (``trainer_state.json``) or a folder with
    hf_megatrain state (``megatrain_*``) without a manifest is refused: it is incomplete or was edited, and nothing
    in it can be checked. Exempt: plain HF folders (a ``save_pretrained`` export, a plain ``Trainer`` checkpoint
    with its ``optimizer.pt``), where only the safetensors headers are checked. ``allow_unverified`` turns these
    refusals into warnings. ``training_state`` also requires ``trainer_state.json`` (resuming needs it).

    ``crc_on_load``: files (``files_checked_on_load``) whose CRC-32 the caller's load checks while reading them
    whole, so that resuming reads the checkpoint once: their presence, size and header are checked here, their
    bytes by the load (which refuses them, naming the file, before training starts).

    ``show_progress``: a bar of the bytes read for the CRC-32s (``core/progress.py``: on a terminal, unless
    transformers' bars are off); the caller's policy (``TrainingArguments.disable_tqdm``, the main process only)."""
    if not os.path.isdir(path):
        raise CheckpointError(f"checkpoint folder {path} does not exist")
    names = sorted(f for f in os.listdir(path) if os.path.isfile(os.path.join(path, f)))
    manifest_path = os.path.join(path, MANIFEST)
    if os.path.isfile(manifest_path):
        files = read_json_key(manifest_path, "files")
        for fname, size in files.items():
            p = os.path.join(path, fname)
            if not os.path.isfile(p):
                raise CheckpointError(f"checkpoint {path} is incomplete: missing {fname}")
            if os.path.getsize(p) != size:
                raise CheckpointError(f"checkpoint {path} is corrupt: {fname} has {os.path.getsize(p)} bytes, "
                                      f"{size} were written")
        for fname in names:
            if fname != MANIFEST and fname not in files:
                _unverified(path, f"checkpoint {path} holds {fname}, which its manifest does not list: it was put "
                                  "there after the save, and could change what is loaded (remove it)",
                            allow_unverified)
        with open(manifest_path) as fh:
            sums = json.load(fh).get("crc32")
        if sums is None:  # a manifest of an earlier release: sizes only
            logger.warning("hf_megatrain: %s records no checksums (an earlier release wrote it): only file sizes "
                           "are verified", manifest_path)
            sums = {}
        deferred = set(crc_on_load)
        crc_names = sorted(f for f in sums if f not in deferred)
        with byte_progress("Verifying checkpoint", enabled=show_progress) as progress:  # (read_into: its bytes)
            got_all = _crc32_all([os.path.join(path, f) for f in crc_names], progress)
        for fname, got in zip(crc_names, got_all):
            if got != sums[fname]:
                raise CheckpointError(f"checkpoint {path} is corrupt: {fname} does not hold the bytes that were "
                                      f"written (CRC-32 {got}, recorded {sums[fname]}); resume from an earlier "
                                      "checkpoint")
    elif (any(f.startswith("megatrain_") for f in names) or "trainer_state.json" in names) \
            and not _plain_trainer_checkpoint(names):
        _unverified(path, f"checkpoint {path} has no {MANIFEST}, so none of its files can be verified (every "
                          "hf_megatrain save writes it last: the folder is incomplete, or was edited)",
                    allow_unverified)
    if training_state and not os.path.isfile(os.path.join(path, "trainer_state.json")):
        raise CheckpointError(f"{path} has no trainer_state.json, so training cannot resume from it (it is a "
                              "model export, not a Trainer checkpoint); start a new run from it instead")
    shards = weight_files(path)
    if shards is None and not os.path.isfile(os.path.join(path, "adapter_model.safetensors")):  # PEFT: adapters
        raise CheckpointError(f"checkpoint {path} has no weights ({WEIGHTS_PREFIX}.safetensors or "
                              f"{WEIGHTS_PREFIX}.safetensors.index.json)")
    for prefix in (WEIGHTS_PREFIX, MASTER_PREFIX):
        for fname, names in (weight_files(path, prefix) or {}).items():
            with open_safetensors(os.path.join(path, fname)) as f:
                missing = set(names) - set(f.keys())
            if missing:
                raise CheckpointError(f"{os.path.join(path, fname)} lacks tensors its index lists: "
                                      f"{sorted(missing)[:5]}")
    opt = os.path.join(path, OPTIMIZER_TENSORS)
    if os.path.isfile(opt):
        with open_safetensors(opt):
            pass


def manifest_crcs(path: str) -> dict[str, str]:
    """{file: CRC-32} from ``path``'s manifest (empty without one: a plain HF folder)."""
    manifest = os.path.join(path, MANIFEST)
    if not os.path.isfile(manifest):
        return {}
    with open(manifest) as fh:
        return json.load(fh).get("crc32") or {}
