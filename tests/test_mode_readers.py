"""Each mode is decided once and read nowhere else (issue 30, "Modes are strategies chosen once").

The lean store, narrow gradients, the speculative step, data parallel and the host kernel's ``auto`` are decided once
per engine -- placement in ``core/plan.py build_plans``, the step's modes in ``core/plan.py decide_modes``, the
data-parallel share in ``optim/ranks.py ranks_of`` and the engine's constructor -- into per-unit plans and strategy
objects handed to the modules that carry them out. This test greps the package's *code* (strings, docstrings and
comments blanked, so refusal messages and docs may name any mode) for each mode's name tokens and asserts that the
places reading them are exactly the allow-list below: the decider, config.py (definition, validation), the mode's
own strategy module, constructors that pick a per-unit route once, the run summary / planner that describe each
mode, and refusals of unsupported combinations. A new reader elsewhere fails here: hand it the decided strategy.

``python tests/test_mode_readers.py [package dir]`` prints each mode's readers (files and lines).
"""

from __future__ import annotations

import ast
import functools
import io
import re
import sys
import tokenize
from pathlib import Path

import torch

PACKAGE = Path(__file__).resolve().parent.parent / "hf_megatrain"

# Refusals of unsupported combinations in the integrations (TRL ports), which move between modules as those grow:
# allowed, and not required to exist.
REFUSALS = {"hf/dpo_support.py", "hf/trl_ports.py"}
IMPORT = re.compile(r"^\s*(from|import)\s")  # (module paths such as optim.lean are not reads)

# mode -> (name tokens as regexes on code, allowed readers: "path" = the whole module, "path::Qual.name" = that
# function (or class) only).
MODES: dict[str, tuple[list[str], set[str]]] = {
    "lean": ([r"\blean_store\b", r"\blean_compute_copy\b", r"\bStepper\.LEAN\b",
              r"\bgrad\s+is\s+(not\s+)?Where\.NONE\b", r"\.lean\b", r"\bLeanAdamW\b", r"\bmodes\.consume\b"], {
        "config.py",  # the option, its validation
        "core/plan.py",  # the decider (build_plans: Stepper.LEAN per unit; decide_modes: consume)
        "optim/lean.py",  # the strategy: LeanAdamW, optimizer_for
        "engine/runtime.py::MegaTrainEngine.__init__",  # records each training forward (chosen once)
        "engine/summary.py::run_summary",  # reports the plans' lean layers
        "planner/predict.py", "planner/step_time.py", "planner/cli.py",  # model each placement's cost
        "parallel/setup.py::data_parallel_config",  # refusal: lean with data parallel
        "hf/training_args.py::check_lean_accumulation",  # refusal: lean with gradient accumulation
        *REFUSALS,
    }),
    "narrow gradients": ([r"\bnarrow_grads\b", r"\bset_narrow\b", r"\bmodes\.narrow\b"], {
        "config.py",
        "core/plan.py",  # decide_modes
        "engine/builder.py::_executor",  # hands it to the executor's offload, once
        "planner/step_time.py::layer_costs",  # models the D2H bytes (from decide_modes)
    }),
    "speculation": ([r"\bspeculative_step\b", r"\bspeculate\b", r"\bmodes\.speculate\b"], {
        "config.py",
        "core/plan.py",  # decide_modes
        "optim/speculative_step.py",  # the strategy (on or off: chosen in _init_speculation)
        "planner/step_time.py::layer_costs",  # models the overlap (from decide_modes)
    }),
    "data parallel": ([r"\bdp\s+is\s+(not\s+)?None\b", r"\bif\s+(not\s+)?(self\.|engine\.)?dp\s*(:|\band\b|\bor\b)"], {
        "optim/ranks.py",  # ranks_of: alone, or this rank's share (the strategy)
        "engine/runtime.py::MegaTrainEngine.__init__",  # alone or not: decided once
        "engine/builder.py::build_engine",  # conversion into a shared store: once
        "engine/builder.py::_executor",  # the step modes, the peers, the offload's route: once
        "engine/offload.py::GradientOffload.__init__",  # the host gradients' route (reduce-scatter): once
        "engine/conversion_plan.py::host_layout_for",  # the host layout: alone, or rank 0's for its node: once
    }),
    "host kernel auto": ([r"\bconfig\.host_kernel\b"], {
        "core/plan.py::decide_modes",  # the one resolution of "auto" (with _host_kernel; the planner asks it too)
    }),
}


def code_lines(source: str) -> list[str]:
    """``source``'s lines with every string (docstrings, messages) and comment blanked."""
    lines = source.splitlines()
    grid = [list(line) for line in lines]
    for tok in tokenize.generate_tokens(io.StringIO(source).readline):
        if tok.type not in (tokenize.STRING, tokenize.COMMENT):
            continue
        (r0, c0), (r1, c1) = tok.start, tok.end
        for r in range(r0, r1 + 1):
            row = grid[r - 1]
            lo, hi = (c0 if r == r0 else 0), (c1 if r == r1 else len(row))
            row[lo:hi] = " " * (hi - lo)
    return ["".join(row) for row in grid]


def enclosing(tree: ast.AST) -> list[tuple[int, int, str]]:
    """(first line, last line, qualified name) of every def and class, outermost first."""
    out: list[tuple[int, int, str]] = []

    def walk(node: ast.AST, prefix: str) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                name = f"{prefix}{child.name}"
                out.append((child.lineno, child.end_lineno or child.lineno, name))
                walk(child, name + ".")
            else:
                walk(child, prefix)

    walk(tree, "")
    return out


@functools.lru_cache(maxsize=None)
def _parsed(root: Path) -> list[tuple[str, list[str], list[tuple[int, int, str]]]]:
    """(path relative to ``root``, code lines, defs) of every module, once per run."""
    out = []
    for path in sorted(root.rglob("*.py")):
        source = path.read_text()
        out.append((path.relative_to(root).as_posix(), code_lines(source), enclosing(ast.parse(source))))
    return out


def readers(root: Path, patterns: list[str]) -> dict[str, list[tuple[str, int, str]]]:
    """path relative to ``root`` -> [(qualified name of the enclosing def, line number, code line)] of each hit."""
    rx = re.compile("|".join(f"(?:{p})" for p in patterns))
    found: dict[str, list[tuple[str, int, str]]] = {}
    for rel, lines, defs in _parsed(root):
        hits = [(n, line) for n, line in enumerate(lines, 1) if rx.search(line) and not IMPORT.match(line)]
        for n, line in hits:
            inner = [q for lo, hi, q in defs if lo <= n <= hi]
            found.setdefault(rel, []).append((inner[-1] if inner else "", n, line.strip()))
    return found


def _allowed(rel: str, qual: str, allow: set[str]) -> bool:
    if any(rel == a or rel.startswith(a + "/") for a in allow if "::" not in a):
        return True
    parts = qual.split(".")
    return any(f"{rel}::{'.'.join(parts[:k])}" in allow for k in range(1, len(parts) + 1))


def test_each_mode_is_read_only_where_it_is_decided() -> None:
    bad = []
    for mode, (patterns, allow) in MODES.items():
        for rel, hits in readers(PACKAGE, patterns).items():
            for qual, n, line in hits:
                if not _allowed(rel, qual, allow):
                    bad.append(f"{mode}: hf_megatrain/{rel}:{n} ({qual or 'module'}): {line}")
    assert not bad, ("a mode read outside where it is decided (hand the module the decided strategy instead: "
                     "core/plan.py StepModes / UnitPlan, optim/ranks.py):\n" + "\n".join(bad))


def test_the_allow_list_names_only_readers_that_exist() -> None:
    """No stale entry: each allowed place (a module, or a function) reads its mode (the list shrinks with them)."""
    stale = []
    for mode, (patterns, allow) in MODES.items():
        found = readers(PACKAGE, patterns)
        for a in allow - REFUSALS:
            path, _, qual = a.partition("::")
            hits = [(q, n) for rel, hs in found.items() if rel == path or rel.startswith(path + "/") for q, n, _ in hs]
            if not any(not qual or q == qual or q.startswith(qual + ".") for q, _ in hits):
                stale.append(f"{mode}: {a}")
    assert not stale, "allow-list entries that no longer read their mode (remove them):\n" + "\n".join(stale)


def test_decide_modes_decides_each_mode_once_from_the_config_and_plans() -> None:
    """The one resolution: ``auto`` off a GPU is the fused kernel; narrow gradients need a kernel that reads them,
    bf16 compute, FP32 offload and one process; lean plans consume their gradients and never speculate."""
    from hf_megatrain.config import MegaTrainConfig
    from hf_megatrain.core.kernels import HostKernel
    from hf_megatrain.core.plan import PlanInputs, build_plans, decide_modes

    inputs = PlanInputs(numels=[64, 64, 32], frozen_numels=[0, 0, 0], device_type="cpu")

    def modes(data_parallel: bool = False, **kw: object):
        cfg = MegaTrainConfig(**{"compute_dtype": "bfloat16", "resident_placement": "host", **kw})
        return decide_modes(cfg, build_plans(inputs, cfg), "cpu", data_parallel)

    auto = modes()
    assert (auto.host_kernel, auto.narrow, auto.speculate, auto.consume) == (HostKernel.FUSED, None, True, False)
    native = modes(host_kernel="native")
    assert native.narrow is torch.bfloat16 and native.host_kernel is HostKernel.NATIVE
    assert modes(data_parallel=True, host_kernel="native").narrow is None
    assert modes(host_kernel="native", narrow_grads=False).narrow is None
    assert modes(host_kernel="native", compute_dtype="float32").narrow is None
    lean = modes(lean_store=True)
    assert lean.consume and not lean.speculate
    assert not modes(speculative_step=False).speculate
    assert native.describe() == {"host_kernel": "native", "speculative_step": True, "narrow_grads": True,
                                 "split_host_update": "auto"}
    assert modes().split == "off"  # (the fused kernel cannot write the weights alone)
    assert modes(data_parallel=True, host_kernel="native").split == "auto"  # (ranks split their shards' updates)


def test_code_lines_blank_strings_and_comments() -> None:
    src = 'x = "lean_store"  # lean_store\nif cfg.lean_store:\n    """lean_store\n    lean_store"""\n'
    assert [bool(re.search(r"lean_store", line)) for line in code_lines(src)] == [False, True, False, False]


if __name__ == "__main__":
    root = Path(sys.argv[1]) if len(sys.argv) > 1 else PACKAGE
    for mode, (patterns, _) in MODES.items():
        found = readers(root, patterns)
        print(f"{mode}: {sum(len(h) for h in found.values())} lines in {len(found)} files")
        for rel, hits in found.items():
            print(f"    {rel}: {len(hits)}  ({', '.join(sorted({q or 'module' for q, _, _ in hits}))})")
