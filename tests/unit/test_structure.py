"""The package's shape: no import cycles between its modules, and no module too big to read.

Modules are parsed with `ast`, never imported. Every import counts, wherever it
is written: at module level, inside a function (a lazy import that dodges a
cycle at import time is still a cycle in the design), and under
``if TYPE_CHECKING:`` (a type-only dependency is still a dependency: the two
modules cannot be understood, or moved, apart).

Resolution:

* ``import transfer.x.y`` is an edge to ``transfer.x.y`` (the longest prefix
  that is a module of the package);
* ``from .a import b`` / ``from ..a import b`` resolve relative to the importing
  module's package; ``from pkg import name`` is an edge to ``pkg.name`` when that
  is a module (so ``from .. import errors as E`` names ``transfer.errors``),
  else to ``pkg`` itself (its ``__init__``);
* imports of anything outside ``transfer`` are ignored.

A package's ``__init__`` importing its own submodules is an ordinary edge: if a
submodule imports the package back (``from . import x`` where ``x`` is not a
module), that is a cycle too.
"""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = "transfer"
ROOT = Path(__file__).resolve().parents[2] / PACKAGE
#: "Readable in one sitting". The largest today are the ring (its pure-Python twin of the
#: native queue) and the NIXL wrapper, near 900; every server and client module is under 450.
MAX_LINES = 900
#: The daemon's modules are read in one sitting: at most this many lines each.
MAX_SERVER_LINES = 450


EXTENSIONS = ("*.so", "*.pyd")


def modules(root: Path = ROOT, package: str = PACKAGE) -> dict[str, Path]:
    """Dotted module name -> file, for every .py under the package (and compiled extensions,
    which import nothing of ours: leaves of the graph)."""
    out: dict[str, Path] = {}
    for path in sorted(root.rglob("*.py")):
        rel = path.relative_to(root.parent).with_suffix("")
        parts = list(rel.parts)
        if parts[-1] == "__init__":
            parts.pop()
        out[".".join(parts)] = path
    for pattern in EXTENSIONS:
        for path in sorted(root.rglob(pattern)):
            rel = path.relative_to(root.parent)
            out[".".join([*rel.parts[:-1], path.name.split(".")[0]])] = path
    return out


def _bound_names(init: Path) -> set[str] | None:
    """Names a package's __init__ binds at top level; None if it has a star import (unknowable)."""
    names: set[str] = set()
    for node in ast.parse(init.read_text()).body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            for alias in node.names:
                if alias.name == "*":
                    return None
                names.add((alias.asname or alias.name).split(".")[0])
        else:
            for sub in ast.walk(node):
                if isinstance(sub, ast.Name) and isinstance(sub.ctx, ast.Store):
                    names.add(sub.id)
    return names


def _is_package(name: str, mods: dict[str, Path]) -> bool:
    return mods[name].name == "__init__.py"


def _resolve(target: str, mods: dict[str, Path]) -> str | None:
    """The module `target` names, or the closest enclosing module of the package."""
    parts = target.split(".")
    while parts:
        name = ".".join(parts)
        if name in mods:
            return name
        parts.pop()
    return None


def imports_of(name: str, mods: dict[str, Path]) -> set[str]:
    """Modules of the package that module `name` imports, anywhere in its body."""
    if mods[name].suffix != ".py":
        return set()  # a compiled extension
    tree = ast.parse(mods[name].read_text(), filename=str(mods[name]))
    # A module's own package, for relative imports: a package's __init__ is its own.
    package = name if _is_package(name, mods) else name.rpartition(".")[0]
    out: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name == PACKAGE or alias.name.startswith(PACKAGE + "."):
                    hit = _resolve(alias.name, mods)
                    if hit is not None:
                        out.add(hit)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                if node.level - 1 > len(base) - 1:
                    raise AssertionError(f"{name}: relative import beyond the top-level package")
                base = base[: len(base) - (node.level - 1)]
                if node.module:
                    base += node.module.split(".")
                source = ".".join(base)
            else:
                source = node.module or ""
                if not (source == PACKAGE or source.startswith(PACKAGE + ".")):
                    continue
            for alias in node.names:
                sub = f"{source}.{alias.name}"
                if alias.name != "*" and sub in mods:
                    out.add(sub)  # `from pkg import module`
                elif alias.name != "*" and _names_missing_module(source, alias.name, mods):
                    continue  # an optional compiled module that is not built here: a leaf
                else:
                    hit = _resolve(source, mods)
                    if hit is not None:
                        out.add(hit)
    return out


def _names_missing_module(source: str, attr: str, mods: dict[str, Path]) -> bool:
    """`from source import attr` where source is a package whose __init__ does not bind attr:
    attr can only be a submodule (one that does not exist in this checkout, e.g. unbuilt C)."""
    if source not in mods or not _is_package(source, mods):
        return False
    bound = _bound_names(mods[source])
    return bound is not None and attr not in bound


def import_graph(mods: dict[str, Path] | None = None) -> dict[str, set[str]]:
    mods = modules() if mods is None else mods
    return {name: imports_of(name, mods) for name in mods}


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module, or a module importing itself
    (Tarjan's algorithm, iterative); each sorted, the list sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    on_stack: set[str] = set()
    stack: list[str] = []
    found: list[list[str]] = []
    counter = 0
    for start in sorted(graph):
        if start in index:
            continue
        work = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = counter
        counter += 1
        stack.append(start)
        on_stack.add(start)
        while work:
            v, it = work[-1]
            for w in it:
                if w not in graph:
                    continue
                if w not in index:
                    index[w] = low[w] = counter
                    counter += 1
                    stack.append(w)
                    on_stack.add(w)
                    work.append((w, iter(sorted(graph[w]))))
                    break
                if w in on_stack:
                    low[v] = min(low[v], index[w])
            else:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[v])
                if low[v] == index[v]:
                    comp = []
                    while True:
                        w = stack.pop()
                        on_stack.discard(w)
                        comp.append(w)
                        if w == v:
                            break
                    if len(comp) > 1 or v in graph[v]:
                        found.append(sorted(comp))
    return sorted(found)


def _path(v: str, target: str, graph: dict[str, set[str]], within: set[str]) -> list[str]:
    """A shortest import chain v -> ... -> target inside one component (for the message)."""
    prev: dict[str, str] = {}
    frontier = [v]
    seen = {v}
    while frontier:
        nxt = []
        for a in frontier:
            for b in sorted(graph[a] & within):
                if b == target:
                    chain = [b, a]
                    while chain[-1] != v:
                        chain.append(prev[chain[-1]])
                    return chain[::-1]
                if b not in seen:
                    seen.add(b)
                    prev[b] = a
                    nxt.append(b)
        frontier = nxt
    return [v, target]


def describe_cycle(comp: list[str], graph: dict[str, set[str]]) -> str:
    within = set(comp)
    if len(comp) == 1:
        return f"{comp[0]} imports itself"
    first = comp[0]
    chain = _path(first, first, graph, within)
    rest = sorted(within - set(chain))
    return " -> ".join(chain) + (f"  (also in the cycle: {', '.join(rest)})" if rest else "")


def test_the_graph_sees_every_kind_of_import(tmp_path: Path) -> None:
    """The resolver itself, on a small package: absolute, relative, lazy, TYPE_CHECKING, aliases."""
    pkg = tmp_path / PACKAGE
    (pkg / "sub").mkdir(parents=True)
    files = {
        "__init__.py": "from .a import f\nfrom . import errors as E\n",
        "errors.py": "",
        "a.py": "def f():\n    from .sub import b  # lazy\n    return b\n",
        "sub/__init__.py": "",
        "sub/b.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from ..a import f\nimport transfer.errors\nfrom .. import c\n",
        "c.py": "import numpy\nfrom transfer.sub import b as bb\n",
        "d.py": "from . import f\nfrom . import _unbuilt_native\nfrom transfer import *\n",
        "_fast.cpython-311-x86_64-linux-gnu.so": "",
        "e.py": "from ._fast import g\nfrom . import _fast\n",
    }
    for rel, text in files.items():
        (pkg / rel).write_text(text)
    mods = modules(pkg, PACKAGE)
    graph = {n: imports_of(n, mods) for n in mods}
    assert graph == {
        "transfer": {"transfer.a", "transfer.errors"},
        "transfer.errors": set(),
        "transfer.a": {"transfer.sub.b"},
        "transfer.sub": set(),
        "transfer.sub.b": {"transfer.a", "transfer.errors", "transfer.c"},
        "transfer.c": {"transfer.sub.b"},
        "transfer.d": {"transfer"},
        "transfer._fast": set(),
        "transfer.e": {"transfer._fast"},
    }
    assert cycles(graph) == [["transfer.a", "transfer.c", "transfer.sub.b"]]
    assert cycles({"x": {"x"}}) == [["x"]]


def test_no_import_cycles() -> None:
    graph = import_graph()
    found = cycles(graph)
    report = "\n".join(f"  {describe_cycle(c, graph)}" for c in found)
    print(f"{len(found)} import cycle(s) in {PACKAGE}/:\n{report}")
    assert not found, f"{len(found)} import cycle(s) in {PACKAGE}/ (lazy and TYPE_CHECKING imports count):\n{report}"


def test_modules_are_small() -> None:
    too_big = {}
    for name, path in modules().items():
        if path.suffix != ".py":
            continue
        n = len(path.read_text().splitlines())
        if n > MAX_LINES:
            too_big[str(path.relative_to(ROOT.parent))] = n
    report = "\n".join(f"  {p}: {n} lines" for p, n in sorted(too_big.items(), key=lambda kv: -kv[1]))
    print(f"modules over {MAX_LINES} lines:\n{report}")
    assert not too_big, f"{len(too_big)} module(s) over {MAX_LINES} lines:\n{report}"


def test_the_daemons_modules_are_read_in_one_sitting() -> None:
    server = ROOT / "server"
    too_big = {p.name: n for p in sorted(server.glob("*.py")) if (n := len(p.read_text().splitlines())) > MAX_SERVER_LINES}
    assert not too_big, f"modules of transfer/server over {MAX_SERVER_LINES} lines: {too_big}"


if __name__ == "__main__":
    # `python tests/unit/test_structure.py`: every module of transfer/, its size, and what it imports
    # from inside the package (the graph the tests above check), then the cycles found.
    mods = modules()
    graph = import_graph(mods)
    for name in sorted(mods):
        if mods[name].suffix != ".py":
            continue  # a compiled extension: a leaf
        lines = len(mods[name].read_text().splitlines())
        deps = ", ".join(sorted(d.removeprefix(PACKAGE + ".") for d in graph.get(name, ())))
        print(f"{lines:5d}  {name.removeprefix(PACKAGE + '.') or PACKAGE}  ->  {deps or '-'}")
    print(f"cycles: {len(cycles(graph))}")
