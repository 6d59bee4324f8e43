"""The built-in runner kind: tools that are async functions of gatewayd's, on the host.

A built-in tool is an argument Struct (msgspec: its JSON Schema is the manifest's
argument schema, and decoding into it is the validation), the capabilities it declares,
a function from its validated arguments to what a call requests, and an async function
that runs the call. :func:`builtin_tool` makes a :class:`~gatewayd.tools.registry.Tool`
of these; the built-in tools' version is gatewayd's own.
"""

from __future__ import annotations

import functools
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass
from typing import Any, Final, Generic, TypeVar

import msgspec

import gatewayd
from gatewayd.errors import ArgumentsRejected
from gatewayd.policy.capabilities import (
    NO_CAPABILITIES,
    Capabilities,
    CapabilityRequest,
    no_request,
)
from gatewayd.tools.manifest import NO_LIMITS, RunnerKind, ToolLimits, ToolManifest
from gatewayd.tools.registry import TOOLS_LIST, Tool, ToolContext

A = TypeVar("A", bound=msgspec.Struct)

# Argument schemas kept, by argument type: the per-run tools (an app workspace's admin
# tools) are made again for every run, and msgspec builds a schema by walking the type's
# annotations (about 0.3 ms a tool). The built-in argument types are a few dozen
# module-level classes; the bound keeps a caller that made types on the fly from growing
# the cache without end.
ARGS_SCHEMA_CACHE_SIZE: Final = 128

BUILTIN_VERSION: Final = gatewayd.__version__

# tools.list: answered by dispatch itself, so it has a manifest and no Tool.
TOOLS_LIST_MANIFEST: Final = ToolManifest(
    name=TOOLS_LIST,
    version=BUILTIN_VERSION,
    summary="List the tools this run may call, with their argument schemas.",
    args_schema={"type": "object", "properties": {}, "additionalProperties": False},
    runner=RunnerKind.BUILTIN,
    side_effects=False,
)


@dataclass(frozen=True, slots=True)
class BuiltinRunner(Generic[A]):
    """Runs a call by awaiting one of gatewayd's functions."""

    function: Callable[[A, ToolContext], Awaitable[Any]]

    async def run(self, args: A, ctx: ToolContext) -> Any:
        return await self.function(args, ctx)


@dataclass(frozen=True, slots=True)
class StructDecoder(Generic[A]):
    """Validates a call's JSON arguments into the tool's argument Struct."""

    args_type: type[A]

    def __call__(self, raw: Mapping[str, Any]) -> A:
        """Error handling: ArgumentsRejected naming the field; a GatewayError raised by
        the Struct's ``__post_init__`` passes through with its own code."""
        try:
            return msgspec.convert(raw, self.args_type)
        except msgspec.ValidationError as exc:
            raise ArgumentsRejected(str(exc)) from None


@functools.lru_cache(maxsize=ARGS_SCHEMA_CACHE_SIZE)
def args_schema(args_type: type[msgspec.Struct]) -> dict[str, Any]:
    """The JSON Schema of ``args_type``, built once per type. The one dict is shared by
    every manifest of the type, as :data:`TOOLS_LIST_MANIFEST`'s is: no reader changes
    it (readers copy what they reshape)."""
    return msgspec.json.schema(args_type)


def builtin_tool(
    *,
    name: str,
    summary: str,
    args_type: type[A],
    run: Callable[[A, ToolContext], Awaitable[Any]],
    requests: Callable[[A], CapabilityRequest] = no_request,
    capabilities: Capabilities = NO_CAPABILITIES,
    side_effects: bool = True,
    limits: ToolLimits = NO_LIMITS,
    immediate: Callable[[A, ToolContext], Any] | None = None,
) -> Tool[A]:
    """A built-in tool: ``run`` awaited with the validated ``args_type`` and the call's
    context, after the policy step allowed what ``requests`` says the call uses (within
    ``capabilities``). ``side_effects``: see :class:`~gatewayd.tools.manifest.ToolManifest`.
    ``immediate``: the same as ``run`` for a tool that does no I/O, as a plain function
    (see :attr:`~gatewayd.tools.registry.Tool.immediate`)."""
    manifest = ToolManifest(
        name=name,
        version=BUILTIN_VERSION,
        summary=summary,
        args_schema=args_schema(args_type),
        runner=RunnerKind.BUILTIN,
        capabilities=capabilities,
        limits=limits,
        side_effects=side_effects,
    )
    return Tool(
        manifest=manifest,
        decode=StructDecoder(args_type),
        requests=requests,
        runner=BuiltinRunner(run),
        immediate=immediate,
    )
