"""checkpoint/, planner/ and export/ see the engine only through ``core.engine_view.EngineView``.

Two checks: a real (tiny) ``MegaTrainEngine`` satisfies the protocol, and the code below the engine reads no
engine attribute outside it (from the source: every ``engine.<name>`` and ``getattr(engine, "<name>")``).
"""

from __future__ import annotations

import ast
import pathlib

import pytest

from hf_megatrain import MegaTrainConfig, MegaTrainEngine
from hf_megatrain.core.engine_view import ENGINE_VIEW_MEMBERS, EngineView, LayerStackView, OptimizerStateIO
from hf_megatrain.engine.model_view import PresentingEngine

from .models import tiny

PACKAGE = pathlib.Path(__file__).resolve().parent.parent / "hf_megatrain"
BELOW_ENGINE = ("checkpoint", "planner", "export")

# Reads outside the protocol that remain (none: the executor's templates are ``engine.layer_templates()``, the
# activation pool's bytes an argument of ``planner.offloaded_layers_for``). An entry may only be removed, never added.
PENDING: set[tuple[str, str]] = set()


def _engine_reads(path: pathlib.Path) -> set[str]:
    """Names read off a variable called ``engine`` in one module (attribute access and getattr/hasattr)."""
    reads = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == "engine":
            reads.add(node.attr)
        elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in ("getattr", "hasattr")
              and len(node.args) >= 2 and isinstance(node.args[0], ast.Name) and node.args[0].id == "engine"
              and isinstance(node.args[1], ast.Constant)):
            reads.add(node.args[1].value)
    return reads


def test_below_engine_reads_only_the_view():
    outside = set()
    for pkg in BELOW_ENGINE:
        for path in sorted((PACKAGE / pkg).rglob("*.py")):
            rel = path.relative_to(PACKAGE).as_posix()
            outside |= {(rel, name) for name in _engine_reads(path) - ENGINE_VIEW_MEMBERS}
    assert outside <= PENDING, (
        f"{sorted(outside - PENDING)}: code below the engine reads engine attributes outside "
        "core/engine_view.py EngineView; use a member of the protocol (or add one there and on the engine)")


@pytest.fixture(scope="module")
def engine() -> MegaTrainEngine:
    return MegaTrainEngine(tiny("llama", num_hidden_layers=2), MegaTrainConfig(compute_dtype="float32"),
                           device="cpu")


def test_engine_satisfies_the_view(engine):
    assert isinstance(engine, EngineView)
    assert isinstance(engine, PresentingEngine)  # (what the converted model's presented methods read: model_view.py)
    assert isinstance(engine.stack, LayerStackView)
    assert engine.optimizer is None  # until create_optimizer
    assert isinstance(engine.create_optimizer(lr=1e-3), OptimizerStateIO)
    # members the protocol declares as attributes hold what it says they hold
    assert engine.stack.layers is engine.model.get_submodule(engine.stack.path)
    assert [u.index for u in engine.layer_units] + [engine.resident_unit.index] == \
        [u.index for u in engine.store.units]
    names = [n for n, _ in engine.named_master_tensors()]
    assert names == list(engine.store.by_name) and all(engine.writes_master(n) for n in names)
