"""What a tool is to dispatch, whatever runs it, and the registry of them.

A :class:`Tool` is its manifest (:mod:`gatewayd.tools.manifest`), a decoder from the
call's JSON arguments to validated ones, a function from those to the capabilities the
call requests (:mod:`gatewayd.policy.capabilities`), and a runner. Dispatch decodes the
arguments, has the policy step check the requested capabilities against the run's
rights, and only then awaits ``runner.run(args, ctx)``. Runners raise the exceptions in
:mod:`gatewayd.errors`; anything else is reported as ``internal``.

Each runner kind (built-in functions today; apps, MCP servers, wasm and process tools
next) makes Tools and registers them in the daemon's :class:`ToolRegistry`; dispatch
looks tools up by name and never asks what kind one is.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Iterable, Iterator, Mapping
from contextlib import AbstractAsyncContextManager
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Final, Generic, Protocol, TypeVar, overload

import msgspec

from gatewayd.config import ModelAlias
from gatewayd.policy.capabilities import CapabilityRequest
from gatewayd.policy.paths import PathGrant, ResolvedPath
from gatewayd.tools.manifest import ToolManifest

if TYPE_CHECKING:
    from gatewayd.policy.model import NetworkSection
    from gatewayd.protocol import Response
    from gatewayd.runs import ModelBudget, Run
    from gatewayd.sandbox.session import RunSandbox

A = TypeVar("A")
T = TypeVar("T")
A_contra = TypeVar("A_contra", contravariant=True)

# The one tool every run has, answered by dispatch from this registry: it reveals only
# what the run may already do. No runner kind may register a tool by this name.
TOOLS_LIST: Final = "tools.list"


class ToolContext(msgspec.Struct, frozen=True, kw_only=True):
    """What a runner may know about the run and the call it serves.

    A msgspec Struct, not a frozen dataclass: one is made for every call, and a frozen
    dataclass of this many fields costs ten times as much to make (its ``__init__``
    sets each field through ``object.__setattr__``). Never encoded or decoded.
    """

    run_id: str
    grants: tuple[PathGrant, ...]
    max_output_bytes: int
    # The call's id, as its audit entries carry it (None: a call made by gatewayd itself).
    tool_call_id: str | None = None
    # The call's requested paths as the policy step resolved them onto the run's
    # grants, in the order the tool requested them.
    resolved: tuple[ResolvedPath, ...] = ()
    # model.chat: gatewayd's aliases, and the run's budget (the policy step checked the
    # alias and the budget; the runner charges what the call spends).
    models: Mapping[str, ModelAlias] = msgspec.field(default_factory=dict)
    model_budget: ModelBudget | None = None
    # http.fetch: the run's policy network section (None: no network at all), and how
    # names resolve (None: the host's resolver; tests map names to loopback).
    network: NetworkSection | None = None
    resolve: Callable[[str, int], Awaitable[tuple[Any, ...]]] | None = None
    # sandbox.exec: the run's OS sandbox (None: a degraded run, where nothing may run).
    sandbox: RunSandbox | None = None
    degraded: str | None = None
    # The call's time limit in seconds, as dispatch enforces it (the run's, or the
    # tool's own when shorter): a runner that cannot be cancelled mid-call (a wasm
    # module in a thread) stops itself by then.
    timeout_s: float | None = None
    # A call the runner makes for this one, through the whole chokepoint (policy,
    # review, audit, budget) as the same run: ``nested(tool, args, suffix)``, whose
    # toolCallId is this call's with ``.suffix`` added. None: the runner may make none.
    nested: NestedCall | None = None
    # The run's policy ``env.allow`` and ``model_access.models``: a folder tool's optional
    # environment names and model aliases are granted only where these hold them
    # (gatewayd.runners.rights).
    env: tuple[str, ...] = ()
    model_access: tuple[str, ...] = ()
    # sandbox.query and sandbox.usage: the live run they describe (read only), and the
    # names of the tools it may call (dispatch's to compute: the run's own tools count;
    # asked only by the tools that need it). None: a call made outside a run's dispatch.
    run: Run | None = None
    allowed_tools: Callable[[], tuple[str, ...]] | None = None
    # sandbox.exec with allowedDomains or packageManagers: how its command gets an
    # egress proxy of its own, narrowed to them (None: this gatewayd gives none).
    call_egress: CallEgress | None = None


class CallEgress(Protocol):
    """Serves one call's own egress proxy (the daemon's wiring gives one: the proxy sits
    above dispatch, so this layer cannot make it). While the context is open, a proxy
    enforcing ``network`` (the run's section, its domains narrowed to the call's)
    listens on the host socket ``socket`` for the processes of ``ctx``'s run sandbox
    outside the run's own network namespace, auditing every connection as the run's
    proxy does, its entries naming ``tool`` and the call; on exit it stops and the
    socket file is removed.

    Error handling: ``OSError`` when the socket cannot be made."""

    def __call__(
        self, *, ctx: ToolContext, tool: str, network: NetworkSection, socket: Path
    ) -> AbstractAsyncContextManager[None]: ...


class NestedCall(Protocol):
    """A call a runner makes on behalf of the call it serves (a wasm tool's model
    request), answered as any call is: a value or an error code and message."""

    async def __call__(self, tool: str, args: Mapping[str, Any], suffix: str) -> Response: ...


class ToolRunner(Protocol[A_contra]):
    """What runs a tool's calls: one per tool, made by its runner kind."""

    async def run(self, args: A_contra, ctx: ToolContext) -> Any:
        """The call's value (anything the wire's JSON encoder takes).

        Error handling: :mod:`gatewayd.errors` exceptions become their error code;
        anything else is ``internal``.
        """
        ...


@dataclass(frozen=True, slots=True, kw_only=True)
class Tool(Generic[A]):
    """One tool as dispatch sees it, whatever its runner kind.

    ``decode``: the call's JSON arguments to validated ones (raises
    :class:`~gatewayd.errors.ArgumentsRejected`, or another GatewayError for a refusal
    with its own code and message). ``requests``: the
    capabilities a call with those arguments asks for; it may raise a GatewayError.
    """

    manifest: ToolManifest
    decode: Callable[[Mapping[str, Any]], A]
    requests: Callable[[A], CapabilityRequest]
    runner: ToolRunner[A]
    # What the ``call`` entry of an allowed call records beside the tool's name, as its
    # ``detail`` (an MCP tool: its server, its name there, the pin's digest); None:
    # nothing (the built-in tools).
    audit_detail: Mapping[str, Any] | None = None
    # The same call as ``runner.run``, answered at once: a plain function that does no
    # I/O and never blocks (reads the clock, formats a value). Dispatch may call it on
    # the connection's own task instead of giving the call a task of its own; None:
    # every call is awaited through ``runner``.
    immediate: Callable[[A, ToolContext], Any] | None = None

    @property
    def name(self) -> str:
        return self.manifest.name


class DuplicateToolError(ValueError):
    """A second tool with a name already registered (or the reserved ``tools.list``)."""


class ToolRegistry(Mapping[str, Tool[Any]]):
    """The tools gatewayd can run, by name; runner kinds register theirs.

    A name is registered once: a second tool of the same name is refused, whatever its
    kind, so no runner kind can shadow another's tool (or ``tools.list``).
    """

    def __init__(self, tools: Iterable[Tool[Any]] = ()) -> None:
        self._tools: dict[str, Tool[Any]] = {}
        for tool in tools:
            self.register(tool)

    def register(self, tool: Tool[Any]) -> None:
        """Add ``tool``. Error handling: DuplicateToolError for a name already taken."""
        name = tool.manifest.name
        if name == TOOLS_LIST:
            raise DuplicateToolError(f"{TOOLS_LIST} is dispatch's own; no tool may take its name")
        if name in self._tools:
            existing = self._tools[name].manifest.runner
            raise DuplicateToolError(
                f"a tool named {name!r} is already registered (runner {existing}); a second "
                f"one (runner {tool.manifest.runner}) cannot take its name"
            )
        self._tools[name] = tool

    @overload
    def get(self, name: str, /) -> Tool[Any] | None: ...

    @overload
    def get(self, name: str, /, default: Tool[Any] | T) -> Tool[Any] | T: ...

    def get(self, name: str, /, default: Any = None) -> Any:
        """The tool called ``name``, or ``default`` (a plain dict lookup: on every call)."""
        return self._tools.get(name, default)

    def __getitem__(self, name: str) -> Tool[Any]:
        return self._tools[name]

    def __contains__(self, name: object) -> bool:
        return name in self._tools

    def __iter__(self) -> Iterator[str]:
        return iter(self._tools)

    def __len__(self) -> int:
        return len(self._tools)

    def manifests(self) -> tuple[ToolManifest, ...]:
        """Every registered tool's manifest, in registration order."""
        return tuple(tool.manifest for tool in self._tools.values())
