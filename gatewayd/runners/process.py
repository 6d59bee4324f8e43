"""Process tools: a tool folder's program, run for each call in a fresh sandbox of the
calling run.

A call runs the tool's argv (:attr:`FolderTool.entry`) with the run's launcher, uid and
limits, like ``sandbox.exec``, but in a narrowed view of the run's sandbox
(:class:`~gatewayd.sandbox.session.CallView`):

* **files**: only what the call is granted (:func:`~gatewayd.runners.rights.granted_files`:
  the tool's declared paths that the run's policy allows), each at its visible path,
  read-only unless granted writable; the rest of the workspace is an empty read-only
  directory, and none of the run's other policy paths is there. Each path is opened here
  beneath its grant's pinned root with no symlink followed (and never into the apps
  folder), and bwrap binds that very descriptor: a symlink planted or swapped in the
  workspace cannot redirect it. A directory that a mount cannot hand over whole under the
  grant's rules (:func:`~gatewayd.runners.rights.whole_directory_refusal`) is refused;
* **the tool's own folder**, read-only at :data:`~gatewayd.runners.spec.TOOL_MOUNT`;
* **no gateway socket** (the tool makes no gateway calls) and a **network namespace of
  its own** with loopback only: nothing of the host's network, nor of the run's loopback
  (the run's egress bridge, its model endpoint). A call granted network domains (those
  its manifest declares that the run's ``network.allow_domains`` allows:
  :func:`~gatewayd.runners.rights.granted_domains`) gets, for that call only, an egress
  proxy of its own (:class:`CallEgress`, given by the daemon's wiring): the run's
  ``network`` section with its domains narrowed to the granted ones, served on a fresh
  socket of the run's directory bound where the run's is (``/run/cogni/egress.sock``),
  and ``cogni-tool serve``'s bridge started in the call's namespace before the tool
  (127.0.0.1:3128, ``HTTP_PROXY``/``HTTPS_PROXY`` pointing there, as in a run). The
  run's own proxy cannot be used: it holds the *run's* domains, and nothing on a
  connection tells a tool's from the run's. The call's proxy stops when the call ends.
  A call granted no domain starts no proxy. A run whose policy keeps its own proxy off
  (``network.proxy.enabled`` false: no program of its sandbox connects out) gives its
  process tools none either; and without a :class:`CallEgress` (a runner made without
  one) there is none to give: then a call whose manifest *requires* a domain is refused
  (``policy_denied``) and optional domains are dropped;
* **the environment**: only :func:`~gatewayd.runners.rights.granted_env` (plus the
  sandbox's fixed PATH and HOME);
* it starts in /workspace when a file is granted, else in the tool's folder.

The protocol is the wasm runner's: ``{"arguments": {...}}`` on stdin, one JSON value on
stdout (the call's value). Errors: a non-zero exit is ``tool_failed`` with the end of its
stderr (cut, control characters escaped); stdout that is not one JSON value, or more of
it than the call's output limit (the call is stopped at once), is ``tool_failed`` saying
so; killed at its memory limit is ``limit_exceeded`` naming memory; past its time,
``timeout``; a run without an OS sandbox, ``policy_denied`` (the policy step refuses it
first: the tool's request says ``exec``).
"""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import os
import signal
import stat
import unicodedata
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Final

import msgspec
import structlog
import trio

from gatewayd.config import DEFAULT_TOOL_MEMORY_MB
from gatewayd.errors import LimitExceeded, PolicyViolation, ToolFailed, ToolTimedOut
from gatewayd.hostpaths.beneath import (
    NEW_DIR_MODE,
    BeneathRoot,
    hard_link_refusal,
    hard_linked,
    translate_oserror,
)
from gatewayd.policy.capabilities import no_sandbox_refusal
from gatewayd.policy.model import NetworkSection
from gatewayd.policy.network import domain_matches
from gatewayd.policy.paths import WORKSPACE_VISIBLE_ROOT
from gatewayd.runners.manifest import MIB
from gatewayd.runners.rights import (
    GrantedFile,
    granted_domains,
    granted_env,
    granted_files,
    whole_directory_refusal,
)
from gatewayd.runners.spec import TOOL_MOUNT, FolderTool
from gatewayd.sandbox.launch import ExecResult, LaunchError
from gatewayd.sandbox.limits import MIN_MEMORY_BYTES, ErrorKind, SandboxLimits
from gatewayd.sandbox.plan import EGRESS_BRIDGE, PlanError
from gatewayd.sandbox.session import CallBind, CallView, RunSandbox
from gatewayd.strictjson import JsonInputError, loads
from gatewayd.tools.registry import CallEgress, ToolContext

log = structlog.get_logger("gatewayd.runners.process")

# A tool's memory when neither its manifest nor the daemon's configuration says
# (GatewaydConfig.tool_memory_mb's default): room for a Python interpreter and its work.
DEFAULT_TOOL_MEMORY_BYTES: Final = DEFAULT_TOOL_MEMORY_MB * MIB
# The end of a failed tool's stderr is what says why it failed; this much is kept of it
# as it streams (the launcher keeps the start), and at most STDERR_MESSAGE_CHARS of it,
# escaped, goes into the error message an agent reads.
STDERR_TAIL_BYTES: Final = 4096
STDERR_MESSAGE_CHARS: Final = 800
# O_PATH: a descriptor that names a file for bwrap to bind without opening its contents
# (no read of a FIFO, no device open); the kernel follows no symlink through it.
_PATH_FLAGS: Final = os.O_PATH | os.O_CLOEXEC
_FOLDER_FLAGS: Final = os.O_PATH | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
_NO_FOLLOW_REASON: Final = (
    "a process tool's paths are bound where the policy checked them, so no symlink is "
    "followed on the way"
)


class ProcessToolRunner:
    """Runs a process tool's calls (one runner per tool; calls may run concurrently).

    ``default_memory_bytes``: the memory limit of a tool whose manifest names none (the
    daemon's ``tool_memory_mb``). The limit a call gets is the tool's, never more than the
    run's own per-command memory limit, and never under what bwrap needs to start
    (:data:`~gatewayd.sandbox.limits.MIN_MEMORY_BYTES`).
    """

    def __init__(
        self,
        tool: FolderTool,
        *,
        default_memory_bytes: int = DEFAULT_TOOL_MEMORY_BYTES,
        egress: CallEgress | None = None,
    ) -> None:
        self.tool = tool
        self.memory_bytes = tool.manifest.limits.memory_bytes or default_memory_bytes
        self.egress = egress

    async def run(self, args: Mapping[str, Any], ctx: ToolContext) -> Any:
        """The call's value: the JSON value the program wrote to stdout.

        Error handling: see the module docstring; every refusal and failure is a
        :mod:`gatewayd.errors` exception with a message an agent can act on.
        """
        name = self.tool.name
        sandbox = ctx.sandbox
        if sandbox is None:
            # The policy step refused this already (exec in the tool's request); the
            # check stays where the sandbox is used.
            raise PolicyViolation(no_sandbox_refusal(name, ctx.degraded or "no OS sandbox"))
        network = self.call_network(ctx)
        files = granted_files(self.tool, ctx)
        for granted in files:
            refusal = whole_directory_refusal(granted.resolved, ctx.grants)
            if refusal is not None:
                raise PolicyViolation(f"{name}: {refusal}")
        env = granted_env(self.tool, ctx, os.environ)
        stdin = msgspec.json.encode({"arguments": args})
        with contextlib.ExitStack() as fds:
            binds = [*self._file_binds(files, fds), self._folder_bind(fds)]
            cwd = str(WORKSPACE_VISIBLE_ROOT) if files else TOOL_MOUNT
            view = CallView(binds=tuple(binds), env_names=tuple(env), cwd=cwd)
            if network is None or self.egress is None:
                return await self._call(sandbox, view, self.tool.entry, env, stdin, ctx)
            socket = sandbox.call_egress_socket()
            view = dataclasses.replace(view, egress_socket=socket)
            try:
                proxy = self.egress(ctx=ctx, tool=name, network=network, socket=socket)
                async with proxy:
                    return await self._call(
                        sandbox, view, (*EGRESS_BRIDGE, *self.tool.entry), env, stdin, ctx
                    )
            except OSError as exc:
                log.warning("process_tool_egress_failed", tool=name, error=str(exc))
                raise ToolFailed(
                    f"{name}'s network proxy could not be started; the operator's log says why"
                ) from None

    def call_network(self, ctx: ToolContext) -> NetworkSection | None:
        """The network section of the call's own proxy: the run's, its domains narrowed
        to those the tool declares and the run allows; None when that is none.

        Error handling: PolicyViolation for a required domain when this runner has no
        :class:`CallEgress` to enforce it with (the call would run without it)."""
        if self.egress is None:
            needed = [need.name for need in self.tool.network if not need.optional]
            if needed:
                raise PolicyViolation(
                    f"{self.tool.name} is a process tool that needs network access "
                    f"({', '.join(needed)}), and this gatewayd gives process tools none: it "
                    "has no per-call egress proxy to hold the tool to the domains it "
                    "declares. Ask the operator for a wasm or built-in tool (http.fetch)"
                )
            return None
        net = ctx.network
        if net is None:
            return None
        # granted_domains holds each within the run's allowlist; checked again here, as
        # this list is all the call's proxy will enforce.
        domains = _within(granted_domains(self.tool, ctx), net.reachable_domains)
        if not domains:
            return None
        if not net.proxy.enabled:
            # The run's policy lets no program of its sandbox connect out (its proxy is
            # off; http.fetch alone reaches its domains): a process tool is such a program.
            needed = [need.name for need in self.tool.network if not need.optional]
            if needed:
                raise PolicyViolation(
                    f"{self.tool.name} is a process tool that needs network access "
                    f"({', '.join(needed)}), and this run's policy lets no program in its "
                    "sandbox connect out (network.proxy.enabled is false)"
                )
            return None
        # Its package managers' domains are in ``domains`` where granted: the copy
        # names none, or they would join its allowlist again.
        return net.model_copy(update={"allow_domains": domains, "package_managers": ()})

    # --- the view ---------------------------------------------------------------------

    def _file_binds(
        self, files: tuple[GrantedFile, ...], fds: contextlib.ExitStack
    ) -> list[CallBind]:
        """Each granted path opened beneath its grant's root (no symlink followed, the
        apps folder refused); a read-write one that is missing is made as a directory
        (owned like its parent), an optional one that is missing is left out."""
        optional = {need.path for need in self.tool.files if need.optional}
        binds: dict[str, CallBind] = {}
        for granted in files:
            fd = _open_granted(granted, missing_ok=granted.visible in optional)
            if fd is None:
                continue
            fds.callback(os.close, fd)
            if granted.visible in binds and not granted.writable:
                continue  # shown once; writable wins (rights grant it, or not, per need)
            binds[granted.visible] = CallBind(
                fd=fd, host=_real_path(fd), visible=granted.visible, writable=granted.writable
            )
        return list(binds.values())

    def _folder_bind(self, fds: contextlib.ExitStack) -> CallBind:
        try:
            fd = os.open(self.tool.folder, _FOLDER_FLAGS)
        except OSError as exc:
            log.warning("tool_folder_unavailable", tool=self.tool.name, error=str(exc))
            raise ToolFailed(
                f"{self.tool.name}'s folder is unavailable on the host "
                f"({errno.errorcode.get(exc.errno or 0, 'error')}); tell the operator"
            ) from None
        fds.callback(os.close, fd)
        return CallBind(fd=fd, host=_real_path(fd), visible=TOOL_MOUNT, writable=False)

    # --- the call ---------------------------------------------------------------------

    async def _call(
        self,
        sandbox: RunSandbox,
        view: CallView,
        command: Sequence[str],
        env: Mapping[str, str],
        stdin: bytes,
        ctx: ToolContext,
    ) -> Any:
        # The run's command limits, with the tool's own memory and the call's output
        # limit where they are smaller (a tool never gets more than its run).
        base = sandbox.limits.for_command(ctx.timeout_s)
        limits = dataclasses.replace(
            base,
            memory_bytes=max(MIN_MEMORY_BYTES, min(self.memory_bytes, base.memory_bytes)),
            max_output_bytes=min(ctx.max_output_bytes, base.max_output_bytes),
        )
        output = _Output(limits.max_output_bytes)
        result: ExecResult | None = None
        with trio.CancelScope() as flood:
            output.on_flood = flood.cancel
            try:
                result = await sandbox.exec_in_view(
                    command,
                    view,
                    limits=limits,
                    env_values=env,
                    stdin=stdin,
                    echo=(output.stdout, output.stderr),
                )
            except (PlanError, LaunchError) as exc:
                # The message may name host paths: the operator's log gets it whole.
                log.warning("process_tool_not_started", tool=self.tool.name, error=str(exc))
                raise ToolFailed(
                    f"{self.tool.name}'s sandbox could not be started; the operator's log says why"
                ) from None
        if output.flooded or (result is not None and result.stdoutTruncated):
            raise ToolFailed(
                f"{self.tool.name} wrote more than {limits.max_output_bytes} bytes to stdout, "
                "this call's output limit, and was stopped; a tool answers with one JSON "
                "value that fits"
            )
        if result is None:  # only the flood scope cancels without a result
            raise ToolFailed(f"{self.tool.name} was stopped")
        return self._value(result, limits, output)

    def _value(self, result: ExecResult, limits: SandboxLimits, output: _Output) -> Any:
        name = self.tool.name
        if result.errorCode is ErrorKind.TIMEOUT:
            raise ToolTimedOut(f"{name} ran past {limits.timeout_s:g} s and was stopped")
        if result.errorCode is ErrorKind.OOM_KILLED:
            raise LimitExceeded(
                f"{name} ran out of memory: it was killed at its memory limit of "
                f"{limits.memory_bytes // MIB} MiB (its manifest's limits.memory, or "
                "gatewayd's tool_memory_mb, within the run's own memory limit)"
            )
        if result.errorCode is ErrorKind.LIMIT_EXCEEDED:
            which = (
                "CPU time (the run's sandbox.cpu_s)"
                if result.signal == signal.SIGXCPU
                else "file size (the run's sandbox.max_file_mb)"
            )
            raise LimitExceeded(f"{name} ran past its {which} limit and was stopped")
        if result.exitCode != 0:
            how = (
                f"exited with status {result.exitCode}"
                if result.exitCode is not None
                else f"was killed by signal {_signal_name(result.signal)}"
            )
            tail = output.tail()
            said = f"; its stderr ends: {tail}" if tail else "; it wrote nothing to stderr"
            raise ToolFailed(f"{name} {how}{said}")
        if not result.stdout.strip():
            raise ToolFailed(
                f"{name} wrote nothing to stdout; a process tool answers with one JSON value"
            )
        try:
            return loads(result.stdout)
        except JsonInputError as exc:
            raise ToolFailed(
                f"{name} wrote something other than one JSON value to stdout ({exc}); a "
                "process tool answers with one JSON value"
            ) from None
        except UnicodeDecodeError:
            raise ToolFailed(
                f"{name} wrote bytes that are not UTF-8 to stdout; a process tool answers "
                "with one JSON value"
            ) from None


class _Output:
    """Watches the tool's output as it streams: stops the call once stdout passes the
    output limit (a flood never runs to its timeout), and keeps the end of stderr."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.stdout_bytes = 0
        self.flooded = False
        self.on_flood: Callable[[], None] | None = None
        self._stderr = bytearray()

    def stdout(self, chunk: bytes) -> None:
        self.stdout_bytes += len(chunk)
        if self.stdout_bytes > self.limit and not self.flooded:
            self.flooded = True
            if self.on_flood is not None:
                self.on_flood()

    def stderr(self, chunk: bytes) -> None:
        self._stderr += chunk
        del self._stderr[:-STDERR_TAIL_BYTES]

    def tail(self) -> str:
        """The end of stderr as one line: at most STDERR_MESSAGE_CHARS, control and
        format characters (newlines, escapes, bidi overrides) shown escaped."""
        text = escape_controls(self._stderr.decode("utf-8", "replace").strip())
        if len(text) > STDERR_MESSAGE_CHARS:
            text = "…" + text[-STDERR_MESSAGE_CHARS:]
        return text


def escape_controls(text: str) -> str:
    """``text`` with every control or format character (Unicode Cc, Cf: newlines, the
    terminal's escape, bidi overrides) written as a Python escape, so what a tool wrote
    cannot break a message into lines, drive a terminal or reorder what a reader sees."""
    return "".join(
        ch if unicodedata.category(ch) not in ("Cc", "Cf") else ascii(ch)[1:-1] for ch in text
    )


def _within(domains: Sequence[str], allowed: Sequence[str]) -> tuple[str, ...]:
    """Those of ``domains`` that ``allowed`` covers whole: a host any entry matches, or a
    wildcard (``*.x``) an entry lists as is or lies beneath (``*.a.x`` under ``*.x``)."""
    kept: list[str] = []
    for domain in domains:
        covered = any(domain == entry or domain_matches(entry, domain) for entry in allowed)
        if covered and domain not in kept:
            kept.append(domain)
    return tuple(kept)


def _signal_name(number: int | None) -> str:
    try:
        return signal.Signals(number or 0).name
    except ValueError:
        return str(number)


def _real_path(fd: int) -> str:
    """The host path the kernel has for an opened file: real (no symlink, no ``..``), as
    the plan's checks compare paths."""
    return os.readlink(f"/proc/self/fd/{fd}")


def _open_granted(granted: GrantedFile, *, missing_ok: bool) -> int | None:
    """An ``O_PATH`` descriptor of a granted directory or regular file, beneath its
    grant's pinned root with no symlink followed; None for a missing optional path.

    Error handling: PolicyViolation for a symlink on the way, the apps folder, a hard
    link, or anything but a directory or a regular file; ToolFailed for a missing path.
    """
    beneath = BeneathRoot(
        granted.resolved, follow_symlinks=False, no_follow_reason=_NO_FOLLOW_REASON
    )
    with beneath:
        try:
            if not granted.resolved.parts:
                fd = beneath.open_dir()
            elif granted.writable:
                # A writable path the tool declares may not exist yet: it is made as a
                # directory, as fs.write makes the directories of a file it writes.
                fd = _open_or_make(beneath)
            else:
                parent, last = beneath.open_parent()
                try:
                    fd = beneath.open_name(parent, last, _PATH_FLAGS)
                finally:
                    os.close(parent)
        except ToolFailed:
            if missing_ok:
                return None
            raise
    st = os.fstat(fd)
    if stat.S_ISDIR(st.st_mode) or (stat.S_ISREG(st.st_mode) and not hard_linked(st)):
        return fd
    os.close(fd)
    if stat.S_ISREG(st.st_mode):
        raise hard_link_refusal(granted.visible, "copy the file to get one")
    raise PolicyViolation(
        f"'{granted.visible}' is neither a directory nor a regular file; a process tool is "
        "given only those"
    )


def _open_or_make(beneath: BeneathRoot) -> int:
    """The writable target, made as a directory (owned like its parent: in a lent
    workspace, the run's uid) when it is missing; its parents are made the same way."""
    parent, last = beneath.open_parent(create=True)
    try:
        with contextlib.suppress(ToolFailed):
            return beneath.open_name(parent, last, _PATH_FLAGS)
        try:
            os.mkdir(last, NEW_DIR_MODE, dir_fd=parent)
            owner = os.fstat(parent)
            os.chown(last, owner.st_uid, owner.st_gid, dir_fd=parent, follow_symlinks=False)
        except FileExistsError:
            pass  # made meanwhile: opened below like any other
        except OSError as exc:
            raise translate_oserror(exc, beneath.target.visible) from None
        return beneath.open_name(parent, last, _PATH_FLAGS | os.O_DIRECTORY)
    finally:
        os.close(parent)
