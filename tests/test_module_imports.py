"""Every module of fzero says truly, in its docstring's ``Imports:`` line, which of fzero's modules
it imports (a reader knows from the file what it may use), and the import order has no cycle."""

from __future__ import annotations

import ast
import pathlib
import re

import pytest

import fzero

ROOT = pathlib.Path(fzero.__file__).parent
MODULES = sorted(p for p in ROOT.rglob("*.py") if p.name != "__main__.py")


def _name(path: pathlib.Path) -> str:
    """``dist/gloo.py`` -> ``dist.gloo``; a package's ``__init__.py`` -> the package."""
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts) or "fzero"


KNOWN = {_name(p) for p in MODULES} - {"fzero"}


def _package(path: pathlib.Path) -> list[str]:
    parts = list(path.relative_to(ROOT).parts[:-1])
    return parts


def imported(path: pathlib.Path) -> set[str]:
    """The fzero modules ``path`` imports, anywhere in it (relative or absolute imports)."""
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = _package(path)[: len(_package(path)) - (node.level - 1)]
                mod = ".".join([*base, *(node.module.split(".") if node.module else [])])
            elif node.module and node.module.startswith("fzero"):
                mod = node.module[len("fzero."):] if node.module != "fzero" else ""
            else:
                continue
            for alias in node.names:  # ``from . import x``: x may be a module
                sub = f"{mod}.{alias.name}" if mod else alias.name
                out.add(sub if sub in KNOWN else mod)
        elif isinstance(node, ast.Import):
            out |= {a.name[len("fzero."):] for a in node.names if a.name.startswith("fzero.")}
    out.discard("")
    out.discard(_name(path))
    return {m for m in out if m in KNOWN}


def declared(path: pathlib.Path) -> set[str] | None:
    """The modules the docstring's ``Imports:`` sentence names (``fzero.`` prefixes, backticks
    and other packages' names aside; a sibling may be named without its package)."""
    doc = ast.get_docstring(ast.parse(path.read_text())) or ""
    m = re.search(r"^Imports:(.*?)(?:\.\s*$|\.\s*\n|\Z)", doc, re.S | re.M)
    if m is None:
        return None
    package = ".".join(_package(path))
    out = set()
    for word in re.findall(r"[A-Za-z_][A-Za-z_.]*", m.group(1)):
        word = word.removeprefix("fzero.").strip(".")
        for candidate in (word, f"{package}.{word}" if package else word):
            if candidate in KNOWN:
                out.add(candidate)
    return out


@pytest.mark.parametrize("path", MODULES, ids=[_name(p) for p in MODULES])
def test_the_docstring_names_what_the_module_imports(path):
    said = declared(path)
    if path.name == "__init__.py" and path.parent == ROOT:
        return  # the package's contract: it re-exports the pieces
    assert said is not None, f"{_name(path)}: no 'Imports:' line in its docstring"
    assert said == imported(path), (f"{_name(path)}: says {sorted(said)}, imports {sorted(imported(path))}")


def test_no_import_cycles():
    graph = {_name(p): imported(p) for p in MODULES}
    graph.pop("fzero", None)
    done: set[str] = set()

    def visit(node: str, path: tuple[str, ...]) -> None:
        assert node not in path, " -> ".join((*path, node))
        if node in done:
            return
        for nxt in graph.get(node, ()):
            if nxt != "fzero":
                visit(nxt, (*path, node))
        done.add(node)

    for node in graph:
        visit(node, ())
