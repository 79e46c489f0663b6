"""The core's architecture, as its packages declare it: imports run one way.

Every `import` in the first-party code counts, also those inside functions (lazy) and under `if TYPE_CHECKING`
(types only): a module that needs another only lazily still depends on it. Read with `ast`, nothing is imported.
"""

from __future__ import annotations

import ast
import functools
import re
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
# Folder -> the package it installs as: qerl/ itself, and the top-level folders pyproject.toml maps under qerl.
FIRST_PARTY = {"qerl": "qerl", **{folder: package for package, folder in
                                  tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
                                  ["package-dir"].items()}}


def modules() -> dict[str, Path]:
    """Dotted name -> file, for every first-party module (a package is its `__init__.py`)."""
    found = {}
    for folder, package in FIRST_PARTY.items():
        for path in sorted((ROOT / folder).rglob("*.py")):
            parts = path.relative_to(ROOT / folder).with_suffix("").parts
            found[".".join([package, *(parts[:-1] if parts[-1] == "__init__" else parts)])] = path
    return found


def imports(name: str, path: Path, known: dict[str, Path]) -> set[str]:
    """The first-party modules `name` imports anywhere in its file. `from pkg import x` is the module `pkg.x` where
    that is one, else `pkg`; a name below a module (`import a.b.attr`) is its module."""

    def module_of(dotted: str) -> str | None:
        while dotted and dotted not in known:
            dotted = dotted.rpartition(".")[0]
        return dotted or None

    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), str(path))):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative: from the package, one level up per extra dot
                anchor = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                base = ".".join(anchor + ([base] if base else []))
            targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in known else base for a in node.names]
        else:
            continue
        found.update(m for t in targets if (m := module_of(t)) is not None and m != name)
    return found


@functools.cache
def graph() -> dict[str, set[str]]:
    known = modules()
    return {name: imports(name, path, known) for name, path in known.items()}


def cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """One cycle (a path back to its start) per strongly connected group of modules, found by Tarjan's algorithm."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    groups: list[set[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(edges.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            group = set()
            while True:
                w = stack.pop()
                on_stack.discard(w)
                group.add(w)
                if w == v:
                    break
            if len(group) > 1:
                groups.append(group)

    for v in sorted(edges):
        if v not in index:
            visit(v)
    return [_path_around(sorted(g)[0], g, edges) for g in groups]


def _path_around(start: str, group: set[str], edges: dict[str, set[str]]) -> list[str]:
    """The shortest import path from `start` back to itself inside `group` (breadth first)."""
    previous: dict[str, str] = {}
    frontier = [start]
    while frontier:
        nxt = []
        for v in frontier:
            for w in sorted(edges[v] & group):
                if w == start:
                    path = [v]
                    while path[-1] != start:
                        path.append(previous[path[-1]])
                    return [start] + path[::-1][1:] + [start] if len(path) > 1 else [start, start]
                if w not in previous:
                    previous[w] = v
                    nxt.append(w)
        frontier = nxt
    raise AssertionError(f"{start} is in a cycle but no path returns to it")


def test_no_two_modules_import_each_other_even_lazily_or_for_types():
    found = cycles(graph())
    assert not found, "import cycles (each must run one way): " + "; ".join(" -> ".join(c) for c in found)


def test_the_cycle_finder_names_the_cycle():
    edges = {"a": {"b"}, "b": {"c"}, "c": {"a", "d"}, "d": set(), "e": {"e"} - {"e"}}
    assert cycles(edges) == [["a", "b", "c", "a"]]
    assert cycles({"x": {"y"}, "y": {"x"}}) == [["x", "y", "x"]]


def test_imports_are_read_lazily_and_for_types_too(tmp_path):
    (tmp_path / "p").mkdir()
    (tmp_path / "p" / "__init__.py").write_text("")
    (tmp_path / "p" / "a.py").write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from p.b import B\n")
    (tmp_path / "p" / "b.py").write_text("def f():\n    from . import a\n    import p.c.thing\n")
    (tmp_path / "p" / "c.py").write_text("")
    known = {"p": tmp_path / "p/__init__.py", **{f"p.{m}": tmp_path / f"p/{m}.py" for m in "abc"}}
    edges = {n: imports(n, f, known) for n, f in known.items()}
    assert edges == {"p": set(), "p.a": {"p.b"}, "p.b": {"p.a", "p.c"}, "p.c": set()}
    assert cycles(edges) == [["p.a", "p.b", "p.a"]]


# ---------------------------------------------------------------------------------------------------------------------
# The packages of the core: each says in its docstring what it owns and what it may import.
# ---------------------------------------------------------------------------------------------------------------------

PACKAGES = sorted(p.parent.name for p in (ROOT / "qerl").glob("*/__init__.py"))


def unit(module: str) -> str:
    """The part of qerl a module belongs to: its package under qerl/ or, at the top, the module itself."""
    parts = module.split(".")
    return ".".join(parts[:2]) if parts[0] == "qerl" else parts[0]


def allowed(package: str) -> set[str]:
    doc = ast.get_docstring(ast.parse((ROOT / "qerl" / package / "__init__.py").read_text())) or ""
    found = re.search(r"^May import: (.*?)(?:\(|\.?$)", doc, re.M)
    assert found, f"qerl/{package}/__init__.py: its docstring has no 'May import:' line"
    return {name.strip() for name in found.group(1).split(",") if name.strip()}


@pytest.mark.parametrize("package", PACKAGES)
def test_each_package_says_what_it_owns_and_imports_only_what_it_says(package):
    doc = ast.get_docstring(ast.parse((ROOT / "qerl" / package / "__init__.py").read_text())) or ""
    assert "Owns" in doc or "owns" in doc, f"qerl/{package}/__init__.py: say what the package owns"
    may = allowed(package) | {f"qerl.{package}", "qerl"}  # itself, and the root (qerl.__version__)
    wrong = sorted(f"{m} -> {t}" for m, targets in graph().items() if unit(m) == f"qerl.{package}"
                   for t in targets if unit(t) not in may)
    assert not wrong, f"qerl.{package} may import {', '.join(sorted(allowed(package)))}, but: " + "; ".join(wrong)


def test_the_packages_depend_on_each_other_one_way():
    """What the docstrings allow is itself a one-way order (no two packages may import each other)."""
    edges = {f"qerl.{p}": {a for a in allowed(p) if a.startswith("qerl.") and a.count(".") == 1
                           and (ROOT / "qerl" / a.split(".")[1] / "__init__.py").exists()} for p in PACKAGES}
    assert not cycles(edges), cycles(edges)


def layers() -> list[str]:
    """The parts in the order `qerl/__init__.py`'s docstring lists them, bottom up (`run/` is qerl.run)."""
    doc = ast.get_docstring(ast.parse((ROOT / "qerl" / "__init__.py").read_text())) or ""
    return ["qerl." + m.group(1) for m in re.finditer(r"^ {4}(\w+)/?\s{2,}", doc, re.M)]


def test_qerl_lists_every_part_once():
    modules = {f"qerl.{p.stem}" for p in (ROOT / "qerl").glob("*.py")} - {"qerl.__init__"}
    parts = {f"qerl.{p}" for p in PACKAGES} | modules
    assert sorted(layers()) == sorted(parts)


def test_every_part_imports_only_parts_listed_before_it():
    order = {part: i for i, part in enumerate(layers())}
    wrong = sorted(f"{m} -> {t}" for m, targets in graph().items() if unit(m) in order
                   for t in targets if unit(t) in order and order[unit(t)] > order[unit(m)])
    assert not wrong, "imports against the order of qerl/__init__.py's docstring: " + "; ".join(wrong)
