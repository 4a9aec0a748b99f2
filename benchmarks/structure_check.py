"""The package's structure, measured: its import graph (cycles, layers) and the size of its files.

Reads the source, runs nothing: every ``import`` and ``from ... import`` of every module of the installed
package (``remat_compiler/``, and ``passes/`` and ``examples/``, installed as ``remat_compiler.passes`` and
``remat_compiler.examples``), function-local ones included, resolved to the module it names. Two graphs:

- modules: one node per module (a package's ``__init__`` is the package);
- groups: one node per top-level room (``remat_compiler.solvers.cpsat.choice`` counts as
  ``remat_compiler.solvers``, ``remat_compiler.passes.costs`` as ``remat_compiler.passes``), except the
  rooms :data:`SPANNING` names, whose modules sit on different layers and count one by one.

Each must have no cycle; its layers are then the longest import path below each node (layer 1 imports
nothing of the package), so no import runs back up a layer. Every ``.py`` file of the package and of
``passes/`` must be at most :data:`MAX_LINES` lines.

``python -m benchmarks.structure_check`` prints the figures and the layers of the groups, and exits 1
if a rule is broken; ``tests/test_structure.py`` asserts the same.
"""
from __future__ import annotations

import argparse
import ast
import sys
from dataclasses import dataclass, field
from pathlib import Path

import networkx as nx

__all__ = ["MAX_LINES", "ROOTS", "SPANNING", "Structure", "measure", "main"]

#: The most lines a file of the package (or of ``passes/``) may have.
MAX_LINES = 450
#: Where each part of the installed package lives in the repository: ``{module prefix: folder}``.
ROOTS = {"remat_compiler": "remat_compiler", "remat_compiler.passes": "passes",
         "remat_compiler.examples": "examples"}
#: Rooms whose modules sit on different layers, counted module by module in the groups' graph:
#: ``fsdp`` describes a sharded model's units (read by ``plan`` and ``module``) and holds its compiled
#: module (built on ``module`` and ``pipeline``).
SPANNING = ("remat_compiler.fsdp",)
#: The folders whose files the size rule covers.
SIZED = ("remat_compiler", "passes")


@dataclass
class Structure:
    """What :func:`measure` found.

    Attributes
    ----------
    modules : networkx.DiGraph
        Module ``a`` -> module ``b`` where ``a`` imports ``b``.
    groups : networkx.DiGraph
        The same, between top-level rooms.
    lines : dict of str to int
        Lines of each ``.py`` file the size rule covers, by path from the repository root.
    """

    modules: nx.DiGraph
    groups: nx.DiGraph
    lines: dict[str, int] = field(default_factory=dict)

    def cycles(self, graph: nx.DiGraph) -> list[list[str]]:
        """The strongly connected sets of more than one node, and the nodes that import themselves."""
        found = [sorted(c) for c in nx.strongly_connected_components(graph) if len(c) > 1]
        return found + [[n] for n in nx.nodes_with_selfloops(graph)]

    def over(self, max_lines: int = MAX_LINES) -> dict[str, int]:
        """The files longer than ``max_lines``."""
        return {path: n for path, n in sorted(self.lines.items()) if n > max_lines}

    def layers(self, graph: nx.DiGraph) -> dict[str, int]:
        """Each node's layer: 1 for a node that imports none of the others, else one more than the
        highest layer it imports (defined only without cycles)."""
        layer: dict[str, int] = {}
        for node in reversed(list(nx.topological_sort(graph))):
            layer[node] = 1 + max((layer[s] for s in graph.successors(node)), default=0)
        return layer


def _modules(repo: Path) -> dict[str, Path]:
    """Every module of the installed package: ``{dotted name: file}``."""
    found = {}
    for prefix, folder in ROOTS.items():
        base = repo / folder
        for path in sorted(base.rglob("*.py")):
            parts = list(path.relative_to(base).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts = parts[:-1]
            found[".".join([prefix, *parts])] = path
    return found


def _group(name: str) -> str:
    """The top-level room of a module: ``remat_compiler.<first part>`` (the module itself in a
    :data:`SPANNING` room)."""
    if any(name == room or name.startswith(room + ".") for room in SPANNING):
        return name
    return ".".join(name.split(".")[:2])


def _imports(name: str, path: Path, known: dict[str, Path]) -> set[str]:
    """The package's modules that the module ``name`` (its source at ``path``) imports."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")
                anchor = anchor[:len(anchor) - (node.level - 1)]
                base = ".".join(anchor + ([base] if base else []))
            targets = [f"{base}.{a.name}" for a in node.names] + [base]
            targets = [t for t in targets if t in known][:1] or [base]
        else:
            continue
        for target in targets:
            while target and target not in known:  # ``import a.b.c`` of a name inside a.b: a.b
                target = target.rpartition(".")[0]
            if target and target != name:
                found.add(target)
    return found


def measure(repo: Path | str = ".") -> Structure:
    """Read the package under ``repo`` (the repository root) and measure its structure.

    Returns
    -------
    Structure

    Example
    -------
    >>> s = measure(".")                                      # doctest: +SKIP
    >>> s.cycles(s.modules), s.over()                         # doctest: +SKIP
    ([], {})
    """
    repo = Path(repo)
    known = _modules(repo)
    modules, groups = nx.DiGraph(), nx.DiGraph()
    for name, path in known.items():
        modules.add_node(name)
        groups.add_node(_group(name))
        for target in _imports(name, path, known):
            modules.add_edge(name, target)
            if _group(target) != _group(name):
                groups.add_edge(_group(name), _group(target))
    lines = {str(p.relative_to(repo)): len(p.read_text().splitlines())
             for folder in SIZED for p in sorted((repo / folder).rglob("*.py"))}
    return Structure(modules, groups, lines)


def main(argv: list[str] | None = None) -> int:
    """Print the figures; return 1 if there is a cycle or a file over :data:`MAX_LINES`, else 0."""
    parser = argparse.ArgumentParser(prog="python -m benchmarks.structure_check", description=__doc__.split("\n")[0])
    parser.add_argument("--repo", default=str(Path(__file__).resolve().parents[1]))
    parser.add_argument("--max-lines", type=int, default=MAX_LINES)
    args = parser.parse_args(argv)
    s = measure(args.repo)
    largest = sorted(s.lines.items(), key=lambda kv: -kv[1])[:5]
    print(f"modules: {s.modules.number_of_nodes()}, import edges: {s.modules.number_of_edges()}, "
          f"cycles: {len(s.cycles(s.modules))}")
    print(f"groups: {s.groups.number_of_nodes()}, import edges: {s.groups.number_of_edges()}, "
          f"cycles: {len(s.cycles(s.groups))}")
    print(f"files: {len(s.lines)}, over {args.max_lines} lines: {len(s.over(args.max_lines))}; largest: "
          + ", ".join(f"{p} {n}" for p, n in largest))
    bad = s.cycles(s.modules) + s.cycles(s.groups)
    for cycle in bad:
        print("cycle:", " <-> ".join(cycle))
    for path, n in s.over(args.max_lines).items():
        print(f"over {args.max_lines} lines: {path} ({n})")
    if not bad:
        by_layer: dict[int, list[str]] = {}
        for node, k in s.layers(s.groups).items():
            by_layer.setdefault(k, []).append(node.removeprefix("remat_compiler.") or "remat_compiler")
        for k in sorted(by_layer, reverse=True):
            print(f"layer {k}: {', '.join(sorted(by_layer[k]))}")
    return 1 if bad or s.over(args.max_lines) else 0


if __name__ == "__main__":
    sys.exit(main())
