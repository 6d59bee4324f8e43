"""The module-level cycle contract that ``make lint`` runs (lint/import_contracts.py).

Run by `make lint` in the lint tools' virtualenv, where grimp and import-linter are.
"""

from __future__ import annotations

import grimp
import pytest

from lint.import_contracts import AcyclicModulesContract


def _graph(*imports: tuple[str, str]) -> grimp.ImportGraph:
    graph = grimp.ImportGraph()
    for line, (importer, imported) in enumerate(imports, start=1):
        graph.add_module(importer)
        graph.add_module(imported)
        graph.add_import(
            importer=importer, imported=imported, line_number=line, line_contents="import x"
        )
    return graph


def _check(graph: grimp.ImportGraph, packages: list[str]) -> list[list[str]]:
    contract = AcyclicModulesContract(
        name="no cycle", session_options={}, contract_options={"packages": packages}
    )
    check = contract.check(graph, verbose=False)
    cycles: list[list[str]] = check.metadata["cycles"]
    assert check.kept is (not cycles)
    return cycles


def test_a_layered_graph_keeps_the_contract() -> None:
    graph = _graph(
        ("app.cli", "app.daemon"),
        ("app.daemon", "app.runs.lifecycle"),
        ("app.runs.lifecycle", "app.dispatch"),
        ("app.dispatch", "app.runs.model"),
        ("app.cli", "app.runs.model"),
    )
    # A package holding both ends of a chain is no cycle between modules.
    assert _check(graph, ["app"]) == []


@pytest.mark.parametrize(
    ("imports", "loop"),
    [
        (
            [("app.a", "app.b"), ("app.b", "app.a")],
            ["app.a -> app.b (l.1)", "app.b -> app.a (l.2)"],
        ),
        (
            # The shortest loop through the component is reported, not the long way round.
            [("app.a", "app.b"), ("app.b", "app.c"), ("app.c", "app.a"), ("app.b", "app.a")],
            ["app.a -> app.b (l.1)", "app.b -> app.a (l.4)"],
        ),
        (
            [("app.x", "app.y.z"), ("app.y.z", "app.w"), ("app.w", "app.x")],
            ["app.w -> app.x (l.3)", "app.x -> app.y.z (l.1)", "app.y.z -> app.w (l.2)"],
        ),
    ],
)
def test_a_cycle_is_reported_with_one_loop_file_and_line(
    imports: list[tuple[str, str]], loop: list[str]
) -> None:
    assert _check(_graph(*imports), ["app"]) == [loop]


def test_each_cycle_is_reported_once_and_modules_outside_the_packages_are_not_judged() -> None:
    graph = _graph(
        ("app.a", "app.b"),
        ("app.b", "app.a"),
        ("app.c", "app.d"),
        ("app.d", "app.c"),
        ("app.e", "vendor.x"),
        ("vendor.x", "app.e"),
    )
    cycles = _check(graph, ["app"])
    assert sorted(loop[0].split(" ")[0] for loop in cycles) == ["app.a", "app.c"]
