"""The package's layering, checked from its import statements (so it stays).

``LAYERS`` is the one statement of it (docs/architecture.md "Package layout" shows the same line, checked below).
Every import statement of every module under hf_megatrain/ counts: top-level and inside functions, absolute
(``hf_megatrain.x``) and relative, and those under ``if TYPE_CHECKING:`` too (no exemption: an annotation that
needs a higher layer's type is a dependency on it; code below the engine types it with ``core/engine_view.py``).
Imports made from strings (``importlib.import_module`` in the package's lazy ``__getattr__``) are not seen; the
package ``__init__`` is at the top, where they may point anywhere.

Rules: a module imports only from its own component or a lower layer, or a sibling of its layer where that makes
no cycle; ``config`` is a leaf; the graph between components has no cycle; nothing below ``hf`` imports
accelerate, TRL or transformers' Trainer (the same checked at run time, in a fresh interpreter, by
tests/test_entry_points.py::test_import_does_not_pull_in_accelerate_or_the_trainer, marked slow). Between modules
no cycle either, inside a package too: a module that needs a type of one above it takes it from a protocol below
both (``core/engine_view.py``), so each module can be read knowing only what it imports.
"""

from __future__ import annotations

import ast
import pathlib

PACKAGE = pathlib.Path(__file__).resolve().parent.parent / "hf_megatrain"
ROOT = "hf_megatrain"
TOP = "__init__"  # the package's own __init__.py (what ``import hf_megatrain`` runs)

# Bottom (0) to top. Components of one layer are siblings: they may import each other where that makes no cycle.
LAYERS: tuple[tuple[str, ...], ...] = (
    ("config", "core"),  # config.py is a leaf; core may import config
    ("checkpoint",),
    ("model",),
    ("optim", "planner", "parallel", "export"),
    ("engine",),
    ("hf",),
    (TOP, "cli"),
)
LEAVES = ("config",)
LAYER_OF = {c: i for i, layer in enumerate(LAYERS) for c in layer}
HF_LAYER = LAYER_OF["hf"]
# Only hf/ (and what sits above it) may import these: `import hf_megatrain` must not pull them in.
TRAINER_MODULES = ("accelerate", "trl", "transformers.trainer", "transformers.training_args")
TRAINER_NAMES = ("Trainer", "TrainingArguments", "Seq2SeqTrainer", "Seq2SeqTrainingArguments")


def docs_line() -> str:
    """The layering as docs/architecture.md states it (bottom to top)."""
    show = {TOP: "hf_megatrain/__init__.py", "cli": "cli.py", "config": "config.py"}
    return "Layers, bottom to top: " + " <- ".join(", ".join(show.get(c, c + "/") for c in layer) for layer in LAYERS)


def module_name(path: pathlib.Path) -> str:
    parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def component(module: str) -> str:
    """``hf_megatrain.engine.runtime`` -> ``engine``; ``hf_megatrain.config`` -> ``config``; the package -> TOP."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else TOP


def imports(source: str, module: str, is_package: bool) -> list[tuple[str, int]]:
    """(imported module, line) for every import statement in ``source`` (any depth), relative ones resolved
    against ``module``. ``from <pkg> import name`` yields ``<pkg>.name`` when that is a submodule of the package,
    else ``<pkg>`` (the name is an attribute of it)."""
    out = []
    package = module if is_package else module.rpartition(".")[0]
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            out += [(a.name, node.lineno) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[:len(base) - (node.level - 1)]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            for a in node.names:
                sub = f"{target}.{a.name}"
                is_sub = target.startswith(ROOT) and _exists(sub)
                out.append((sub if is_sub else target, node.lineno))
    return out


def _exists(module: str) -> bool:
    rel = pathlib.Path(*module.split(".")[1:])
    return (PACKAGE / rel).is_dir() or (PACKAGE / rel).with_suffix(".py").is_file()


def package_imports() -> list[tuple[str, str, int]]:
    """(importing module, imported module, line) for every import inside hf_megatrain/."""
    out = []
    for path in sorted(PACKAGE.rglob("*.py")):
        if "examples_data" in path.relative_to(PACKAGE).parts:  # the examples' data shipped with the package
            continue
        mod = module_name(path)
        out += [(mod, target, line) for target, line in imports(path.read_text(), mod, path.name == "__init__.py")]
    return out


def component_graph() -> dict[str, dict[str, str]]:
    """component -> {imported component: an example "module:line -> target"}."""
    graph: dict[str, dict[str, str]] = {}
    for mod, target, line in package_imports():
        if target == ROOT or target.startswith(ROOT + "."):
            a, b = component(mod), component(target)
            if a != b:
                graph.setdefault(a, {}).setdefault(b, f"{mod}:{line} -> {target}")
    return graph


def test_parser_sees_every_kind_of_import():
    src = ("from __future__ import annotations\nimport os\nimport hf_megatrain.core.plan\nfrom ..config import X\n"
           "from .. import planner, __version__\nfrom . import runtime\nfrom typing import TYPE_CHECKING\n"
           "if TYPE_CHECKING:\n    from ..hf.trainer import T\n"
           "def f():\n    from ..parallel.group import DataParallel\n    import hf_megatrain.optim.adamw as a\n")
    got = [t for t, _ in imports(src, "hf_megatrain.engine.offload", is_package=False)]
    assert got[:2] == ["__future__", "os"]
    assert {t for t in got if t.startswith(ROOT)} == {
        "hf_megatrain.core.plan", "hf_megatrain.config", "hf_megatrain.planner", "hf_megatrain",
        "hf_megatrain.engine.runtime", "hf_megatrain.hf.trainer", "hf_megatrain.parallel.group",
        "hf_megatrain.optim.adamw"}
    # a package's own __init__ resolves "." to itself
    assert imports("from .group import G", "hf_megatrain.parallel", is_package=True)[0][0] == \
        "hf_megatrain.parallel.group"


def test_every_component_has_a_layer():
    found = {component(module_name(p)) for p in PACKAGE.rglob("*.py") if "examples_data" not in p.parts}
    assert found - set(LAYER_OF) == set(), "a new package or top-level module: give it a layer in LAYERS"


def test_nothing_imports_upward():
    bad = []
    for a, targets in component_graph().items():
        for b, where in targets.items():
            if a in LEAVES:
                bad.append(f"{where} ({a} is a leaf: it imports nothing of the package)")
            elif b in LAYER_OF and a in LAYER_OF and LAYER_OF[b] > LAYER_OF[a]:  # (unknown: the test above)
                bad.append(f"{where} ({a} is layer {LAYER_OF[a]}, {b} is layer {LAYER_OF[b]})")
    assert not bad, "upward imports: " + "; ".join(bad)


def _find_cycle(graph: dict[str, dict[str, str]]) -> list[str] | None:
    """One cycle of ``graph`` (node -> {node it imports: where}), as the nodes along it, or None."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done

    def visit(c: str, path: list[str]) -> list[str] | None:
        state[c] = 1
        for d in sorted(graph.get(c, {})):
            if state.get(d) == 1:
                return path[path.index(d):] + [d] if d in path else path + [d]
            if d not in state:
                cycle = visit(d, path + [d])
                if cycle:
                    return cycle
        state[c] = 2
        return None

    for c in sorted(graph):
        if c not in state:
            cycle = visit(c, [c])
            if cycle:
                return cycle
    return None


def _say_cycle(graph: dict[str, dict[str, str]], cycle: list[str]) -> str:
    return "import cycle: " + " -> ".join(f"{x} ({graph[x][y]})" for x, y in zip(cycle, cycle[1:]))


def test_no_cycle_between_components():
    graph = component_graph()
    cycle = _find_cycle(graph)
    assert cycle is None, _say_cycle(graph, cycle)


def test_no_cycle_between_modules():
    """Every import statement (in functions and under TYPE_CHECKING too) between the package's modules; the
    package's own ``__init__`` is left out (it sits at the top and loads lazily)."""
    graph: dict[str, dict[str, str]] = {}
    for mod, target, line in package_imports():
        if target.startswith(ROOT + ".") and target != mod:
            graph.setdefault(mod, {}).setdefault(target, f"{mod}:{line} -> {target}")
    cycle = _find_cycle(graph)
    assert cycle is None, _say_cycle(graph, cycle)


def _trainer_stack(name: str) -> bool:
    return any(name == m or name.startswith(m + ".") for m in TRAINER_MODULES) or \
        name in {f"transformers.{n}" for n in TRAINER_NAMES}


def test_only_hf_imports_the_trainer_stack():
    bad = []
    for path in sorted(PACKAGE.rglob("*.py")):
        mod = module_name(path)
        if "examples_data" in path.parts or LAYER_OF[component(mod)] >= HF_LAYER:
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and not node.level and node.module:
                names = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
            else:
                continue
            bad += [f"{mod}:{node.lineno} imports {n}" for n in names if _trainer_stack(n)]
    assert not bad, "only hf/ (and above) may import accelerate, TRL or transformers' Trainer: " + "; ".join(bad)


def test_docs_state_the_same_layers():
    text = (PACKAGE.parent / "docs" / "architecture.md").read_text()
    assert docs_line() in text, f"docs/architecture.md 'Package layout' should say: {docs_line()}"

