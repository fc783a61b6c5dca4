"""No test touches a private member of hf_megatrain (issue 30, "Tests in tiers"): tests go through the public API,
so the package's internals can change without rewriting them.

Every ``tests/*.py`` is parsed (``ast``, no import) and these fail when ``_name`` (one leading underscore, not a
dunder) is a name the package's own source defines -- a ``def`` or ``class``, or an assignment target
(``self._cache = ...``, ``_FLAGS = [...]``, ``fn._marker = True``):

- an attribute ``x._name``, read, written or called (``engine.executor.rows._probe``, ``trainer._mt_config``);
- ``getattr`` / ``setattr`` / ``hasattr`` / ``delattr`` (and ``monkeypatch.setattr``) with the string ``"_name"``,
  or ``monkeypatch.setattr("hf_megatrain.module._name", ...)``;
- ``from hf_megatrain... import _name``.

Keyed on the package's names rather than on where ``x`` comes from, so it needs no type inference and stays robust:
a private name of torch / transformers / accelerate that the package does not define (``torch._dynamo``,
``config._attn_implementation``, ``AcceleratorState._reset_state``, ``os._exit``) is not the package's and passes;
attributes of ``self`` / ``cls`` are the test's own classes (fakes, stubs) and pass. A private name the package
defines *because* a library asks for it (overriding a hook) is listed in ``ALLOWED`` with the reason.
"""

from __future__ import annotations

import ast
import functools
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "hf_megatrain"
TESTS = ROOT / "tests"

ALLOWED: dict[str, str] = {
    # transformers.Trainer's own hook (its name and signature), which MegaTrainTrainer overrides; Trainer has no
    # public call that writes one checkpoint outside its loop, and the crash tests interrupt exactly one such save
    # (tests/test_crash_safe_saves.py), calling it as Trainer's loop does.
    "_save_checkpoint": "transformers.Trainer's checkpoint hook, overridden by MegaTrainTrainer",
}
NAME_CALLS = {"getattr", "setattr", "hasattr", "delattr"}


def is_private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__")


def _targets(node: ast.AST) -> list[ast.AST]:
    if isinstance(node, ast.Assign):
        return list(node.targets)
    if isinstance(node, (ast.AnnAssign, ast.AugAssign)):
        return [node.target]
    return []


def _names_of(target: ast.AST):
    if isinstance(target, ast.Name):
        yield target.id
    elif isinstance(target, ast.Attribute):
        yield target.attr
    elif isinstance(target, (ast.Tuple, ast.List)):
        for t in target.elts:
            yield from _names_of(t)
    elif isinstance(target, ast.Starred):
        yield from _names_of(target.value)


def defined_private_names(tree: ast.AST) -> set[str]:
    """Private names a module defines: functions, classes, assignment targets (plain names and attributes)."""
    out: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            out.add(node.name)
        for t in _targets(node):
            out.update(_names_of(t))
    return {n for n in out if is_private(n)}


@functools.lru_cache(maxsize=None)
def package_private_names() -> frozenset[str]:
    names: set[str] = set()
    for path in PACKAGE.rglob("*.py"):
        names |= defined_private_names(ast.parse(path.read_text()))
    return frozenset(names)


def private_uses(source: str, private: frozenset[str] | set[str]) -> list[tuple[int, str]]:
    """(line, what) for every use of a name in ``private`` that this module's docstring lists."""
    found: list[tuple[int, str]] = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Attribute) and node.attr in private:
            owner = node.value.id if isinstance(node.value, ast.Name) else None
            if owner not in ("self", "cls"):
                found.append((node.lineno, f".{node.attr}"))
        elif isinstance(node, ast.Call) and node.args:
            fn = node.func
            called = fn.id if isinstance(fn, ast.Name) else fn.attr if isinstance(fn, ast.Attribute) else None
            name = node.args[1] if len(node.args) >= 2 else None
            dotted = node.args[0].value if isinstance(node.args[0], ast.Constant) else None
            if called in NAME_CALLS and isinstance(name, ast.Constant) and name.value in private:
                found.append((node.lineno, f"{called}(..., {name.value!r})"))
            elif called in NAME_CALLS and isinstance(dotted, str) and dotted.startswith("hf_megatrain.") \
                    and dotted.rsplit(".", 1)[-1] in private:
                found.append((node.lineno, f"{called}({dotted!r}, ...)"))
        elif isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == "hf_megatrain":
            for alias in node.names:
                if is_private(alias.name):
                    found.append((node.lineno, f"from {node.module} import {alias.name}"))
    return found


def test_no_test_touches_a_private_member_of_the_package():
    private = package_private_names() - set(ALLOWED)
    bad = [f"tests/{path.name}:{line}: {what}" for path in sorted(TESTS.glob("*.py"))
           for line, what in private_uses(path.read_text(), private)]
    assert not bad, ("tests reach private members of hf_megatrain: go through a public API (make the member public "
                     "with a clear name if it is a component with a contract, or test the behaviour):\n"
                     + "\n".join(bad))


def test_the_allow_list_names_only_members_the_package_defines():
    stale = set(ALLOWED) - package_private_names()
    assert not stale, f"ALLOWED names the package no longer defines (remove them): {sorted(stale)}"


def test_the_scan_sees_reads_writes_name_calls_and_imports():
    src = ("from hf_megatrain.cli import _hidden, public\n"
           "x = engine.rows._cache\n"
           "engine._mt_config = 1\n"
           "monkeypatch.setattr(mod, '_FLAGS', [])\n"
           "getattr(f, '_marker', False)\n"
           "monkeypatch.setattr('hf_megatrain.core.kernels._FLAGS', [])\n"
           "self._cache = {}\n"  # (a test's own class)
           "torch._dynamo.reset()\n")  # (not the package's)
    private = {"_cache", "_mt_config", "_FLAGS", "_marker"}
    assert [line for line, _ in private_uses(src, private)] == [1, 2, 3, 4, 5, 6]
    defined = defined_private_names(ast.parse("_A = 1\nclass _B: pass\ndef f():\n    self._c, fn._d = 1, 2\n"))
    assert defined == {"_A", "_B", "_c", "_d"}
