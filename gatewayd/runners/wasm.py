"""The wasm runner: a tool folder's WebAssembly module (a WASI preview 1 command) run
under wasmtime, inside gatewayd, one fresh instance per call.

Why in-process, in a thread: a warm call must cost at most 2 ms more than ``fs.read``
(docs/performance.md). Starting a process or a sandbox per call costs tens of
milliseconds; instantiating an already compiled module in a fresh wasmtime ``Store``
costs tens of microseconds. The call runs in a worker thread
(``trio.to_thread.run_sync``; wasmtime's ctypes calls release the GIL), so the trio loop
that serves every run goes on meanwhile; a :class:`trio.CapacityLimiter` of the engine
bounds how many modules run at once.

What isolates a module (threat model: the module is hostile; it is the tool author's
code, fed the agent's arguments):

- wasmtime's sandbox: the module sees its own linear memory and nothing of gatewayd's;
  it reaches the host only through its imports, which are WASI preview 1 (no sockets:
  there is no network at all) and the two ``cogni`` functions below;
- files: only the directories of :func:`~gatewayd.runners.rights.granted_files` are
  preopened, each at its visible path, read-only unless granted writable. Each is opened
  by gatewayd beneath its grant's root, following no symlink on the way and checking the
  root's pinned identity (:class:`~gatewayd.hostpaths.beneath.BeneathRoot`, as the fs
  tools open paths), and handed to wasmtime as ``/proc/self/fd/N``: a directory swapped
  for a symlink after the policy step cannot redirect it. Beneath it, wasmtime resolves
  every path with cap-std, which refuses ``..`` above the preopen, absolute paths and
  symlinks that lead out;
- environment: only :func:`~gatewayd.runners.rights.granted_env`; argv is the tool's name;
- limits: fuel (an instruction budget: the manifest's ``fuel`` or the engine's default),
  memory (``Store.set_limits``: the manifest's ``memory`` or the configured default;
  instantiation fails for a module that declares more, ``memory.grow`` answers -1 past
  it; one memory, :data:`MAX_TABLES` tables of :data:`MAX_TABLE_ELEMENTS`, no shared
  memory, no GC heap), wall time (the call's ``ctx.timeout_s``), stdout (the run's
  output cap) and stderr (:data:`MAX_STDERR_BYTES`).

Wall time, floods and stops use wasmtime's epoch interruption: a ticker thread advances
the engine's epoch every :data:`EPOCH_TICK_S` while calls run, and each store's deadline
is one tick ahead, so wasmtime calls our deadline callback once per tick of running wasm
code. The callback lets the module go on, or ends it with the reason: its time is up,
its stdout or stderr flooded (a write past the bound fails and the module stops at the
next tick, instead of spinning on failed writes until its deadline). The callback is the
one piece the ``wasmtime`` package does not wrap in its public API; it is set through
the package's generated C bindings (``wasmtime_store_epoch_deadline_callback``, a
public function of wasmtime's C API), which is why pyproject.toml pins one major.

A cancelled call (the run ends, dispatch's own timeout fires first): a thread cannot be
cancelled, and a module that writes files must not go on after its caller was told it
stopped, so the call waits for the module, which ends by its own deadline (the call's
timeout, counted from when the runner started it). A model request in flight gets the
cancellation and answers the module with an error, and the module is stopped at its
next tick.

The protocol (docs/tool-runners.md, "The protocol"): stdin holds ``{"arguments":
{...}}`` (a private memfd, handed to wasmtime by its ``/proc/self/fd`` path); the module
writes one JSON value, the call's result, on stdout and exits 0 (or returns from
``_start``). Anything else is an error (:func:`WasmCall.outcome`).

Model requests (the ``cogni`` import module; the tool's C side calls them as
``__attribute__((import_module("cogni"), import_name("model_chat")))``):

- ``model_chat(req_ptr: i32, req_len: i32) -> i32``: the request is ``model.chat``'s
  arguments as JSON (``{"model": "<alias>", "messages": [...], "max_tokens": ...}``) in
  the module's memory. gatewayd makes a nested ``model.chat`` call of the same run
  through the whole chokepoint (policy, review, audit, budget), with toolCallId
  ``<this call's id>.m<n>``, keeps its answer ``{"ok": true, "value": {"content": ...,
  ...}}`` or ``{"ok": false, "errorCode": ..., "message": ...}`` and returns its length
  in bytes (-1: the request is not readable from the module's memory).
- ``response_read(buf_ptr: i32, buf_len: i32) -> i32``: copies the kept answer (at most
  ``buf_len`` bytes) to ``buf_ptr``; returns the bytes copied (-1: out of bounds).

Only a tool whose manifest declares the alias, in a run that grants it, gets a call
made; otherwise the answer is ``policy_denied`` without one. A module that imports
neither links fine.

WASI calls run in the host, where no tick reaches them. Most are short; the one a module
can make as long as it likes, ``poll_oneoff`` (``sleep``), is gatewayd's own
(:meth:`WasmCall.poll_oneoff`), which will not sleep past the call's deadline.

Host functions never raise into wasmtime: the ``wasmtime`` package keeps an exception
raised in one in a process-wide slot that any thread's next trap may pick up, so with
calls in several threads each host function catches everything and answers -1 or an
error answer instead.

Components: an entry whose header is a component's (not a core module's) is a WASI 0.2
command component, run through its ``wasi:cli/run`` export with wasmtime's own WASI 0.2
(``add_wasip2``), which the same per-call ``WasiConfig`` feeds (stdin, stdout, stderr,
env, preopens), under the same store limits, fuel and deadline callback. It may import
only :data:`COMPONENT_IMPORTS`: not ``wasi:io/poll`` (a wait in the host, beyond the
deadline's reach: gatewayd's own ``poll_oneoff`` cannot stand in for it), not sockets.
It gets no ``cogni`` model import, and its memory cannot be looked at (see
:meth:`WasmCall._failure`).

Resource handling: one :class:`WasmEngine` per daemon; :meth:`WasmEngine.close` stops
its ticker. Error handling: every failure is a :mod:`gatewayd.errors` exception with a
message that names the tool and what to do.
"""

from __future__ import annotations

import contextlib
import ctypes
import enum
import errno
import hashlib
import hmac
import itertools
import os
import stat
import struct
import tempfile
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Final, TypeVar

import msgspec
import structlog
import trio
import wasmtime
from wasmtime import _bindings as wasmtime_c  # the epoch-deadline callback: see above
from wasmtime import component as wasmtime_component

from gatewayd import strictjson
from gatewayd.config import DEFAULT_TOOL_MEMORY_MB, DEFAULT_TOOL_TIMEOUT_S
from gatewayd.errors import (
    GatewayError,
    LimitExceeded,
    PolicyViolation,
    ToolFailed,
    ToolTimedOut,
)
from gatewayd.hostpaths.beneath import BeneathRoot
from gatewayd.policy.paths import shown
from gatewayd.protocol import ErrorCode
from gatewayd.runners.folders import MAX_ENTRY_BYTES
from gatewayd.runners.manifest import MIB
from gatewayd.runners.rights import (
    GrantedFile,
    granted_env,
    granted_files,
    granted_models,
    whole_directory_refusal,
)
from gatewayd.runners.spec import FolderTool
from gatewayd.tools.registry import ToolContext

# What the disk cache holds: a compiled core module or a compiled component.
_Compiled = TypeVar("_Compiled", wasmtime.Module, wasmtime_component.Component)

log = structlog.get_logger("gatewayd.runners.wasm")

# How often running modules are looked at (deadline, flood, stop). The wall-time limit is
# met to within one tick; each tick costs one callback per running module (microseconds).
EPOCH_TICK_S: Final = 0.01
# A call's wall time when dispatch gives none (a call gatewayd makes itself, a test):
# the daemon's default tool timeout.
DEFAULT_TIMEOUT_S: Final = DEFAULT_TOOL_TIMEOUT_S
# The instruction budget when neither the manifest nor the configuration names one.
# wasmtime charges about one unit per instruction, and compiled code runs around 10^9
# instructions a second, so this is minutes of work: the wall-time limit ends a long
# call first; fuel is the budget an author sets for a tool whose cost they know.
DEFAULT_FUEL: Final = 1_000_000_000_000
# Linear memory of one call when neither the manifest nor the configuration names one.
DEFAULT_MEMORY_BYTES: Final = DEFAULT_TOOL_MEMORY_MB * MIB
# Modules running at once (each in its own worker thread, each up to its memory limit):
# bounded so that a burst of calls cannot take every core and gigabytes of memory.
MAX_CONCURRENT_CALLS: Final = 4
# A module file larger than this is refused before it is read: the bound the tool
# folder's loader holds it to (a module that grew past it since is not the one loaded).
MAX_MODULE_BYTES: Final = MAX_ENTRY_BYTES
# A cache file larger than this is refused unread: compiled native code is a few times
# the size of its wasm module.
MAX_CACHE_FILE_BYTES: Final = 8 * MAX_MODULE_BYTES
# stderr kept for the error message (its tail is shown); more stops the module.
MAX_STDERR_BYTES: Final = 64 * 1024
# The tail of stderr an error message quotes, and the longest trap message quoted.
STDERR_TAIL_CHARS: Final = 600
MAX_TRAP_MESSAGE_CHARS: Final = 300
# A model request read from the module's memory: a conversation, like model.chat's frame.
MAX_MODEL_REQUEST_BYTES: Final = 4 * 1024 * 1024
# How the runner tells a failed call that ran out of memory (wasmtime makes memory.grow
# answer -1 past the limit, with no trap of its own): a call that failed (a trap, a
# non-zero exit) with its memory this close to the limit is reported as memory, since
# its allocator's next growth is what was refused. A call that fails far below it (one
# huge allocation refused) reads as the module's own failure.
MEMORY_NEAR_LIMIT_BYTES: Final = 1024 * 1024
# What wasmtime answers when a module declares more memory than its store may have,
# and when it declares more tables, table elements or memories than it may have.
_MEMORY_LIMIT_ERROR: Final = "exceeds memory limits"
_STRUCTURE_LIMIT_ERRORS: Final = ("exceeds table limits", "resource limit exceeded")
# The memory limit holds per linear memory, so a call gets one (a WASI command has one;
# a second would double the limit) and one instance (its module's: WASI is host code).
MAX_MEMORIES: Final = 1
MAX_INSTANCES: Final = 1
# Tables live in gatewayd's memory, outside the memory limit, 8 bytes an element: a
# table of 2^32 elements would be 32 GiB. Compilers emit one table (the indirect
# function table: one element per function whose address is taken, tens of thousands
# in the biggest programs); a second is allowed for hand-written modules.
MAX_TABLES: Final = 2
MAX_TABLE_ELEMENTS: Final = 1 << 20

# The disk cache's file format: magic, sha256 of the payload, the payload (wasmtime's
# serialized module). wasmtime's own header check refuses a file of another version or
# configuration; the digest refuses a file that was cut or altered, since a serialized
# module is native code that wasmtime would map and run as it is.
CACHE_MAGIC: Final = b"cogni-gateway wasm cache 1\n"
CACHE_SUFFIX: Final = ".cwasm"
CACHE_DIR_MODE: Final = 0o700
CACHE_FILE_MODE: Final = 0o600

WASM_MAGIC: Final = b"\0asm"
# After the magic, a core module has version 1 (bytes 01 00 00 00) and a component its
# own version and layer 1 (0d 00 01 00; wasmtime refuses other component versions).
CORE_MODULE_HEADER: Final = WASM_MAGIC + b"\x01\x00\x00\x00"
COMPONENT_LAYER: Final = b"\x01\x00"
START_EXPORT: Final = "_start"
IMPORT_MODULE: Final = "cogni"
WASI_MODULE: Final = "wasi_snapshot_preview1"

# WASI preview 1's poll_oneoff (a sleep is one clock subscription; WasmCall.poll_oneoff):
# a subscription (48 bytes: userdata, tag at 8; a clock's id at 16, timeout at 24,
# flags at 40), an event (32 bytes: userdata, error, type, nbytes, flags), the clocks
# and flag gatewayd reads, and its errnos.
_POLL_SUBSCRIPTION_BYTES: Final = 48
_POLL_USERDATA: Final = struct.Struct("<Q")
_POLL_CLOCK: Final = struct.Struct("<I4xQ8xH")
_POLL_EVENT: Final = struct.Struct("<QHB5xQH6x")
_POLL_TAG_CLOCK: Final = 0
# Subscriptions one poll may have (wasi-libc's poll() makes one per descriptor, plus
# one for its timeout): gatewayd reads each into a Python object, so a module must not
# make it read millions.
MAX_POLL_SUBSCRIPTIONS: Final = 1024
_POLL_TAGS_FD: Final = frozenset({1, 2})  # fd_read, fd_write
_WASI_CLOCK_REALTIME: Final = 0
_WASI_CLOCK_MONOTONIC: Final = 1
_WASI_SUBSCRIPTION_CLOCK_ABSTIME: Final = 1
_WASI_EINTR: Final = 27
_WASI_EINVAL: Final = 28

# WASI preview 2 components (a ``wasi:cli/run`` command: see WasmEngine._check_component).
# The command's export, any 0.2.x (wasmtime's WASI links every 0.2 minor version), and
# its one function, ``run: func() -> result``.
COMPONENT_RUN_EXPORT: Final = "wasi:cli/run@0.2."
COMPONENT_RUN_FUNC: Final = "run"
# The interfaces a component may import, each wasmtime's own WASI 0.2 host code fed by
# the call's WasiConfig (the same stdin, stdout, stderr, env and preopens as a module).
COMPONENT_IMPORTS: Final = frozenset(
    {
        *(
            f"wasi:cli/{name}"
            for name in (
                "environment",
                "exit",
                "stdin",
                "stdout",
                "stderr",
                "terminal-input",
                "terminal-output",
                "terminal-stdin",
                "terminal-stdout",
                "terminal-stderr",
            )
        ),
        "wasi:io/error",
        "wasi:io/streams",
        "wasi:clocks/wall-clock",
        "wasi:clocks/monotonic-clock",
        "wasi:filesystem/types",
        "wasi:filesystem/preopens",
        "wasi:random/random",
        "wasi:random/insecure",
        "wasi:random/insecure-seed",
    }
)
# Why the others are refused, by package or interface. wasi:io/poll is how a component
# waits (a sleep, a clock): wasmtime waits in the host, where no epoch tick reaches it,
# so a wait past the call's deadline would hold a worker thread for as long as it asks
# (measured: a 100 s sleep held its thread 100 s past a 0.3 s deadline).
COMPONENT_REFUSALS: Final = {
    "wasi:io/poll": "waiting (a sleep or a clock) happens in gatewayd's host code, beyond "
    "the reach of the call's time limit",
    "wasi:sockets": "a wasm tool has no network",
    "wasi:http": "a wasm tool has no network",
}
# A component is several core instances (the p1 adapter's command has four: the program,
# the adapter, two shims), each a few KiB of gatewayd's memory; its tables are the
# program's and the shims' (8 bytes an element, outside the memory limit, as for a
# module). Its linear memory is one, as a module's, so the memory limit stays the call's
# whole memory (toolchains give a component one memory: the program's, shared by the
# adapter).
MAX_COMPONENT_INSTANCES: Final = 16
MAX_COMPONENT_TABLES: Final = 4
# wasmtime's message for a component out of fuel: a component call answers an error,
# not a Trap with its code, so its last line (wasmtime's own, after the backtrace whose
# function names the module chooses) is compared whole.
_OUT_OF_FUEL_ERROR: Final = "wasm trap: all fuel consumed by WebAssembly"


class StopReason(enum.Enum):
    """Why the deadline callback ended a module."""

    DEADLINE = "deadline"
    STDOUT_FLOOD = "stdout flood"
    STDERR_FLOOD = "stderr flood"
    CANCELLED = "cancelled"


# --- the epoch ticker and the deadline callback -------------------------------------


class _EpochTicker:
    """Advances an engine's epoch every :data:`EPOCH_TICK_S` while calls run.

    A daemon thread (wasm code runs in worker threads, outside trio, so the ticker is
    not a trio task): it sleeps on a condition while no call runs, so an idle daemon
    does not wake 100 times a second. Resource handling: :meth:`close` stops and joins
    it; a closed ticker refuses new calls.
    """

    def __init__(self, engine: wasmtime.Engine) -> None:
        self._engine = engine
        self._cond = threading.Condition()
        self._running = 0
        self._closed = False
        self._thread: threading.Thread | None = None

    @contextlib.contextmanager
    def ticking(self) -> Iterator[None]:
        with self._cond:
            if self._closed:
                raise ToolFailed("gatewayd's wasm engine is shutting down; try again later")
            self._running += 1
            if self._thread is None:
                self._thread = threading.Thread(
                    target=self._loop, name="wasm-epoch-ticker", daemon=True
                )
                self._thread.start()
            self._cond.notify()
        try:
            yield
        finally:
            with self._cond:
                self._running -= 1

    def _loop(self) -> None:
        while True:
            with self._cond:
                while self._running == 0 and not self._closed:
                    self._cond.wait()
                if self._closed:
                    return
            time.sleep(EPOCH_TICK_S)
            self._engine.increment_epoch()

    def close(self) -> None:
        with self._cond:
            self._closed = True
            self._cond.notify()
            thread = self._thread
        if thread is not None:
            thread.join()


# The calls whose modules run now, by the key their store's deadline callback carries.
_LIVE_CALLS: dict[int, WasmCall] = {}
_call_keys = itertools.count(1)

_DeadlineCallback: Final = wasmtime_c._wasmtime_store_epoch_deadline_callback.argtypes[1]
_DeadlineFinalizer: Final = wasmtime_c._wasmtime_store_epoch_deadline_callback.argtypes[3]
_CONTINUE: Final = 0  # WASMTIME_UPDATE_DEADLINE_CONTINUE


def _on_deadline(_context: Any, data: int | None, delta: Any, kind: Any) -> int:
    """wasmtime's epoch-deadline callback: 0 (go on for one more tick) or an error.

    Never raises (ctypes would print the exception and answer 0, with ``delta`` unset):
    anything unexpected ends the module, failing closed.
    """
    try:
        call = _LIVE_CALLS.get(data or 0)
        reason = StopReason.CANCELLED if call is None else call.check_stop()
        if reason is None:
            delta[0] = 1
            kind[0] = _CONTINUE
            return 0
        message = f"stopped by gatewayd: {reason.value}"
    except BaseException:
        message = "stopped by gatewayd"
    error = wasmtime_c.wasmtime_error_new(message.encode())
    return ctypes.cast(error, ctypes.c_void_p).value or 0


def _no_finalizer(_data: int | None) -> None:
    """The callback's data is a key into :data:`_LIVE_CALLS`, removed by the call."""


# Module-level, so they live as long as any store that points at them.
_ON_DEADLINE: Final = _DeadlineCallback(_on_deadline)
_NO_FINALIZER: Final = _DeadlineFinalizer(_no_finalizer)


def _watch_store(store: wasmtime.Store, key: int) -> None:
    store.set_epoch_deadline(1)
    wasmtime_c.wasmtime_store_epoch_deadline_callback(
        store.ptr(), _ON_DEADLINE, ctypes.c_void_p(key), _NO_FINALIZER
    )


# --- the cogni import module ---------------------------------------------------------

_current = threading.local()  # .call: the WasmCall this worker thread runs


def _i32_i32_to_i32() -> wasmtime.FuncType:
    i32 = wasmtime.ValType.i32()
    return wasmtime.FuncType([i32, i32], [i32])


def _model_chat(caller: wasmtime.Caller, ptr: int, length: int) -> int:
    call: WasmCall | None = getattr(_current, "call", None)
    if call is None:
        return -1
    try:
        return call.model_chat(caller, ptr, length)
    except BaseException as exc:
        log.warning("wasm_model_chat_failed", tool=call.name, error=repr(exc))
        return -1


def _response_read(caller: wasmtime.Caller, ptr: int, length: int) -> int:
    call: WasmCall | None = getattr(_current, "call", None)
    if call is None:
        return -1
    try:
        return call.response_read(caller, ptr, length)
    except BaseException as exc:
        log.warning("wasm_response_read_failed", tool=call.name, error=repr(exc))
        return -1


def _poll_oneoff(caller: wasmtime.Caller, subs: int, events: int, count: int, out: int) -> int:
    call: WasmCall | None = getattr(_current, "call", None)
    if call is None:
        return _WASI_EINVAL
    try:
        return call.poll_oneoff(caller, subs, events, count, out)
    except BaseException as exc:
        log.warning("wasm_poll_oneoff_failed", tool=call.name, error=repr(exc))
        return _WASI_EINVAL


def _memory_of(caller: wasmtime.Caller) -> wasmtime.Memory | None:
    memory = caller.get("memory")
    return memory if isinstance(memory, wasmtime.Memory) else None


def _in_bounds(memory: wasmtime.Memory, caller: wasmtime.Caller, ptr: int, length: int) -> bool:
    return ptr >= 0 and length >= 0 and ptr + length <= memory.data_len(caller)


# --- the engine: compiling, caching, running ------------------------------------------


@dataclass(frozen=True, slots=True)
class _Loaded:
    digest: str  # sha256 hex of the module's bytes
    pre: wasmtime.InstancePre | None  # a core module, linked; None for a component
    component: wasmtime_component.Component | None = None
    run_export: str = ""  # a component's wasi:cli/run@0.2.x export


@dataclass(slots=True)
class _EntryStamp:
    """What the module file looked like when it was last read (so a warm call does not
    read and hash it again): its identity, size and times, and its digest then."""

    stamp: tuple[int, ...]
    loaded: _Loaded


def _stamp(st: os.stat_result) -> tuple[int, ...]:
    return (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns)


class WasmEngine:
    """One wasmtime engine for the daemon: compiled modules (in memory by digest, and
    on disk under ``cache_dir``), the epoch ticker, and the limiter of concurrent calls.

    ``cache_dir``: where compiled modules are kept (made 0700; None: memory only).
    ``default_memory_bytes`` / ``default_fuel``: a call's limits when its manifest names
    none. Resource handling: :meth:`close` (or ``with``) stops the ticker.
    """

    def __init__(
        self,
        cache_dir: Path | None,
        *,
        default_memory_bytes: int = DEFAULT_MEMORY_BYTES,
        default_fuel: int = DEFAULT_FUEL,
        max_concurrent: int = MAX_CONCURRENT_CALLS,
    ) -> None:
        config = wasmtime.Config()
        config.consume_fuel = True
        config.epoch_interruption = True
        # Off: what WASI preview 1 toolchains never emit and a hostile module could use
        # past its limits. GC objects live in a heap of their own beside the linear
        # memory, as large again; shared memories cannot be instantiated here anyway
        # (wasmtime's shared_memory is off), so `tools check` refuses them up front.
        config.wasm_gc = False
        config.wasm_threads = False
        self._engine = wasmtime.Engine(config)
        self._linker = wasmtime.Linker(self._engine)
        self._linker.define_wasi()
        self._linker.define_func(
            IMPORT_MODULE, "model_chat", _i32_i32_to_i32(), _model_chat, access_caller=True
        )
        self._linker.define_func(
            IMPORT_MODULE, "response_read", _i32_i32_to_i32(), _response_read, access_caller=True
        )
        # wasmtime's poll_oneoff (sleep) waits in the host, where no epoch tick reaches
        # it, for as long as the module asks: ours ends with the call's deadline.
        self._linker.allow_shadowing = True
        i32 = wasmtime.ValType.i32()
        self._linker.define_func(
            WASI_MODULE,
            "poll_oneoff",
            wasmtime.FuncType([i32, i32, i32, i32], [i32]),
            _poll_oneoff,
            access_caller=True,
        )
        # Components get wasmtime's WASI 0.2, fed by the same per-call WasiConfig.
        self._component_linker = wasmtime_component.Linker(self._engine)
        self._component_linker.add_wasip2()
        self.default_memory_bytes = default_memory_bytes
        self.default_fuel = default_fuel
        self.limiter = trio.CapacityLimiter(max_concurrent)
        self._ticker = _EpochTicker(self._engine)
        self._lock = threading.Lock()  # guards the maps below and the linker
        self._modules: dict[str, _Loaded] = {}
        # A lock per module being compiled (by digest), so it is compiled once.
        self._compiling: dict[str, threading.Lock] = {}
        self._entries: dict[str, _EntryStamp] = {}
        self.cache_dir = _prepare_cache_dir(cache_dir) if cache_dir is not None else None
        # How modules were obtained (tests and the benchmark read them).
        self.compiled = 0
        self.cache_hits = 0

    def __enter__(self) -> WasmEngine:
        return self

    def __exit__(self, *_exc: object) -> None:
        self.close()

    def close(self) -> None:
        """Stop the ticker; calls that run on end by their deadlines' own clock checks
        no more, so close only when no call runs (the daemon's shutdown)."""
        self._ticker.close()

    # -- modules ------------------------------------------------------------------

    def load(self, tool: FolderTool) -> None:
        """Compile (or load from the cache) ``tool``'s module and link it: what
        ``gatewayd tools check`` runs. Error handling: ToolFailed saying what is wrong
        (not wasm, truncated, an import gatewayd does not provide, no ``_start``, or
        for a component no ``wasi:cli/run``)."""
        self._module_for(tool)

    def _module_for(self, tool: FolderTool) -> _Loaded:
        path = tool.entry[0] if tool.entry else ""
        shown_path = f"{tool.name}'s module {Path(path).name!r}"
        try:
            fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
        except OSError as exc:
            raise ToolFailed(
                f"{shown_path} cannot be opened ({os.strerror(exc.errno or 0)}); "
                "`gatewayd tools check` says what is wrong with the tool folder"
            ) from None
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode):
                raise ToolFailed(f"{shown_path} is not a regular file")
            with self._lock:
                known = self._entries.get(path)
            if known is not None and known.stamp == _stamp(st):
                loaded = known.loaded
            else:
                if st.st_size > MAX_MODULE_BYTES:
                    raise ToolFailed(
                        f"{shown_path} has {st.st_size} bytes, more than the "
                        f"{MAX_MODULE_BYTES} a wasm tool may have"
                    )
                data = _read_all(fd, st.st_size)
                loaded = self._compile_or_load(data, shown_path)
                with self._lock:
                    self._entries[path] = _EntryStamp(_stamp(st), loaded)
        finally:
            os.close(fd)
        if tool.entry_digest and not hmac.compare_digest(
            tool.entry_digest, f"sha256:{loaded.digest}"
        ):
            # The audit records the digest read when the folder was loaded: running
            # another build under it would make the record lie.
            raise ToolFailed(
                f"{shown_path} changed since gatewayd loaded the tool folder; the operator "
                "restarts gatewayd to use the new build (a reload does not re-read tool folders)"
            )
        return loaded

    def _compile_or_load(self, data: bytes, shown_path: str) -> _Loaded:
        digest = hashlib.sha256(data).hexdigest()
        with self._lock:
            loaded = self._modules.get(digest)
            if loaded is not None:
                return loaded
            compiling = self._compiling.setdefault(digest, threading.Lock())
        # One compile per module at a time, and none under the engine's lock: a module
        # that takes seconds to compile holds up the calls of that module alone.
        with compiling:
            with self._lock:
                loaded = self._modules.get(digest)
            if loaded is not None:
                return loaded
            if _is_component(data):
                loaded = self._component(data, digest, shown_path)
                with self._lock:
                    self._modules[digest] = loaded
                    self._compiling.pop(digest, None)
                return loaded
            module = self._from_disk(digest, wasmtime.Module.deserialize)
            if module is None:
                module = self._compile(data, shown_path)
                self._to_disk(digest, module)
            if not any(export.name == START_EXPORT for export in module.exports):
                raise ToolFailed(
                    f"{shown_path} exports no {START_EXPORT}: build it as a WASI command "
                    "(a program with a main function, target wasm32-wasi)"
                )
            with self._lock:
                try:
                    pre = self._linker.instantiate_pre(module)
                except wasmtime.WasmtimeError as exc:
                    raise ToolFailed(
                        f"{shown_path} cannot be linked: {_first_reason(exc)}; a wasm tool "
                        "may import WASI preview 1 (wasi_snapshot_preview1) and "
                        "cogni.model_chat / cogni.response_read only"
                    ) from None
                loaded = _Loaded(digest=digest, pre=pre)
                self._modules[digest] = loaded
                self._compiling.pop(digest, None)
            return loaded

    def _component(self, data: bytes, digest: str, shown_path: str) -> _Loaded:
        component = self._from_disk(digest, wasmtime_component.Component.deserialize)
        if component is None:
            try:
                component = wasmtime_component.Component(self._engine, data)
            except wasmtime.WasmtimeError as exc:
                raise ToolFailed(
                    f"{shown_path} is not a valid WebAssembly component (truncated or "
                    f"corrupt?): {_first_reason(exc)}"
                ) from None
            self.compiled += 1
            self._to_disk(digest, component)
        run_export = self._check_component(component, shown_path)
        return _Loaded(digest=digest, pre=None, component=component, run_export=run_export)

    def _check_component(self, component: wasmtime_component.Component, shown_path: str) -> str:
        """The component's ``wasi:cli/run@0.2.x`` export, after checking it imports only
        :data:`COMPONENT_IMPORTS` (checked from its type: nothing of it runs here).
        Error handling: ToolFailed naming the export or import and why."""
        kind = component.type
        exports = kind.exports(self._engine)
        runs = [name for name in exports if name.startswith(COMPONENT_RUN_EXPORT)]
        if not runs:
            raise ToolFailed(
                f"{shown_path} is a component without a {COMPONENT_RUN_EXPORT}x export: build "
                "it as a WASI command (a preview 1 command made a component with wasm-tools' "
                "`component new --adapt` and the command adapter, or a wasm32-wasip2 program)"
            )
        for name in kind.imports(self._engine):
            interface, _, version = name.partition("@")
            if interface in COMPONENT_IMPORTS and version.startswith("0.2."):
                continue
            package = interface.partition("/")[0]
            reason = COMPONENT_REFUSALS.get(interface) or COMPONENT_REFUSALS.get(package)
            raise ToolFailed(
                f"{shown_path} imports {shown(name)!r}, which gatewayd does not give a "
                f"component{f': {reason}' if reason else ''}; a component may import WASI "
                "0.2's cli, io/streams, clocks, filesystem and random interfaces"
            )
        return runs[0]

    def _compile(self, data: bytes, shown_path: str) -> wasmtime.Module:
        if not data.startswith(WASM_MAGIC):
            # Checked here: wasmtime would otherwise read a text file as WAT source.
            raise ToolFailed(
                f"{shown_path} is not a WebAssembly module (a .wasm file starts with the "
                "bytes \\0asm); build the tool for wasm32-wasi"
            )
        try:
            module = wasmtime.Module(self._engine, data)
        except wasmtime.WasmtimeError as exc:
            raise ToolFailed(
                f"{shown_path} is not a valid WebAssembly module (truncated or corrupt?): "
                f"{_first_reason(exc)}"
            ) from None
        self.compiled += 1
        return module

    def _cache_path(self, digest: str) -> Path | None:
        return None if self.cache_dir is None else self.cache_dir / f"{digest}{CACHE_SUFFIX}"

    def _from_disk(
        self, digest: str, deserialize: Callable[[wasmtime.Engine, bytes], _Compiled]
    ) -> _Compiled | None:
        """The module or component cached for ``digest`` (``deserialize``:
        ``Module.deserialize`` or ``Component.deserialize``); None: compile anew."""
        payload = self._cached(digest)
        if payload is None:
            return None
        try:
            compiled = deserialize(self._engine, payload)
        except wasmtime.WasmtimeError as exc:
            # Another wasmtime version or configuration wrote it: compile anew.
            log.info("wasm_cache_file_stale", digest=digest, reason=_first_reason(exc))
            return None
        self.cache_hits += 1
        return compiled

    def _cached(self, digest: str) -> bytes | None:
        """A cache file's payload (a serialized module or component), once its owner,
        mode and embedded digest are checked; None: compile anew."""
        path = self._cache_path(digest)
        if path is None:
            return None
        try:
            fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
        except OSError:
            return None  # not cached yet (or unreadable: compiled and rewritten)
        try:
            st = os.fstat(fd)
            if (
                not stat.S_ISREG(st.st_mode)
                or st.st_uid != os.geteuid()
                or stat.S_IMODE(st.st_mode) & ~CACHE_FILE_MODE  # no bit beyond 0600
                or st.st_size > MAX_CACHE_FILE_BYTES
            ):
                log.warning("wasm_cache_file_refused", path=str(path), reason="owner or mode")
                return None
            raw = _read_all(fd, st.st_size)
        finally:
            os.close(fd)
        head = len(CACHE_MAGIC)
        payload = raw[head + 32 :]
        if not raw.startswith(CACHE_MAGIC) or not hmac.compare_digest(
            raw[head : head + 32], hashlib.sha256(payload).digest()
        ):
            log.warning("wasm_cache_file_refused", path=str(path), reason="corrupt")
            return None
        return payload

    def _to_disk(self, digest: str, module: wasmtime.Module | wasmtime_component.Component) -> None:
        path = self._cache_path(digest)
        if path is None:
            return
        try:
            payload = bytes(module.serialize())
            blob = CACHE_MAGIC + hashlib.sha256(payload).digest() + payload
            fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".tmp-", suffix=CACHE_SUFFIX)
            try:
                with os.fdopen(fd, "wb") as out:  # mkstemp makes it 0600
                    out.write(blob)
                os.replace(tmp, path)
            except BaseException:
                with contextlib.suppress(OSError):
                    os.unlink(tmp)
                raise
        except (OSError, wasmtime.WasmtimeError) as exc:
            # A cache that cannot be written costs a compile per daemon start, no more.
            log.warning("wasm_cache_write_failed", path=str(path), error=str(exc))

    # -- calls --------------------------------------------------------------------

    def run_call(self, call: WasmCall) -> Any:
        """Run ``call`` to its end in this (worker) thread; its result value.

        Error handling: the :mod:`gatewayd.errors` exception its outcome maps to.
        """
        with self._ticker.ticking():
            loaded = self._module_for(call.tool)
            key = next(_call_keys)
            _LIVE_CALLS[key] = call
            _current.call = call
            try:
                return call.execute(self._engine, loaded, key, self._component_linker)
            finally:
                _current.call = None
                del _LIVE_CALLS[key]


def _prepare_cache_dir(cache_dir: Path) -> Path | None:
    """Make ``cache_dir`` (0700) and check it is ours; None: the disk cache is off."""
    try:
        cache_dir.mkdir(mode=CACHE_DIR_MODE, parents=True, exist_ok=True)
        st = os.lstat(cache_dir)
        if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.geteuid():
            log.warning("wasm_cache_dir_refused", path=str(cache_dir), reason="not our directory")
            return None
        if stat.S_IMODE(st.st_mode) != CACHE_DIR_MODE:
            os.chmod(cache_dir, CACHE_DIR_MODE)
    except OSError as exc:
        log.warning("wasm_cache_dir_unusable", path=str(cache_dir), error=str(exc))
        return None
    return cache_dir


def _is_component(data: bytes) -> bool:
    """A component's header: the wasm magic, then a version other than a core module's
    and the component layer (wasmtime checks the version itself)."""
    return (
        data.startswith(WASM_MAGIC)
        and not data.startswith(CORE_MODULE_HEADER)
        and data[6:8] == COMPONENT_LAYER
    )


def _read_all(fd: int, size: int) -> bytes:
    chunks = []
    remaining = size
    while remaining > 0:
        chunk = os.read(fd, min(remaining, 1 << 20))
        if not chunk:
            break
        chunks.append(chunk)
        remaining -= len(chunk)
    return b"".join(chunks)


def _first_reason(exc: BaseException) -> str:
    """The cause in a wasmtime error (its "Caused by" lines, else its first line), cut."""
    text = str(exc)
    lines = [line.strip() for line in text.splitlines()]
    if "Caused by:" in lines:
        lines = lines[lines.index("Caused by:") + 1 :]
    reason = "; ".join(line for line in lines if line) or type(exc).__name__
    return shown(reason)[:MAX_TRAP_MESSAGE_CHARS]


# --- one call ---------------------------------------------------------------------------


@dataclass(slots=True)
class WasmCall:
    """One call's state, shared by its worker thread's callbacks: the limits, stdout
    and stderr as written, the model answer kept for ``response_read``, and why the
    module was stopped."""

    tool: FolderTool
    ctx: ToolContext
    stdin: bytes
    files: tuple[GrantedFile, ...]
    env: Mapping[str, str]
    models: frozenset[str]
    fuel: int
    memory_bytes: int
    timeout_s: float
    deadline: float = 0.0  # time.monotonic() when the module's time is up
    stdout: bytearray = field(default_factory=bytearray)
    stderr: bytearray = field(default_factory=bytearray)
    stop: StopReason | None = None
    answer: bytes = b""
    model_calls: int = 0
    wasi_started_ns: int = 0  # time.monotonic_ns() before WASI's clocks started

    @property
    def name(self) -> str:
        return self.tool.name

    # -- callbacks (the worker thread) ------------------------------------------------

    def check_stop(self) -> StopReason | None:
        if self.stop is None and time.monotonic() >= self.deadline:
            self.stop = StopReason.DEADLINE
        return self.stop

    def write_stdout(self, data: bytes) -> int:
        if len(self.stdout) + len(data) > self.ctx.max_output_bytes:
            self.stop = self.stop or StopReason.STDOUT_FLOOD
            return -errno.EFBIG  # the write fails; the module stops at the next tick
        self.stdout += data
        return len(data)

    def write_stderr(self, data: bytes) -> int:
        if len(self.stderr) + len(data) > MAX_STDERR_BYTES:
            self.stop = self.stop or StopReason.STDERR_FLOOD
            return -errno.EFBIG
        self.stderr += data
        return len(data)

    def model_chat(self, caller: wasmtime.Caller, ptr: int, length: int) -> int:
        memory = _memory_of(caller)
        if memory is None or length > MAX_MODEL_REQUEST_BYTES:
            return -1
        if not _in_bounds(memory, caller, ptr, length):
            return -1
        request = bytes(memory.read(caller, ptr, ptr + length))
        self.answer = msgspec.json.encode(self._model_answer(request))
        return len(self.answer)

    def response_read(self, caller: wasmtime.Caller, ptr: int, length: int) -> int:
        memory = _memory_of(caller)
        if memory is None:
            return -1
        count = min(len(self.answer), max(length, 0))
        if not _in_bounds(memory, caller, ptr, count):
            return -1
        memory.write(caller, self.answer[:count], ptr)
        return count

    def poll_oneoff(
        self, caller: wasmtime.Caller, subs: int, events: int, count: int, out: int
    ) -> int:
        """WASI's poll_oneoff, in place of wasmtime's, which sleeps in the host for as
        long as a clock subscription asks, beyond the reach of the deadline.

        Every descriptor a module holds here is a file, a directory or an in-memory
        stream, always ready, so an fd subscription is answered at once (as wasmtime
        answers it for files); clocks are slept on, in this thread. A wait that would
        end past the call's deadline is not slept: the call is stopped (``timeout``,
        at the next tick) and the module answered EINTR.
        """
        memory = _memory_of(caller)
        size = count * _POLL_SUBSCRIPTION_BYTES
        if (
            memory is None
            or not 0 < count <= MAX_POLL_SUBSCRIPTIONS
            or not _in_bounds(memory, caller, subs, size)
            or not _in_bounds(memory, caller, events, count * _POLL_EVENT.size)
            or not _in_bounds(memory, caller, out, 4)
        ):
            return _WASI_EINVAL
        data = bytes(memory.read(caller, subs, subs + size))
        waits: list[tuple[int, int, int]] = []  # (userdata, tag, nanoseconds from now)
        for offset in range(0, size, _POLL_SUBSCRIPTION_BYTES):
            (userdata,) = _POLL_USERDATA.unpack_from(data, offset)
            tag = data[offset + 8]
            if tag in _POLL_TAGS_FD:
                waits.append((userdata, tag, 0))
                continue
            if tag != _POLL_TAG_CLOCK:
                return _WASI_EINVAL
            clock, timeout, flags = _POLL_CLOCK.unpack_from(data, offset + 16)
            if flags & _WASI_SUBSCRIPTION_CLOCK_ABSTIME and clock == _WASI_CLOCK_REALTIME:
                timeout -= time.time_ns()
            elif flags & _WASI_SUBSCRIPTION_CLOCK_ABSTIME and clock == _WASI_CLOCK_MONOTONIC:
                # wasmtime's monotonic clock counts from when the call's WASI context
                # was made, just after wasi_started_ns.
                timeout -= time.monotonic_ns() - self.wasi_started_ns
            waits.append((userdata, tag, max(timeout, 0)))
        first = min(wait for _userdata, _tag, wait in waits)
        if self.stop is not None or first > (self.deadline - time.monotonic()) * 1e9:
            self.stop = self.stop or StopReason.DEADLINE
            return _WASI_EINTR
        if first > 0:
            time.sleep(first / 1e9)
        ready = [(userdata, tag) for userdata, tag, wait in waits if wait <= first]
        answer = b"".join(_POLL_EVENT.pack(userdata, 0, tag, 0, 0) for userdata, tag in ready)
        memory.write(caller, answer, events)
        memory.write(caller, len(ready).to_bytes(4, "little"), out)
        return 0

    def _model_answer(self, request: bytes) -> dict[str, Any]:
        try:
            args = strictjson.loads(request)
        except strictjson.JsonInputError as exc:
            return _refused(ErrorCode.INVALID_ARGS, f"the model request is not JSON: {exc}")
        if not isinstance(args, dict):
            return _refused(
                ErrorCode.INVALID_ARGS,
                'the model request is model.chat\'s arguments, a JSON object: {"model": '
                '"<alias>", "messages": [{"role": "user", "content": "..."}]}',
            )
        alias = args.get("model")
        if not isinstance(alias, str) or alias not in self.models:
            granted = ", ".join(sorted(self.models)) or "none"
            return _refused(
                ErrorCode.POLICY_DENIED,
                f"{self.name} may ask only the model aliases its manifest declares and "
                f"this run grants ({granted}), not {shown(str(alias))!r}",
            )
        nested = self.ctx.nested
        if nested is None:
            return _refused(
                ErrorCode.POLICY_DENIED, "this call cannot make model requests (no call id)"
            )
        self.model_calls += 1
        try:
            # Runs in the task that started the worker thread: the call's cancellation
            # reaches it, and it runs in the call's slot (dispatch knows it holds one).
            response = trio.from_thread.run(nested, "model.chat", args, f"m{self.model_calls}")
        except trio.Cancelled:
            # The call was cancelled while the model answered: the module stops at its
            # next tick; the cancellation reaches the caller when the thread returns.
            self.stop = StopReason.CANCELLED
            return _refused(ErrorCode.TIMEOUT, "the call was stopped")
        if response.ok:
            value = response.value
            return {"ok": True, "value": value}
        code = response.errorCode or ErrorCode.INTERNAL
        return _refused(code, response.safeMessage or str(code))

    # -- running --------------------------------------------------------------------

    def execute(
        self,
        engine: wasmtime.Engine,
        loaded: _Loaded,
        key: int,
        component_linker: wasmtime_component.Linker | None = None,
    ) -> Any:
        store = wasmtime.Store(engine)
        try:
            if loaded.component is not None and component_linker is not None:
                return self._execute_component(store, loaded, component_linker, key)
            return self._execute_in(store, loaded, key)
        finally:
            # Freed now, not when the garbage collector gets to it: a failed call's
            # traceback holds the frames that hold the store, and with them its
            # descriptors (the preopened directories, stdin) and its linear memory.
            store.close()

    def _prepare(self, store: wasmtime.Store, key: int, *, instances: int, tables: int) -> None:
        """The call's limits, its deadline's watch and its WASI context, on ``store``."""
        store.set_limits(
            memory_size=self.memory_bytes,
            memories=MAX_MEMORIES,
            instances=instances,
            tables=tables,
            table_elements=MAX_TABLE_ELEMENTS,
        )
        store.set_fuel(self.fuel)
        _watch_store(store, key)
        wasi = self._wasi_config()
        self.wasi_started_ns = time.monotonic_ns()
        store.set_wasi(wasi)
        self.deadline = time.monotonic() + self.timeout_s

    def _execute_in(self, store: wasmtime.Store, loaded: _Loaded, key: int) -> Any:
        self._prepare(store, key, instances=MAX_INSTANCES, tables=MAX_TABLES)
        instance: wasmtime.Instance | None = None
        assert loaded.pre is not None  # a core module (execute sends components elsewhere)
        try:
            instance = loaded.pre.instantiate(store)
            start = instance.exports(store)[START_EXPORT]
            if not isinstance(start, wasmtime.Func):
                raise ToolFailed(f"{self.name}'s {START_EXPORT} export is not a function")
            start(store)
        except wasmtime.ExitTrap as exit_trap:
            if exit_trap.code != 0:
                raise self._failure(store, instance, exit_trap) from None
        except (wasmtime.Trap, wasmtime.WasmtimeError) as exc:
            raise self._failure(store, instance, exc) from None
        if self.stop is not None:  # a flood the module survived (it returned at once)
            raise self._stopped(self.stop)
        return self._result()

    def _execute_component(
        self,
        store: wasmtime.Store,
        loaded: _Loaded,
        linker: wasmtime_component.Linker,
        key: int,
    ) -> Any:
        """A component's call: as a module's (:meth:`_execute_in`), with the WASI 0.2 of
        ``linker`` fed by the same WasiConfig, and ``wasi:cli/run``'s ``run`` for
        ``_start``. The model import is a core module's: a component has none."""
        assert loaded.component is not None
        self._prepare(store, key, instances=MAX_COMPONENT_INSTANCES, tables=MAX_COMPONENT_TABLES)
        running = False
        try:
            instance = linker.instantiate(store, loaded.component)
            running = True
            run = instance.get_export_index(store, loaded.run_export)
            index = run and instance.get_export_index(store, COMPONENT_RUN_FUNC, run)
            func = index and instance.get_func(store, index)
            if not func or func.type(store).params:
                raise ToolFailed(
                    f"{self.name}'s {loaded.run_export} has no {COMPONENT_RUN_FUNC}: func() -> "
                    "result; build it as a WASI command"
                )
            outcome = func(store)
        except wasmtime.ExitTrap as exit_trap:
            if exit_trap.code != 0:
                raise self._failure(store, None, exit_trap, running=running) from None
            outcome = None
        except wasmtime.WasmtimeError as exc:
            raise self._failure(store, None, exc, running=running) from None
        if self.stop is not None:
            raise self._stopped(self.stop)
        if isinstance(outcome, wasmtime_component.Variant) and outcome.tag == "err":
            # WASI 0.2 has no exit code: a command ends with run's result, err for a
            # failure (the p1 adapter turns every non-zero exit into exit(err): code 1).
            raise ToolFailed(f"{self.name} ended with an error{self._stderr_tail()}")
        return self._result()

    def _wasi_config(self) -> wasmtime.WasiConfig:
        wasi = wasmtime.WasiConfig()
        wasi.argv = [self.name]
        wasi.env = [[name, value] for name, value in self.env.items()]
        stdin_fd = os.memfd_create("cogni-wasm-stdin", os.MFD_CLOEXEC)
        try:
            view = memoryview(self.stdin)
            while view:
                view = view[os.write(stdin_fd, view) :]
            # wasmtime opens the path now: a new description of the memfd, at offset 0.
            wasi.stdin_file = f"/proc/self/fd/{stdin_fd}"
        finally:
            os.close(stdin_fd)
        wasi.stdout_custom = self.write_stdout
        wasi.stderr_custom = self.write_stderr
        for granted in self.files:
            self._preopen(wasi, granted)
        return wasi

    def _preopen(self, wasi: wasmtime.WasiConfig, granted: GrantedFile) -> None:
        refusal = whole_directory_refusal(granted.resolved, self.ctx.grants)
        if refusal is not None:
            raise PolicyViolation(
                f"{self.name} cannot be given '{shown(granted.visible)}' whole: {refusal}"
            )
        # No symlink is followed on the way (a link in the workspace could otherwise
        # point the preopen anywhere), and missing directories of a writable grant
        # are made, as fs.write would make them.
        with BeneathRoot(granted.resolved, follow_symlinks=False) as root:
            fd = root.open_dir(create=granted.writable)
        try:
            # wasmtime opens the directory now, through the descriptor's magic link, so
            # what it gets is the directory gatewayd opened, whatever the name is now.
            wasi.preopen_dir(f"/proc/self/fd/{fd}", granted.visible, granted.writable)
        except wasmtime.WasmtimeError as exc:
            raise ToolFailed(
                f"'{shown(granted.visible)}' cannot be given to {self.name}: {exc}"
            ) from None
        finally:
            os.close(fd)

    def _result(self) -> Any:
        if not self.stdout.strip():
            raise ToolFailed(
                f"{self.name} wrote nothing on stdout; a wasm tool writes its result there "
                f"as one JSON value{self._stderr_tail()}"
            )
        try:
            return strictjson.loads(bytes(self.stdout))
        except (strictjson.JsonInputError, UnicodeDecodeError) as exc:
            raise ToolFailed(
                f"{self.name}'s stdout is not one JSON value ({shown(str(exc))}); a wasm tool "
                f"writes its result there as one JSON value and nothing else{self._stderr_tail()}"
            ) from None

    def _stderr_tail(self) -> str:
        text = self.stderr.decode("utf-8", "replace").strip()
        if not text:
            return ""
        if len(text) > STDERR_TAIL_CHARS:
            text = "…" + text[-STDERR_TAIL_CHARS:]
        return f"; its stderr ends: {_one_line(text)}"

    def _stopped(self, reason: StopReason) -> GatewayError:
        if reason is StopReason.DEADLINE:
            return ToolTimedOut(
                f"{self.name} ran past its time limit of {self.timeout_s:g} s and was stopped"
            )
        if reason is StopReason.STDOUT_FLOOD:
            return ToolFailed(
                f"{self.name} wrote more than {self.ctx.max_output_bytes} bytes on stdout (this "
                "run's output cap) and was stopped; a wasm tool writes one JSON value there"
            )
        if reason is StopReason.STDERR_FLOOD:
            return ToolFailed(
                f"{self.name} wrote more than {MAX_STDERR_BYTES} bytes on stderr and was stopped"
            )
        return ToolFailed(f"{self.name} was stopped: its call was cancelled")

    def _failure(
        self,
        store: wasmtime.Store,
        instance: wasmtime.Instance | None,
        exc: wasmtime.Trap | wasmtime.WasmtimeError,
        *,
        running: bool = False,
    ) -> GatewayError:
        """``running``: a component whose code ran (a component has no instance to
        look at; instance None with running False is one that did not start)."""
        if self.stop is not None:
            return self._stopped(self.stop)
        limit_mib = f"{self.memory_bytes / MIB:g} MiB"
        starting = instance is None and not running
        if starting and _MEMORY_LIMIT_ERROR in str(exc):
            return LimitExceeded(
                f"{self.name} needs more memory than its limit of {limit_mib} to start (memory); "
                "raise limits.memory in its manifest"
            )
        if starting and any(error in str(exc) for error in _STRUCTURE_LIMIT_ERRORS):
            return LimitExceeded(
                f"{self.name} cannot start: {_first_reason(exc)}; a wasm tool gets "
                f"{MAX_MEMORIES} linear memory and at most {MAX_TABLES} tables of "
                f"{MAX_TABLE_ELEMENTS} elements (a component: {MAX_COMPONENT_TABLES} tables, "
                f"{MAX_COMPONENT_INSTANCES} core instances; gatewayd's limits, not the manifest's)"
            )
        fuel = isinstance(exc, wasmtime.Trap) and exc.trap_code is wasmtime.TrapCode.OUT_OF_FUEL
        if fuel or _last_line(exc) == _OUT_OF_FUEL_ERROR:
            return LimitExceeded(
                f"{self.name} used up its fuel, {self.fuel} instructions (fuel); raise "
                "limits.fuel in its manifest or make the work smaller"
            )
        if isinstance(exc, wasmtime.Trap) and exc.trap_code is wasmtime.TrapCode.INTERRUPT:
            return self._stopped(StopReason.DEADLINE)
        if instance is not None and self._near_memory_limit(store, instance):
            return LimitExceeded(
                f"{self.name} failed at its memory limit of {limit_mib} (memory): its last "
                "growth was refused; raise limits.memory in its manifest"
            )
        if isinstance(exc, wasmtime.ExitTrap):
            return ToolFailed(f"{self.name} exited with code {exc.code}{self._stderr_tail()}")
        if running:
            # A component's memory cannot be looked at from outside (no core export):
            # the limit is named, for a failure that was its allocator's refused growth.
            return ToolFailed(
                f"{self.name} trapped: {_first_reason(exc)}{self._stderr_tail()} (its memory "
                f"limit is {limit_mib}: if it ran out of memory, raise limits.memory)"
            )
        return ToolFailed(f"{self.name} trapped: {_first_reason(exc)}{self._stderr_tail()}")

    def _near_memory_limit(self, store: wasmtime.Store, instance: wasmtime.Instance) -> bool:
        memory = instance.exports(store).get("memory")
        if not isinstance(memory, wasmtime.Memory):
            return False
        return memory.data_len(store) + MEMORY_NEAR_LIMIT_BYTES > self.memory_bytes


def _last_line(exc: BaseException) -> str:
    """The last line of a wasmtime error: its root cause, which follows the backtrace."""
    lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
    return lines[-1] if lines else ""


def _one_line(text: str) -> str:
    """Module output quoted in a message: on one line, control characters escaped."""
    return "".join(c if c.isprintable() else ascii(c)[1:-1] for c in text.replace("\n", " | "))


def _refused(code: ErrorCode, message: str) -> dict[str, Any]:
    return {"ok": False, "errorCode": str(code), "message": message}


# --- the runner ---------------------------------------------------------------------------


class WasmToolRunner:
    """Runs a wasm tool's calls: each a fresh instance of its (cached) module, in a
    worker thread, with the rights of :mod:`gatewayd.runners.rights`."""

    def __init__(self, tool: FolderTool, engine: WasmEngine) -> None:
        self.tool = tool
        self.engine = engine

    async def run(self, args: Mapping[str, Any], ctx: ToolContext) -> Any:
        """The module's result. Error handling: see :meth:`WasmCall._failure`."""
        tool = self.tool
        limits = tool.manifest.limits
        call = WasmCall(
            tool=tool,
            ctx=ctx,
            stdin=msgspec.json.encode({"arguments": args}),
            files=granted_files(tool, ctx),
            env=granted_env(tool, ctx, os.environ),
            models=frozenset(granted_models(tool, ctx)),
            fuel=limits.fuel or self.engine.default_fuel,
            memory_bytes=limits.memory_bytes or self.engine.default_memory_bytes,
            timeout_s=ctx.timeout_s if ctx.timeout_s is not None else DEFAULT_TIMEOUT_S,
        )
        # Not abandoned on cancel: the module may be writing files (module docstring).
        return await trio.to_thread.run_sync(
            self.engine.run_call, call, limiter=self.engine.limiter
        )
