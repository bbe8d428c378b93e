"""Print the package's layout: lines per room, the biggest files, long classes and functions, import circles.

Usage::

    python3 scripts/layout.py [src/sparseety]

A *room* is a top-level subpackage or module of ``sparseety`` (``engine``, ``store``, ``config``...).
Every ``import`` statement counts, wherever it stands: at module level, inside a function (a lazy import
still makes the importing module depend on the imported one at run time) and under ``TYPE_CHECKING``
(a design dependency too). ``from a import b`` where ``a.b`` is a module counts as an import of ``a.b``.
A module circle is a set of modules that import each other (a strongly connected component of more
than one module); a package circle the same between rooms. :mod:`tests.test_layout` reads the same
:func:`scan` and fails on any circle.

Lengths are ``end_lineno - lineno + 1`` of the ``class`` or ``def`` statement (docstrings included);
a method is counted as a function of its module (``engine.context:begin_forward``).
"""

from __future__ import annotations

import ast
import sys
from collections import defaultdict
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path

#: packages whose subpackages are rooms of their own (the vLLM integration: vllm_api, transport, observe, evict)
SPLIT_ROOMS = ("sparseety.integrations.vllm",)
#: inside the vLLM integration, the rooms each room may import (the package's own modules, plugin and the
#: request-arg checks, may import every room): one direction, observe and evict never each other
VLLM_ROOMS = {"vllm_api": set(), "transport": {"vllm_api"}, "observe": {"vllm_api", "transport"},
              "evict": {"vllm_api", "transport"}}
CLASS_LIMIT = 300
FUNCTION_LIMIT = 80


@dataclass
class Layout:
    """What :func:`scan` found under one package root."""

    package: str
    modules: dict[str, Path]  #: dotted name -> file
    edges: dict[str, set[str]]  #: module -> modules of the package it imports (itself excluded)
    classes: list[tuple[int, str]] = field(default_factory=list)  #: (lines, "module.Class")
    functions: list[tuple[int, str]] = field(default_factory=list)  #: (lines, "module:function")
    lines: dict[str, int] = field(default_factory=dict)  #: module -> lines of its file

    def room(self, module: str) -> str:
        """The top-level subpackage or module of ``module`` (the package itself for its ``__init__``); inside a
        package of :data:`SPLIT_ROOMS` one level deeper (``integrations.vllm.observe``; the package's own modules,
        such as its ``plugin``, are the room ``integrations.vllm``)."""
        parts = module.split(".")
        for split in SPLIT_ROOMS:
            depth = split.count(".") + 1
            if parts[:depth] == split.split("."):
                path = self.modules.get(module)
                inner = len(parts) > depth + 1 or (len(parts) == depth + 1 and path is not None
                                                   and path.name == "__init__.py")
                return ".".join(parts[:depth + 1]) if inner else split
        return ".".join(parts[:2])

    def room_edges(self) -> dict[str, set[str]]:
        """Room -> rooms it imports (the package's own ``__init__`` left out: it only re-exports)."""
        adj: dict[str, set[str]] = defaultdict(set)
        for a, targets in self.edges.items():
            for b in targets:
                ra, rb = self.room(a), self.room(b)
                if ra != rb and self.package not in (ra, rb):
                    adj[ra].add(rb)
        return adj

    def module_circles(self) -> list[list[str]]:
        return strongly_connected(sorted(self.modules), self.edges)

    def package_circles(self) -> list[list[str]]:
        adj = self.room_edges()
        return strongly_connected(sorted(adj), adj)

    def short(self, name: str) -> str:
        return name.removeprefix(self.package + ".")


def module_name(path: Path, root: Path) -> str:
    parts = list(path.relative_to(root.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(parts)


def imported(node: ast.Import | ast.ImportFrom, module: str, is_package: bool, package: str,
             modules: Iterable[str]) -> set[str]:
    """The package's modules that one import statement names (absolute or relative)."""
    known = set(modules)
    if isinstance(node, ast.Import):
        return {a.name for a in node.names if a.name.split(".")[0] == package}
    if node.level:
        base = module.split(".") if is_package else module.split(".")[:-1]
        base = base[: len(base) - node.level + 1]
        target = ".".join(base + ([node.module] if node.module else []))
    else:
        target = node.module or ""
    if target.split(".")[0] != package:
        return set()
    return {target} | {f"{target}.{a.name}" for a in node.names if f"{target}.{a.name}" in known}


def scan(root: Path) -> Layout:
    """Parse every module under ``root`` (a package directory): imports, class and function lengths."""
    modules = {module_name(p, root): p for p in sorted(root.rglob("*.py"))}
    layout = Layout(root.name, modules, {})
    for name, path in modules.items():
        text = path.read_text()
        layout.lines[name] = len(text.splitlines())
        targets: set[str] = set()
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                targets |= imported(node, name, path.name == "__init__.py", root.name, modules)
            elif isinstance(node, ast.ClassDef):
                layout.classes.append((node.end_lineno - node.lineno + 1, f"{name}.{node.name}"))
            elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                layout.functions.append((node.end_lineno - node.lineno + 1, f"{name}:{node.name}"))
        layout.edges[name] = {t for t in targets if t in modules and t != name}
    return layout


def strongly_connected(nodes: list[str], adj: dict[str, set[str]]) -> list[list[str]]:
    """Tarjan's strongly connected components of more than one node, each sorted (iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    out: list[list[str]] = []
    for start in nodes:
        if start in index:
            continue
        work = [(start, iter(sorted(adj.get(start, ()))))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            v, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(adj.get(child, ())))))
                elif child in on_stack:
                    low[v] = min(low[v], index[child])
                continue
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
                if len(comp) > 1:
                    out.append(sorted(comp))
    return out


def report(layout: Layout) -> str:
    short = layout.short
    rooms: dict[str, int] = defaultdict(int)
    for name, n in layout.lines.items():
        rooms[short(layout.room(name))] += n
    biggest = sorted(layout.lines.items(), key=lambda x: -x[1])[:8]
    long_classes = [f"{short(n)} {length}" for length, n in sorted(layout.classes, reverse=True) if length > CLASS_LIMIT]
    long_functions = [f"{short(n)} {length}" for length, n in sorted(layout.functions, reverse=True)
                      if length > FUNCTION_LIMIT]
    largest_classes = [f"{short(n)} {length}" for length, n in sorted(layout.classes, reverse=True)[:5]]

    def circles(found: list[list[str]]) -> str:
        return " ; ".join(" <-> ".join(short(m) for m in c) for c in found) or "none"

    return "\n".join([
        "rooms (lines): " + ", ".join(f"{r} {n}" for r, n in sorted(rooms.items(), key=lambda x: -x[1])),
        "biggest files: " + ", ".join(f"{short(m)} {n}" for m, n in biggest),
        "biggest classes: " + ", ".join(largest_classes),
        f"classes over {CLASS_LIMIT} lines: " + (", ".join(long_classes) or "none"),
        f"functions over {FUNCTION_LIMIT} lines: " + (", ".join(long_functions) or "none"),
        "module circles: " + circles(layout.module_circles()),
        "package circles: " + circles(layout.package_circles()),
    ])


def main() -> None:
    root = Path(sys.argv[1] if len(sys.argv) > 1 else Path(__file__).resolve().parent.parent / "src" / "sparseety")
    print(report(scan(root)))


if __name__ == "__main__":
    main()
