"""Saves killed at every filesystem mutation (issue 29): after each kill the folder holds the old or the new model
entirely, or refuses to load; the next save / resume recovers what the kill left.

Written against the filesystem calls, not file names: a forked child counts the mutations Python makes (audit
events: every open for writing, rename / replace, remove / unlink, rmdir, mkdir, link, rmtree) and ``os._exit``s
just before mutation ``k``; ``k`` runs from 1 until the save completes. "Before mutation k" is the state after the
last byte of the file written before it, so the kill points cover every completed write too."""

from __future__ import annotations

import errno
import os
import shutil
import sys
import time
import traceback

import pytest
import torch
import transformers
from safetensors.torch import load_file

from hf_megatrain import MegaTrainConfig, MegaTrainEngine, MegaTrainTrainer
from hf_megatrain import checkpoint as ckpt
from hf_megatrain.checkpoint import CheckpointError

from .models import tiny
from .test_trainer import dataset, mt_args

_MUTATIONS = {"os.rename", "os.remove", "os.rmdir", "os.mkdir", "os.link", "os.symlink", "os.truncate",
              "shutil.rmtree"}
_WRITE_FLAGS = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_APPEND


def is_mutation(event: str, args: tuple) -> bool:
    if event in _MUTATIONS:
        return True
    if event == "open":
        mode, flags = args[1], args[2]
        return (isinstance(mode, str) and any(c in mode for c in "wax+")) or bool((flags or 0) & _WRITE_FLAGS)
    return False


def killed_at(k: int, save) -> bool:
    """Run ``save()`` in a forked child killed just before its ``k``-th mutation; True when it completed."""
    sys.stdout.flush()
    sys.stderr.flush()
    pid = os.fork()
    if pid == 0:
        try:
            sys.dont_write_bytecode = True  # (a .pyc write would be a mutation that happens once)
            count = [0]

            def hook(event: str, args: tuple) -> None:
                if is_mutation(event, args):
                    count[0] += 1
                    if count[0] == k:
                        os._exit(9)

            sys.addaudithook(hook)
            save()
            os._exit(0)
        except BaseException:
            traceback.print_exc()
            os._exit(3)
    _, status = os.waitpid(pid, 0)
    code = os.waitstatus_to_exitcode(status)
    assert code in (0, 9), f"the save failed in the child (exit {code}) at k={k}"
    return code == 0


def each_kill(template: str, work: str, save, check, limit: int = 200) -> int:
    """For k = 1, 2, ...: copy ``template`` to ``work``, kill ``save`` before mutation k, ``check(work, k)``; until
    the save completes. Returns the number of mutations."""
    for k in range(1, limit):
        shutil.rmtree(work, ignore_errors=True)
        shutil.copytree(template, work, symlinks=True)
        done = killed_at(k, save)
        check(work, k, done)
        if done:
            return k - 1
    raise AssertionError(f"the save made over {limit} mutations")


def same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[n], b[n]) for n in a)


# -- exports (save_model / save_pretrained) ---------------------------------------------------------------------------
def _masters(engine) -> dict[str, torch.Tensor]:
    return {n: t.detach().clone() for n, t in engine.named_master_tensors()}


def hf_load(path: str) -> dict[str, torch.Tensor]:
    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    return {n: p.detach().clone() for n, p in model.state_dict().items()}


@pytest.mark.slow  # forks a child per mutation
@pytest.mark.parametrize("old_shard, new_shard", [("30KB", "30KB"), ("30KB", "50KB"), ("1GB", "1GB"),
                                                  ("1GB", "30KB"), ("30KB", "1GB")],
                         ids=["multi-same-layout", "multi-layout-change", "single", "single-to-multi",
                              "multi-to-single"])
def test_export_killed_at_every_mutation(tmp_path, old_shard, new_shard):
    engine = MegaTrainEngine(tiny("llama"), MegaTrainConfig(compute_dtype="float32"), device="cpu")
    template = str(tmp_path / "template")
    os.makedirs(template)
    user_files = {"README.md": b"my model card\n", "tokenizer.json": b"{}\n"}
    for name, data in user_files.items():
        with open(os.path.join(template, name), "wb") as f:
            f.write(data)
    ckpt.save_pretrained_streamed(engine, template, max_shard_size=old_shard)
    old = hf_load(template)
    with torch.no_grad():
        for _, t in engine.named_master_tensors():
            t.add_(1.0)
    new = _masters(engine)
    hf_names = {n: n for n in new}
    work = str(tmp_path / "work")
    seen = set()

    def check(path: str, k: int, done: bool) -> None:
        for name, data in user_files.items():  # the user's files are never touched
            with open(os.path.join(path, name), "rb") as f:
                assert f.read() == data, (k, name)
        got = hf_load(path)  # plain transformers: loads (never refuses here) the old or the new model
        got = {n: got[n] for n in hf_names}
        which = "old" if same(got, {n: old[n] for n in hf_names}) else "new" if same(got, new) else None
        assert which is not None, f"kill before mutation {k}: from_pretrained loaded a mix of old and new weights"
        seen.add(which)
        if done:
            assert which == "new" and not [f for f in os.listdir(path) if f.startswith(".")], os.listdir(path)

    n = each_kill(template, work, lambda: ckpt.save_pretrained_streamed(engine, work, max_shard_size=new_shard),
                  check)
    assert seen == {"old", "new"} and n >= 4, (seen, n)
    # After a kill mid-commit, the next export cleans up what it left and holds the new model only.
    shutil.rmtree(work)
    shutil.copytree(template, work)
    killed_at(n - 1, lambda: ckpt.save_pretrained_streamed(engine, work, max_shard_size=new_shard))
    ckpt.save_pretrained_streamed(engine, work, max_shard_size=new_shard)
    assert not [f for f in os.listdir(work) if f.startswith(".")]
    assert same({k: v for k, v in hf_load(work).items() if k in new}, new)


# -- Trainer checkpoints (new, re-saved, rotated) ---------------------------------------------------------------------
def folder_tensors(path: str) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    for prefix in (ckpt.WEIGHTS_PREFIX, ckpt.MASTER_PREFIX):
        for f in ckpt.weight_files(path, prefix) or {}:
            out.update({f"{prefix}/{k}": v for k, v in load_file(os.path.join(path, f)).items()})
    out.update({f"opt/{k}": v for k, v in load_file(os.path.join(path, ckpt.OPTIMIZER_TENSORS)).items()})
    return out


def recovered_checkpoints(run: str) -> dict[str, dict[str, torch.Tensor]]:
    """Recover what a kill left (as the next save / resume does), then read every checkpoint-N, verified."""
    with ckpt.output_dir_lock(run):
        ckpt.recover_interrupted_saves(run)
    left = [f for f in os.listdir(run) if f.startswith("checkpoint-") and not f[len("checkpoint-"):].isdigit()]
    assert not left, left
    out = {}
    for f in sorted(os.listdir(run)):
        if f.startswith("checkpoint-"):
            ckpt.verify_checkpoint(os.path.join(run, f))  # every folder with a final name is complete
            out[f] = folder_tensors(os.path.join(run, f))
    return out


@pytest.mark.slow  # forks a child per mutation, resumes runs
def test_checkpoint_killed_at_every_mutation(tmp_path):
    kw = dict(max_steps=4, save_strategy="steps", save_steps=2)
    tr = MegaTrainTrainer(model=tiny("llama"), args=mt_args(tmp_path / "run", **kw), train_dataset=dataset(32))
    tr.train()
    run = str(tmp_path / "run")
    natural = recovered_checkpoints(run)  # checkpoint-2 and checkpoint-4 of the uninterrupted run
    template = str(tmp_path / "template")
    shutil.copytree(run, template)
    shutil.rmtree(os.path.join(template, "checkpoint-4"))
    work = str(tmp_path / "work")

    # 1. A new checkpoint-4 while checkpoint-2 exists, rotation with save_total_limit=1 deleting checkpoint-2.
    def save_and_rotate() -> None:
        tr.args.output_dir = work
        tr.args.save_total_limit = 1
        tr._save_checkpoint(tr.model, None)

    resumed_at = []

    def check_rotation(path: str, k: int, done: bool) -> None:
        got = recovered_checkpoints(path)
        assert got and all(same(t, natural[f]) for f, t in got.items()), (k, sorted(got))
        if done:
            assert sorted(got) == ["checkpoint-4"]
        if k % 7 == 1:  # resuming gives the uninterrupted run's weights (sampled: each resume trains)
            args = mt_args(path, max_steps=4, save_strategy="no")
            again = MegaTrainTrainer(model=tiny("llama"), args=args, train_dataset=dataset(32))
            again.train(resume_from_checkpoint=True)
            again.engine.state.wait_all()
            for n, t in tr.engine.named_master_tensors():
                assert torch.equal(again.engine.store.master_tensor(n), t), (k, n)
            resumed_at.append(k)

    n = each_kill(template, work, save_and_rotate, check_rotation)
    assert n >= 10 and len(resumed_at) >= 2, (n, resumed_at)

    # 2. Re-saving an existing checkpoint-4 (after resuming from an earlier one): the old or the new, entirely.
    template2 = str(tmp_path / "template2")
    shutil.copytree(run, template2)
    tr.args.save_total_limit = None
    with torch.no_grad():  # a different state, so that a mix of the two would show
        for _, t in tr.engine.named_master_tensors():
            t.add_(1.0)
    tr.args.output_dir = str(tmp_path / "ref")
    tr._save_checkpoint(tr.model, None)
    new = folder_tensors(str(tmp_path / "ref" / "checkpoint-4"))
    seen = set()

    def check_resave(path: str, k: int, done: bool) -> None:
        got = recovered_checkpoints(path)
        assert sorted(got) == ["checkpoint-2", "checkpoint-4"], (k, sorted(got))  # nothing lost, never
        which = "old" if same(got["checkpoint-4"], natural["checkpoint-4"]) else \
            "new" if same(got["checkpoint-4"], new) else None
        assert which is not None, f"kill before mutation {k}: checkpoint-4 mixes the two saves"
        seen.add(which)

    def resave() -> None:
        tr.args.output_dir = work
        tr._save_checkpoint(tr.model, None)

    each_kill(template2, work, resave, check_resave)
    assert seen == {"old", "new"}


# -- one test per item, each failing on the code before issue 29 -------------------------------------------------------
@pytest.mark.parametrize("new_shard", ["30KB", "50KB"], ids=["same-layout", "layout-change"])
def test_multi_shard_export_never_mixes_old_and_new(tmp_path, monkeypatch, new_shard):
    """Item 1: killed right after the first new shard is put in place, the folder loads the old or the new model
    entirely (the code before issue 29 loaded a mix, or nothing)."""
    engine = MegaTrainEngine(tiny("llama"), MegaTrainConfig(compute_dtype="float32"), device="cpu")
    out = str(tmp_path / "m")
    ckpt.save_pretrained_streamed(engine, out, max_shard_size="30KB")
    old = hf_load(out)
    with torch.no_grad():
        for _, t in engine.named_master_tensors():
            t.add_(1.0)
    real, moved = os.replace, []

    def dies_after_first_shard(src, dst, *a, **k):
        real(src, dst, *a, **k)
        if dst.endswith(".safetensors") and os.path.dirname(os.path.abspath(dst)) == out:
            moved.append(dst)
            raise KeyboardInterrupt("killed")

    monkeypatch.setattr(os, "replace", dies_after_first_shard)
    with pytest.raises(KeyboardInterrupt):
        ckpt.save_pretrained_streamed(engine, out, max_shard_size=new_shard)
    monkeypatch.setattr(os, "replace", real)
    assert moved
    got = hf_load(out)
    assert same(got, old) or same(got, _masters(engine)), "from_pretrained loaded a mix of two saves"


def test_resave_killed_between_renames_is_recovered(tmp_path, caplog):
    """Item 2: re-saving checkpoint-N killed between its two renames: resuming (or the next save) restores a
    complete copy, and says so, instead of deleting both."""
    run = tmp_path / "run"
    tr = MegaTrainTrainer(model=tiny("llama"), args=mt_args(run, max_steps=2, save_strategy="steps", save_steps=2),
                          train_dataset=dataset())
    tr.train()
    before = folder_tensors(str(run / "checkpoint-2"))
    real, renames = os.rename, []

    def dies_on_second(src, dst, *a, **k):
        renames.append(dst)
        if len(renames) == 2:
            raise KeyboardInterrupt("killed")
        return real(src, dst, *a, **k)

    os.rename = dies_on_second
    try:
        with pytest.raises(KeyboardInterrupt):
            tr._save_checkpoint(tr.model, None)
    finally:
        os.rename = real
    assert not (run / "checkpoint-2").exists()  # the window: neither copy has the final name
    with caplog.at_level("WARNING"):  # resuming recovers it first (then finds it: no step left to train)
        again = MegaTrainTrainer(model=tiny("llama"), args=mt_args(run, max_steps=2), train_dataset=dataset())
        again.train(resume_from_checkpoint=True)
    assert "restored" in caplog.text
    for n, t in tr.engine.named_master_tensors():
        assert torch.equal(again.engine.store.master_tensor(n), t), n
    assert sorted(f for f in os.listdir(run) if f.startswith("checkpoint-")) == ["checkpoint-2"]
    ckpt.verify_checkpoint(str(run / "checkpoint-2"))
    assert same(folder_tensors(str(run / "checkpoint-2")), before)


def test_checkpoint_without_manifest_or_with_unlisted_file_is_refused(tmp_path):
    """Item 3: integrity always on: no manifest, or a file the manifest does not list, is refused (naming it)
    unless accepted knowingly; a plain HF export / plain Trainer checkpoint still loads."""
    run = tmp_path / "run"
    tr = MegaTrainTrainer(model=tiny("llama"), args=mt_args(run, max_steps=2, save_strategy="steps", save_steps=2),
                          train_dataset=dataset())
    tr.train()
    ck = run / "checkpoint-2"
    extra = tmp_path / "extra"
    shutil.copytree(ck, extra)
    (extra / "model.safetensors.index.json").write_text('{"weight_map": {}}')
    with pytest.raises(CheckpointError, match="model.safetensors.index.json.*manifest does not list"):
        ckpt.verify_checkpoint(str(extra))
    ckpt.verify_checkpoint(str(extra), allow_unverified=True)
    bare = tmp_path / "bare"
    shutil.copytree(ck, bare)
    (bare / "megatrain_manifest.json").unlink()
    with pytest.raises(CheckpointError, match="no megatrain_manifest.json"):
        ckpt.verify_checkpoint(str(bare))
    with pytest.raises(CheckpointError, match="no megatrain_manifest.json"):  # resume refuses it too
        MegaTrainTrainer(model=tiny("llama"), args=mt_args(tmp_path / "b", max_steps=2),
                         train_dataset=dataset()).train(resume_from_checkpoint=str(bare))
    ckpt.verify_checkpoint(str(bare), allow_unverified=True)
    plain = tmp_path / "plain"  # plain transformers: no hf_megatrain file, its own optimizer.pt
    shutil.copytree(ck, plain)
    for f in plain.iterdir():
        if f.name.startswith("megatrain_"):
            f.unlink()
    (plain / "optimizer.pt").write_bytes(b"")
    ckpt.verify_checkpoint(str(plain))
    tr.save_model(str(tmp_path / "export"))  # an export has no manifest and needs none
    ckpt.verify_checkpoint(str(tmp_path / "export"), training_state=False)


def test_second_run_in_one_output_dir_is_refused_and_cleanup_spares_live_saves(tmp_path):
    """Item 4: the output_dir lock: a second process gets a clear error; cleanup leaves a live process's temp
    folders alone."""
    out = str(tmp_path / "run")
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # another run holding the folder
        try:
            with ckpt.output_dir_lock(out):
                os.write(w, b"x")
                time.sleep(30)
        finally:
            os._exit(0)
    try:
        assert os.read(r, 1) == b"x"
        with pytest.raises(ckpt.OutputDirBusy, match=f"pid {pid}.*its own output_dir"):
            MegaTrainTrainer(model=tiny("llama"), args=mt_args(out, max_steps=1), train_dataset=dataset()).train()
        with pytest.raises(ckpt.OutputDirBusy):
            ckpt.save_pretrained_streamed(
                MegaTrainEngine(tiny("llama"), MegaTrainConfig(compute_dtype="float32"), device="cpu"), out)
    finally:
        os.kill(pid, 9)
        os.waitpid(pid, 0)
    live = os.path.join(out, f"checkpoint-4.tmp-{os.getppid()}-abc")  # a live process's save in progress
    os.makedirs(live)
    with ckpt.output_dir_lock(out):  # the dead holder's lock is gone with it
        ckpt.recover_interrupted_saves(out)
    assert os.path.isdir(live)


def test_failed_export_leaves_nothing_and_disk_full_names_the_folder(tmp_path, monkeypatch):
    """Item 7: a failed export removes what it wrote; ENOSPC says which folder and how many bytes."""
    import hf_megatrain.checkpoint.safetensors_io as sio

    engine = MegaTrainEngine(tiny("llama"), MegaTrainConfig(compute_dtype="float32"), device="cpu")
    out = tmp_path / "export"
    ckpt.save_pretrained_streamed(engine, str(out), max_shard_size="30KB")
    before = sorted(os.listdir(out))
    real_write = sio.write_safetensors
    calls = []

    def full_on_second(path, *a, **k):
        calls.append(path)
        if len(calls) == 2:
            with open(path, "wb") as f:
                f.write(b"\0" * 1000)  # what a filling disk leaves before the error
            raise OSError(errno.ENOSPC, "No space left on device")
        return real_write(path, *a, **k)

    monkeypatch.setattr(sio, "write_safetensors", full_on_second)
    with pytest.raises(OSError) as e:
        ckpt.save_pretrained_streamed(engine, str(out), max_shard_size="30KB")
    assert e.value.errno == errno.ENOSPC and str(out) in str(e.value) and "bytes" in str(e.value)
    assert sorted(os.listdir(out)) == before  # no hidden partial file or staging folder left
    monkeypatch.setattr(sio, "write_safetensors", real_write)
    monkeypatch.setattr(shutil, "disk_usage", lambda p: shutil._ntuple_diskusage(10**9, 10**9 - 100, 100))
    with pytest.raises(OSError, match=r"needs [\d,]+ bytes there, 100 are free"):
        ckpt.save_pretrained_streamed(engine, str(out), max_shard_size="30KB")
    assert sorted(os.listdir(out)) == before
