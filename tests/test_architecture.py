"""The package's structure, checked from its source (``ast``, nothing imported): no import
cycle, no use of another module's private names, a one-line job for every folder, and no
test reaching into a Checkpointer's private attributes.

The layers themselves (cli/integrations -> facade -> saving/loading -> roots -> ranks ->
format/threads) are ``import-linter`` contracts in ``pyproject.toml`` (``make lint``); these
checks need nothing installed. Imports under ``if TYPE_CHECKING:`` are left out (they never
run); an import inside a function counts like any other: a lazy import that only dodges a
cycle is still a cycle.
"""

from __future__ import annotations

import ast
from dataclasses import dataclass, field
from pathlib import Path

import pytest

PKG = Path(__file__).resolve().parent.parent / "asyncckpt"


@dataclass
class Module:
    name: str
    path: Path
    is_pkg: bool
    tree: ast.Module
    imports: set[str] = field(default_factory=set)  # modules of the package it imports
    private: list[str] = field(default_factory=list)  # "line: what" for each private use


def _type_checking_nodes(tree: ast.Module) -> set[int]:
    """ids of the statements under ``if TYPE_CHECKING:`` (or ``typing.TYPE_CHECKING``)."""
    out: set[int] = set()
    for n in ast.walk(tree):
        if isinstance(n, ast.If) and "TYPE_CHECKING" in ast.unparse(n.test):
            for stmt in n.body:
                out.update(id(x) for x in ast.walk(stmt))
    return out


def _absolute(mod: Module, level: int, name: str | None) -> str:
    base = mod.name.split(".") if mod.is_pkg else mod.name.split(".")[:-1]
    if level > 1:
        base = base[: len(base) - (level - 1)]
    return ".".join(base + ([name] if name else []))


def _private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__")


def _package() -> dict[str, Module]:
    mods: dict[str, Module] = {}
    for p in sorted(PKG.rglob("*.py")):
        parts = list(p.relative_to(PKG.parent).with_suffix("").parts)
        is_pkg = parts[-1] == "__init__"
        if is_pkg:
            parts = parts[:-1]
        name = ".".join(parts)
        mods[name] = Module(name, p, is_pkg, ast.parse(p.read_text(), str(p)))
    for mod in mods.values():
        skip = _type_checking_nodes(mod.tree)
        bound: dict[str, str] = {}  # a name bound to a module of the package -> that module
        for n in ast.walk(mod.tree):
            if id(n) in skip:
                continue
            if isinstance(n, ast.ImportFrom):
                target = _absolute(mod, n.level, n.module) if n.level else (n.module or "")
                if target != "asyncckpt" and not target.startswith("asyncckpt."):
                    continue
                for a in n.names:
                    sub = f"{target}.{a.name}"
                    if sub in mods:  # a module: `from . import _x`
                        mod.imports.add(sub)
                        bound[a.asname or a.name] = sub
                        continue
                    if target in mods and target != mod.name:
                        mod.imports.add(target)
                    if _private(a.name) and target != mod.name:
                        mod.private.append(f"{n.lineno}: from {target} import {a.name}")
            elif isinstance(n, ast.Import):
                for a in n.names:
                    if a.name in mods and a.name != mod.name:
                        mod.imports.add(a.name)
                        if a.asname:
                            bound[a.asname] = a.name
        # `_x._private` through a module bound by an import
        for n in ast.walk(mod.tree):
            if (isinstance(n, ast.Attribute) and isinstance(n.value, ast.Name) and n.value.id in bound
                    and _private(n.attr) and f"{bound[n.value.id]}.{n.attr}" not in mods):
                mod.private.append(f"{n.lineno}: {bound[n.value.id]}.{n.attr}")
        mod.imports.discard(mod.name)
    return mods


def _cycles(mods: dict[str, Module]) -> list[list[str]]:
    """Strongly connected components of more than one module (iterative Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    out: list[list[str]] = []
    for root in mods:
        if root in index:
            continue
        work = [(root, iter(sorted(mods[root].imports)))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on.add(root)
        while work:
            v, it = work[-1]
            for w in it:
                if w not in index:
                    index[w] = low[w] = len(index)
                    stack.append(w)
                    on.add(w)
                    work.append((w, iter(sorted(mods[w].imports))))
                    break
                if w in on:
                    low[v] = min(low[v], index[w])
            else:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[v])
                if low[v] == index[v]:
                    comp = []
                    while True:
                        w = stack.pop()
                        on.discard(w)
                        comp.append(w)
                        if w == v:
                            break
                    if len(comp) > 1:
                        out.append(sorted(comp))
    return out


@pytest.fixture(scope="module")
def mods() -> dict[str, Module]:
    return _package()


def test_no_import_cycles(mods: dict[str, Module]) -> None:
    cycles = _cycles(mods)
    assert not cycles, "import cycles (move the shared part down, do not hide the import in a function):\n" + "\n".join(
        " <-> ".join(c) for c in cycles
    )


def test_no_module_uses_another_modules_private_names(mods: dict[str, Module]) -> None:
    found = [f"{m.name}:{p}" for m in mods.values() for p in m.private]
    assert not found, "private names used across modules (make them public in their module):\n" + "\n".join(found)


def test_every_folder_says_its_job(mods: dict[str, Module]) -> None:
    for m in mods.values():
        if m.is_pkg:
            doc = ast.get_docstring(m.tree)
            assert doc, f"{m.path}: a folder's __init__ starts with a docstring saying its one job"


def test_the_checker_sees_a_cycle_and_a_private_import(tmp_path: Path) -> None:
    """The checks have teeth: a two-module cycle through a lazy import, and a private name."""
    pkg = tmp_path / "asyncckpt"
    pkg.mkdir()
    (pkg / "__init__.py").write_text('"""x"""\n')
    (pkg / "a.py").write_text("from .b import f\n")
    (pkg / "b.py").write_text("def f():\n    from .a import _g\n")
    global PKG
    saved, PKG = PKG, pkg
    try:
        mods = _package()
    finally:
        PKG = saved
    assert _cycles(mods) == [["asyncckpt.a", "asyncckpt.b"]]
    assert mods["asyncckpt.b"].private == ["2: from asyncckpt.a import _g"]


# ------------------------------------------------------------- tests use public seams only
TESTS = Path(__file__).resolve().parent
#: names the tests commonly give a Checkpointer, checked even where the binding is not seen
CHECKPOINTER_NAMES = frozenset({"ck", "ckpt", "c"})


def _is_checkpointer(node: ast.expr | None) -> bool:
    """``Checkpointer(...)``/``asyncckpt.Checkpointer(...)`` (a call), or the annotation ``Checkpointer``."""
    if isinstance(node, ast.Call):
        node = node.func
    if isinstance(node, ast.Constant) and isinstance(node.value, str):  # a string annotation
        return node.value.rsplit(".", 1)[-1] == "Checkpointer"
    return isinstance(node, (ast.Name, ast.Attribute)) and ast.unparse(node).rsplit(".", 1)[-1] == "Checkpointer"


def private_checkpointer_uses(source: str, filename: str = "<test>") -> list[str]:
    """``line: name._attr`` for each access to a private attribute (``_x``, not a dunder) of a
    Checkpointer in ``source``: of a name (or ``self.x``) bound anywhere in the file from
    ``Checkpointer(...)`` (assignment, ``with ... as``) or annotated ``Checkpointer``, and of
    the usual names :data:`CHECKPOINTER_NAMES`. A file-wide, flow-blind scan: simple on purpose.
    What a test may observe is public or a documented seam (``os_ops=``, ``staging_statistics()``,
    ``upload_states()``, docs/development.md "Fault injection")."""
    tree = ast.parse(source, filename)
    bound = set(CHECKPOINTER_NAMES)
    for n in ast.walk(tree):
        if isinstance(n, ast.Assign) and _is_checkpointer(n.value):
            bound.update(ast.unparse(t) for t in n.targets)
        elif isinstance(n, ast.AnnAssign) and (_is_checkpointer(n.value) or _is_checkpointer(n.annotation)):
            bound.add(ast.unparse(n.target))
        elif isinstance(n, (ast.With, ast.AsyncWith)):
            bound.update(ast.unparse(i.optional_vars) for i in n.items
                         if i.optional_vars is not None and _is_checkpointer(i.context_expr))  # fmt: skip
        elif isinstance(n, ast.arg) and _is_checkpointer(n.annotation):
            bound.add(n.arg)
    uses = [n for n in ast.walk(tree)
            if isinstance(n, ast.Attribute) and _private(n.attr) and ast.unparse(n.value) in bound]  # fmt: skip
    return [f"{n.lineno}: {ast.unparse(n)}" for n in sorted(uses, key=lambda n: (n.lineno, n.col_offset))]


def test_tests_use_no_private_attribute_of_a_checkpointer() -> None:
    """Tests observe a Checkpointer through its public API and documented seams, never its
    private parts (``ck._rt``, ``ck._books``, ...): a restructuring of its insides must not
    break them, and what they check is what a user can rely on. tests/support/ included."""
    found = [f"{p.relative_to(TESTS)}:{use}" for p in sorted(TESTS.rglob("*.py"))
             for use in private_checkpointer_uses(p.read_text(), str(p))]  # fmt: skip
    assert not found, "tests reaching into a Checkpointer's private attributes (use its public API " \
        "or a documented seam; add a small documented public one if none fits):\n" + "\n".join(found)


def test_the_test_checker_sees_a_private_reach() -> None:
    src = (
        "import asyncckpt\nfrom asyncckpt import Checkpointer\n"
        "x = Checkpointer(r)\nx._books.lock\n"
        "with asyncckpt.Checkpointer(r) as y:\n    y._waits.flush_steps(2.0)\n"
        "def f(z: Checkpointer, w: 'Checkpointer') -> None:\n    z._session\n    w._loader\n"
        "class T:\n    def setup(self):\n        self.k = Checkpointer(r)\n        self.k._pipeline\n"
        "ck._rt.stopped\n"
        "other._rt\nck.__class__\nck.save(1, {})\n"
    )
    assert private_checkpointer_uses(src) == [
        "4: x._books", "6: y._waits", "8: z._session", "9: w._loader", "13: self.k._pipeline", "14: ck._rt",
    ]
