"""A custom import-linter contract: no import cycle among the modules of a package.

import-linter's own contracts check layers and forbidden imports; a cycle inside one layer (two modules of
``commands`` importing each other, say) passes them. This one finds every strongly connected component of the
module import graph (function-level imports included: grimp reads them all) and reports each cycle it finds.

    [[tool.importlinter.contracts]]
    name = "No import cycles"
    type = "acyclic"
    root = "dha_train"
"""

from __future__ import annotations

from importlinter.application import output
from importlinter.domain import fields
from importlinter.domain.contract import Contract, ContractCheck


def _cycles(graph, modules: set[str]) -> list[list[str]]:
    """Strongly connected components of more than one module (or a module importing itself), by Tarjan."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(start: str) -> None:
        # Iterative depth-first search, so deep graphs cannot hit the recursion limit.
        work = [(start, iter(sorted(graph.find_modules_directly_imported_by(start) & modules)))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph.find_modules_directly_imported_by(child) & modules))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
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
                if len(component) > 1 or node in graph.find_modules_directly_imported_by(node):
                    found.append(sorted(component))

    for module in sorted(modules):
        if module not in index:
            visit(module)
    return found


class AcyclicContract(Contract):
    root = fields.StringField()

    def check(self, graph, verbose: bool) -> ContractCheck:
        modules = {self.root} | graph.find_descendants(self.root)
        cycles = _cycles(graph, modules)
        chains = []
        for component in cycles:
            first = component[0]
            back = [m for m in component[1:] if graph.find_shortest_chain(importer=m, imported=first)]
            start = next((m for m in sorted(graph.find_modules_directly_imported_by(first) & set(component))), first)
            there = graph.find_shortest_chain(importer=first, imported=start) or (first,)
            home = graph.find_shortest_chain(importer=start, imported=first) or (start,)
            chains.append({'modules': component, 'example': list(there) + list(home[1:]), 'back': back})
        return ContractCheck(kept=not cycles, metadata={'cycles': chains})

    def render_broken_contract(self, check: ContractCheck) -> None:
        for cycle in check.metadata['cycles']:
            output.print_error(f"{len(cycle['modules'])} modules import each other: {', '.join(cycle['modules'])}")
            output.print(f"  for example: {' -> '.join(cycle['example'])}")
            output.new_line()
