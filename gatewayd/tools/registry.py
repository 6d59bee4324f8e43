"""What a host tool is: a name, a typed argument Struct, the paths it touches, a runner.

Dispatch validates the arguments into ``args_type`` (msgspec), asks ``paths(args)``
which paths the call will touch so the pure policy can decide before anything runs,
and only then awaits ``run(args, ctx, resolved)``. Runners raise the exceptions in
:mod:`gatewayd.errors`; anything else is reported as ``internal``.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Generic, TypeVar

import msgspec

from gatewayd.config import ModelAlias
from gatewayd.policy.paths import PathAccess, PathGrant, ResolvedPath

if TYPE_CHECKING:
    from gatewayd.policy.model import NetworkSection
    from gatewayd.runs import ModelBudget
    from gatewayd.sandbox.session import RunSandbox

A = TypeVar("A", bound=msgspec.Struct)


@dataclass(frozen=True, slots=True, kw_only=True)
class ToolContext:
    """What a runner may know about the run it serves."""

    run_id: str
    grants: tuple[PathGrant, ...]
    max_output_bytes: int
    # model.chat: gatewayd's aliases, the ones this run's policy grants, its budget.
    models: Mapping[str, ModelAlias] = field(default_factory=dict)
    model_access: tuple[str, ...] = ()
    model_budget: ModelBudget | None = None
    # http.fetch: the run's policy network section (None: no network at all), and how
    # names resolve (None: the host's resolver; tests map names to loopback).
    network: NetworkSection | None = None
    resolve: Callable[[str, int], Awaitable[tuple[Any, ...]]] | None = None
    # sandbox.exec: the run's OS sandbox (None: a degraded run, where nothing may run).
    sandbox: RunSandbox | None = None
    degraded: str | None = None


def no_paths(_args: Any) -> tuple[PathAccess, ...]:
    """For tools that touch no file."""
    return ()


@dataclass(frozen=True, slots=True, kw_only=True)
class ToolSpec(Generic[A]):
    """One host tool."""

    name: str
    summary: str
    args_type: type[A]
    run: Callable[[A, ToolContext, tuple[ResolvedPath, ...]], Awaitable[Any]]
    paths: Callable[[A], tuple[PathAccess, ...]] = no_paths
    # Can a call change or reveal anything outside gatewayd before its answer is sent
    # (write a file, send a request, spend a model's budget, start a process)? Then its
    # ``call`` entry is made durable before it runs (write-ahead). False only for reads
    # of local state: nothing of such a call leaves gatewayd but its answer, which waits
    # for both entries anyway, so one flush covers them. Fail safe: True unless declared.
    side_effects: bool = True

    def args_schema(self) -> dict[str, Any]:
        """The argument schema as JSON Schema (what ``tools.list`` shows)."""
        schema: dict[str, Any] = msgspec.json.schema(self.args_type)
        return schema
