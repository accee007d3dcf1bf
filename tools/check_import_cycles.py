"""Fail on any import cycle among our modules (run by `make lint`).

Builds the import graph of the given packages with grimp (import-linter's engine) and reports
every strongly connected component of more than one module: each is a set of modules that import
each other, directly or through others. Every import counts, including those inside functions and
under ``if TYPE_CHECKING:``: a deferred import hides a cycle from the interpreter, not from the
design. A component is printed with its members and the import lines that join them.

    python tools/check_import_cycles.py                 # the five layers
    python tools/check_import_cycles.py pkg_a pkg_b     # any importable packages

Exit status: 0 when there is no cycle, 1 when there is one (or more).
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable, Iterable, Sequence

import grimp

LAYERS = ("kthena_core", "kthena_comm", "mooncake_kv", "mooncake_ops", "kthena_serve")


def strongly_connected(nodes: Iterable[str],
                       successors: Callable[[str], Iterable[str]]) -> list[list[str]]:
    """Tarjan's algorithm, iterative; every component of the graph, each sorted, in sorted order."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    components: list[list[str]] = []
    for root in sorted(nodes):
        if root in index:
            continue
        work = [(root, iter(sorted(successors(root))))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is None:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[node])
                if low[node] == index[node]:
                    component = []
                    while True:
                        member = stack.pop()
                        on_stack.discard(member)
                        component.append(member)
                        if member == node:
                            break
                    components.append(sorted(component))
            elif child not in index:
                index[child] = low[child] = len(index)
                stack.append(child)
                on_stack.add(child)
                work.append((child, iter(sorted(successors(child)))))
            elif child in on_stack:
                low[node] = min(low[node], index[child])
    return sorted(components)


def find_cycles(graph: grimp.ImportGraph) -> list[list[str]]:
    """The components of `graph` with more than one module (each one or more import cycles)."""
    components = strongly_connected(graph.modules, graph.find_modules_directly_imported_by)
    return [c for c in components if len(c) > 1]


def describe(graph: grimp.ImportGraph, component: Sequence[str]) -> list[str]:
    """One line per import between members of `component`: importer, line number, the import."""
    members = set(component)
    lines = []
    for importer in component:
        for imported in sorted(graph.find_modules_directly_imported_by(importer) & members):
            for detail in graph.get_import_details(importer=importer, imported=imported):
                lines.append(f"    {importer}:{detail['line_number']} -> {imported}"
                             f"    ({detail['line_contents'].strip()})")
    return lines


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("packages", nargs="*", default=list(LAYERS),
                        help=f"importable top-level packages (default: {' '.join(LAYERS)})")
    args = parser.parse_args(argv)
    graph = grimp.build_graph(*args.packages, cache_dir=None)
    cycles = find_cycles(graph)
    if not cycles:
        print(f"no import cycles among {len(graph.modules)} modules of {', '.join(args.packages)}")
        return 0
    print(f"{len(cycles)} import cycle(s) (strongly connected components of the import graph):")
    for number, component in enumerate(cycles, 1):
        print(f"  [{number}] {', '.join(component)}")
        print("\n".join(describe(graph, component)))
    print("Break each one: move what both sides need into a lower module, or pass it in "
          "(a Protocol); a function-level import does not count as a fix.")
    return 1


if __name__ == "__main__":
    sys.exit(main())
