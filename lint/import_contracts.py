"""An import-linter contract type that import-linter lacks: no import cycle between modules.

import-linter's own ``acyclic_siblings`` judges packages as wholes (a package that both
holds the run model, which dispatch reads, and the run lifecycle, which serves dispatch,
would count as one cycle with dispatch), and its ``layers`` contract only sees the modules
it lists. This contract sees every module of the root packages: any strongly connected
component of the module import graph with more than one module is a cycle, and each is
reported with one of its loops, file and line, so it can be broken where it is.

Imports inside functions and under ``TYPE_CHECKING`` count as imports, as import-linter
counts them: a cycle hidden in a function is still a cycle in the design.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator

from grimp import ImportGraph
from importlinter.application import output
from importlinter.domain import fields
from importlinter.domain.contract import Contract, ContractCheck


class AcyclicModulesContract(Contract):
    """``type = acyclic_modules``; ``packages``: the packages whose modules are checked."""

    type_name = "acyclic_modules"

    packages = fields.ListField(subfield=fields.StringField())

    def check(self, graph: ImportGraph, verbose: bool) -> ContractCheck:
        roots: list[str] = list(self.packages)  # type: ignore[call-overload]
        modules = sorted(m for m in graph.modules if _under(m, roots))
        edges = {
            m: sorted(i for i in graph.find_modules_directly_imported_by(m) if _under(i, roots))
            for m in modules
        }
        cycles = [_one_loop(component, edges) for component in _components(modules, edges)]
        details = [
            [_import_line(graph, a, b) for a, b in itertools.pairwise(loop)] for loop in cycles
        ]
        return ContractCheck(kept=not cycles, metadata={"cycles": details})

    def render_broken_contract(self, check: ContractCheck) -> None:
        for loop in check.metadata["cycles"]:
            output.print_error("An import cycle:")
            output.new_line()
            for line in loop:
                output.indent_cursor()
                output.print(line)
            output.new_line()


def _under(module: str, roots: list[str]) -> bool:
    return any(module == root or module.startswith(root + ".") for root in roots)


def _components(modules: list[str], edges: dict[str, list[str]]) -> Iterator[set[str]]:
    """Tarjan's strongly connected components, iteratively; yields those of 2 or more."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    for start in modules:
        if start in index:
            continue
        work: list[tuple[str, Iterator[str]]] = []
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        work.append((start, iter(edges[start])))
        while work:
            node, successors = work[-1]
            for succ in successors:
                if succ not in index:
                    index[succ] = low[succ] = len(index)
                    stack.append(succ)
                    on_stack.add(succ)
                    work.append((succ, iter(edges[succ])))
                    break
                if succ in on_stack:
                    low[node] = min(low[node], index[succ])
            else:
                work.pop()
                if work:
                    parent = work[-1][0]
                    low[parent] = min(low[parent], low[node])
                if low[node] == index[node]:
                    component = set()
                    while True:
                        member = stack.pop()
                        on_stack.discard(member)
                        component.add(member)
                        if member == node:
                            break
                    if len(component) > 1:
                        yield component


def _one_loop(component: set[str], edges: dict[str, list[str]]) -> list[str]:
    """A shortest loop through the component's first module (breadth first, inside it)."""
    start = min(component)
    previous: dict[str, str] = {}
    frontier = [start]
    while frontier:
        following = []
        for node in frontier:
            for succ in edges[node]:
                if succ == start:
                    loop = [node]
                    while loop[-1] != start:
                        loop.append(previous[loop[-1]])
                    return [start, *reversed(loop[:-1]), start]
                if succ in component and succ not in previous:
                    previous[succ] = node
                    following.append(succ)
        frontier = following
    return [start, start]


def _import_line(graph: ImportGraph, importer: str, imported: str) -> str:
    details = graph.get_import_details(importer=importer, imported=imported)
    where = ", ".join(f"l.{d['line_number']}" for d in details) or "?"
    return f"{importer} -> {imported} ({where})"
