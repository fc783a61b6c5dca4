"""The ``megatrain`` command: one yaml for both accelerate and hf_megatrain, then accelerate's own launcher.

    megatrain launch --config megatrain_combined.yaml train.py [script args]
    megatrain estimate [planner args]

``launch`` reads ONE yaml holding the standard ``accelerate config`` keys plus a ``megatrain:`` section. The
section is validated up front by ``config.resolve_config``, with any ``MEGATRAIN_<KEY>`` env variables (unknown
keys fail before any process starts), and the training process receives the yaml's path as ``MEGATRAIN_CONFIG``
(its section resolved there by the same ``resolve_config``, as the base layer under whatever ``megatrain_config``
the script passes: the script's keys override the section's, each logged with where it came from); the rest is
written to a temp accelerate config handed to ``accelerate launch`` (``accelerate.commands.launch``, run
in-process) together with every other argument, unchanged. So anything ``accelerate launch`` accepts still works,
and ``accelerate launch --config_file`` users lose nothing.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
from typing import Any

from .config import CONFIG_ENV, SECTION, MegaTrainConfig, did_you_mean, read_launch_yaml, resolve_config

# Filled in when the accelerate part leaves them out: single process, precision left to hf_megatrain.
_ACCELERATE_DEFAULTS = {"compute_environment": "LOCAL_MACHINE", "distributed_type": "NO", "mixed_precision": "no",
                        "num_processes": 1}


class ConfigError(ValueError):
    """A combined yaml that cannot be used; the message says what to change."""


def split_config_arg(argv: list[str]) -> tuple[str | None, list[str]]:
    """Take ``--config PATH`` (or ``--config_file``) from the launcher arguments, i.e. before the script."""
    path, rest, i = None, [], 0
    while i < len(argv):
        tok = argv[i]
        if tok.endswith(".py") or tok in ("-m", "--module", "--"):  # the script and its own args start here
            rest.extend(argv[i:])
            break
        if tok in ("--config", "--config_file", "--config-file"):
            if i + 1 >= len(argv):
                raise ConfigError(f"{tok} needs a yaml path")
            path, i = argv[i + 1], i + 2
            continue
        for flag in ("--config=", "--config_file=", "--config-file="):
            if tok.startswith(flag):
                path = tok[len(flag):]
                break
        else:
            rest.append(tok)
        i += 1
    return path, rest


def split_combined(path: str) -> tuple[dict[str, Any], MegaTrainConfig, dict[str, Any]]:
    """Read a combined yaml -> (accelerate part, the MegaTrainConfig the training process will resolve: the
    section plus any MEGATRAIN_<KEY> env variables, megatrain section as written)."""
    try:
        data, section = read_launch_yaml(path)
    except ValueError as e:  # a missing file (ConfigFileNotFoundError is a ValueError too), not a mapping
        raise ConfigError(str(e)) from e
    section = section or {}
    try:  # (the section replaces a MEGATRAIN_CONFIG of the launching shell: see launch)
        config = resolve_config(section, environ={k: v for k, v in os.environ.items() if k != CONFIG_ENV},
                                name=f"{path}'s '{SECTION}:' section")
    except (ValueError, TypeError) as e:
        raise ConfigError(f"{path}: invalid '{SECTION}:' section: {e}") from e

    accel = {**_ACCELERATE_DEFAULTS, **data} if data.get("compute_environment", "LOCAL_MACHINE") == "LOCAL_MACHINE" \
        else data
    _check_accelerate_keys(path, accel)
    return accel, config, section


def _check_accelerate_keys(path: str, accel: dict[str, Any]) -> None:
    """Name a stray top-level key here, rather than letting accelerate fail on a temp file the user never saw."""
    try:
        from accelerate.commands.config.config_args import ClusterConfig
    except ImportError:  # accelerate moved things around: let accelerate itself validate
        return
    if accel.get("compute_environment", "LOCAL_MACHINE") != "LOCAL_MACHINE":
        return
    known = set(ClusterConfig.__dataclass_fields__) | {"fp16", "dynamo_backend"}
    unknown = sorted(set(accel) - known)
    if unknown:
        named = ", ".join(repr(k) + (" (a megatrain key)" if k in MegaTrainConfig.valid_keys() else
                                     did_you_mean(k, sorted(known))) for k in unknown)
        raise ConfigError(f"{path}: unknown top-level keys [{named}]: a combined yaml holds accelerate config keys "
                          f"({sorted(known)}) plus a '{SECTION}:' section with MegaTrainConfig keys "
                          f"({MegaTrainConfig.valid_keys()}). Move hf_megatrain keys under '{SECTION}:'.")


def launch(argv: list[str]) -> int:
    if argv and argv[0] in ("-h", "--help"):
        print(__doc__.strip())
        print("\nEverything besides --config is passed to `accelerate launch` unchanged; its help follows.\n")
    path, rest = split_config_arg(argv)
    from accelerate.commands.launch import launch_command, launch_command_parser

    if path is None:  # nothing to split: behave exactly like `accelerate launch`
        return _run_accelerate(launch_command_parser, launch_command, rest)
    accel, _, section = split_combined(path)
    _, has_section = read_launch_yaml(path)
    import yaml

    shell = os.environ.get(CONFIG_ENV)
    # The training process resolves the section from the yaml itself (a combined yaml's section is what
    # resolve_config reads from it), so the run summary names the user's file; no section: the defaults.
    sent = os.path.abspath(path) if has_section is not None else ""
    with tempfile.TemporaryDirectory(prefix="megatrain_launch_") as tmp:
        accel_path = os.path.join(tmp, "accelerate.yaml")
        with open(accel_path, "w") as f:
            yaml.safe_dump(accel, f)
        os.environ[CONFIG_ENV] = sent  # accelerate's launchers copy os.environ into the child
        print(f"[megatrain] {path}: accelerate part -> {accel_path}; megatrain section -> "
              f"{CONFIG_ENV}={sent or '(none)'} ({section if section else 'empty: MegaTrainConfig defaults'}; the "
              "keys of a megatrain_config the script passes override these)"
              + (f"; replaces {CONFIG_ENV}={shell} of this shell" if shell else ""), file=sys.stderr, flush=True)
        return _run_accelerate(launch_command_parser, launch_command, ["--config_file", accel_path, *rest])


def _run_accelerate(parser_fn, launch_fn, args: list[str]) -> int:
    args_ns = parser_fn().parse_args(args)
    try:
        launch_fn(args_ns)
    except subprocess.CalledProcessError as e:  # the training process failed: its traceback is already printed
        return e.returncode or 1
    return 0


def estimate(argv: list[str]) -> int:
    from .planner import main as planner_main  # lazy: may import transformers

    result = planner_main(argv)
    return int(result) if isinstance(result, int) else 0


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    p = argparse.ArgumentParser(
        prog="megatrain", description="hf_megatrain: full-precision training of LLMs larger than GPU memory.",
        epilog="megatrain launch --config megatrain_combined.yaml train.py [script args]\n"
               "megatrain estimate --help",
        formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("command", choices=["launch", "estimate", "keys"],
                   help="launch: accelerate launch with one combined yaml; estimate: memory planner; "
                        "keys: list the valid megatrain: section keys")
    p.add_argument("--version", action="version", version=f"hf_megatrain {_version()}")
    if not argv or argv[0] in ("-h", "--help", "--version"):
        p.parse_args(argv or ["--help"])
        return 0
    cmd, rest = argv[0], argv[1:]
    try:
        if cmd == "launch":
            return launch(rest)
        if cmd == "estimate":
            return estimate(rest)
        if cmd == "keys":
            for k, v in MegaTrainConfig().to_dict().items():
                print(f"{k}: {v!r}")
            return 0
    except ConfigError as e:
        print(f"megatrain {cmd}: error: {e}", file=sys.stderr)
        return 2
    p.parse_args([cmd])  # unknown command: argparse prints the choices and exits 2
    return 2


def _version() -> str:
    from . import __version__

    return __version__


if __name__ == "__main__":
    sys.exit(main())
