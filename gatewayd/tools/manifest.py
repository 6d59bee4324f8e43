"""A tool's manifest: what every runner kind says about a tool, as pure data.

Built-in tools get theirs from their argument Struct (:mod:`gatewayd.tools.builtin`);
apps, MCP servers, wasm and process tools will read theirs from their own files. Whatever
the kind, dispatch reads only this: the name it is called by, the argument schema
``tools.list`` shows, the capabilities the policy step holds each call to
(:mod:`gatewayd.policy.capabilities`), whether a call has side effects (when its audit
entry is made durable), and its limits. ``tools.list`` shows each manifest as it is here,
keys in camelCase like the rest of the wire.
"""

from __future__ import annotations

import enum
from typing import Any, Final

import msgspec

from gatewayd.policy.capabilities import NO_CAPABILITIES, Capabilities
from gatewayd.protocol import MAX_ID_CHARS, TOOL_NAME_RE

# A version is a label for people and pins, not a document.
MAX_VERSION_CHARS: Final = 64
# A summary is one or two sentences: tools.list shows every allowed tool's, in one frame.
MAX_SUMMARY_CHARS: Final = 1000


class RunnerKind(enum.StrEnum):
    """What runs a tool's calls. Dispatch never branches on it; it is shown and audited."""

    BUILTIN = "builtin"  # a function of gatewayd's, on the host
    APP = "app"  # an LLM-sandboxed app, prompted by its caller
    MCP = "mcp"  # a tool of an MCP server, run in a sandbox of its own
    WASM = "wasm"  # a WebAssembly module under wasmtime, with fuel and memory limits
    PROCESS = "process"  # a program run in a fresh sandbox per call


class ToolLimits(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """A tool's own limits; None: only the run's apply.

    ``timeout_s`` is enforced by dispatch for every kind (the shorter of it and the run's
    ``limits.call_timeout_s``); ``memory_bytes`` and ``fuel`` by the tool's runner, which
    has its manifest (fuel is a wasm instruction budget, so only wasm tools have one).
    """

    timeout_s: float | None = msgspec.field(default=None, name="timeoutSeconds")
    memory_bytes: int | None = msgspec.field(default=None, name="memoryBytes")
    fuel: int | None = None

    def __post_init__(self) -> None:
        for name, value in (
            ("timeout", self.timeout_s),
            ("memory", self.memory_bytes),
            ("fuel", self.fuel),
        ):
            if value is not None and not value > 0:
                raise ValueError(f"a tool's {name} limit must be more than 0, not {value}")


NO_LIMITS: Final = ToolLimits()


class ToolManifest(
    msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True, rename="camel"
):
    """What a tool is, for dispatch, the policy and ``tools.list``.

    ``side_effects``: can a call change or reveal anything outside gatewayd before its
    answer is sent (write a file, send a request, spend a model's budget, start a
    process)? Then its ``call`` entry is made durable before it runs (write-ahead). False
    only for reads of local state: nothing of such a call leaves gatewayd but its answer,
    which waits for both entries anyway, so one flush covers them. Fail safe: True unless
    declared.
    """

    name: str
    version: str
    summary: str
    args_schema: dict[str, Any]  # JSON Schema of the call's arguments
    runner: RunnerKind
    capabilities: Capabilities = NO_CAPABILITIES
    limits: ToolLimits = NO_LIMITS
    side_effects: bool = True

    def __post_init__(self) -> None:
        if len(self.name) > MAX_ID_CHARS or not TOOL_NAME_RE.fullmatch(self.name):
            raise ValueError(
                f"tool name {self.name!r} must be a dotted lowercase name such as 'fs.read' "
                f"(at most {MAX_ID_CHARS} characters): the name a request can carry"
            )
        if not 0 < len(self.version) <= MAX_VERSION_CHARS:
            raise ValueError(f"{self.name}: a version is 1-{MAX_VERSION_CHARS} characters")
        if not 0 < len(self.summary) <= MAX_SUMMARY_CHARS:
            raise ValueError(f"{self.name}: a summary is 1-{MAX_SUMMARY_CHARS} characters")
        if self.limits.fuel is not None and self.runner is not RunnerKind.WASM:
            raise ValueError(
                f"{self.name}: only a wasm tool has a fuel limit, and this one is {self.runner}"
            )
