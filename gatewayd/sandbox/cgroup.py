"""One cgroup per sandboxed command: a memory limit with swap included, a process-count limit,
and whether the kernel OOM-killed anything in it. cgroup v1 (hybrid hosts) and v2 (unified).

Two layers. The pure one reads what the kernel says (``/proc/self/cgroup``, mountinfo,
``memory.oom_control``, ``memory.events``) and decides which files get which values; it
is table-tested without a cgroup file system. The I/O one (:func:`probe_cgroups`,
:func:`create_command_cgroup`, :class:`CommandCgroup`) carries those decisions out.

Where command cgroups go: below gatewayd's *own* cgroup of each controller, moving nothing.

- v1: ``<own memory cgroup>/cogni-<run id>-<8 hex>`` and the same name below the own pids
  cgroup. v1 has no rule against processes in inner cgroups, so that is always possible
  for root.
- v2: a cgroup with processes in it may not hand controllers to children ("no internal
  processes"), so gatewayd's own cgroup can only be the parent when it is the root. The
  other layout that works is a *delegated* cgroup whose leaf holds gatewayd (systemd's
  ``Delegate=yes`` with ``DelegateSubgroup=``): commands go beside the daemon, in the
  delegated parent, when that parent carries systemd's delegation mark (the xattr
  ``trusted.delegate``) and already lists ``memory`` in its ``cgroup.subtree_control``.
  When gatewayd's own cgroup is the delegated one (``Delegate=yes`` alone, as systemd 252
  has no ``DelegateSubgroup=``), gatewayd makes that layout itself: it moves its
  processes into the leaf ``supervisor`` (:func:`enter_delegated_leaf`), enables
  ``memory`` (and ``pids``) for its cgroup's children, and commands go beside the leaf.
  Otherwise cgroups are reported unavailable with the reason, and the launcher falls back
  to RLIMIT_AS. gatewayd never edits a cgroup it was not given.

Threat model: the command is hostile and may try to leave its cgroup. It cannot: it runs
as an unprivileged uid with no capability, the sandbox has no /sys, and bwrap gives it its
own cgroup namespace rooted at the command cgroup.
"""

from __future__ import annotations

import contextlib
import enum
import errno
import os
import re
import secrets
import signal
from collections.abc import Collection, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Final

import trio

from gatewayd.errors import GatewayError

PROC_SELF_CGROUP: Final = Path("/proc/self/cgroup")
PROC_SELF_MOUNTINFO: Final = Path("/proc/self/mountinfo")
# Prefix of every cgroup gatewayd creates, so an operator (or a later stale-cgroup sweep)
# can tell them from anyone else's.
CGROUP_PREFIX: Final = "cogni-"
# Run ids are 32 lowercase hex digits (invariant 1); the name becomes a path, so nothing
# else gets this far.
_RUN_ID_RE: Final = re.compile(r"[0-9a-f]{32}")
_SUFFIX_RE: Final = re.compile(r"[0-9a-f]{8}")
# 4 random bytes: two commands of one run never share a cgroup, and the name stays short.
SUFFIX_BYTES: Final = 4
# After the sandbox is killed its tasks leave the cgroup within milliseconds; this bounds
# how long removal waits for a straggler before it reports the leak.
REMOVE_TIMEOUT_S: Final = 2.0
REMOVE_POLL_S: Final = 0.01
# The last exiting task usually leaves the cgroup within half a millisecond: start the
# retries that fast (every exec waits for this), then back off to REMOVE_POLL_S.
REMOVE_FIRST_POLL_S: Final = 0.0005
# A deferred removal (DeferredRemovals) starts this long after its command's result is
# on its way, unless the owner waits for it first: at once, its rmdirs and retries
# would take the trio thread while the answer waits for its own work (the command's
# durable end entry, about 2 ms here), and by then the exited pid namespace is
# usually gone.
REMOVE_AFTER_S: Final = 0.005
# systemd marks the cgroups it delegated with this xattr ("1"); unprivileged managers
# use the user. namespace.
DELEGATE_XATTRS: Final = ("trusted.delegate", "user.delegate")
# The leaf gatewayd moves into inside its own delegated cgroup: a v2 cgroup may hand
# controllers to children only once it holds no process. The name systemd's
# DelegateSubgroup= examples use, so both layouts look alike.
DAEMON_LEAF: Final = "supervisor"
# Rounds of moving the delegated cgroup's processes into the leaf: a process that forks
# meanwhile leaves its child behind, which the next round moves. gatewayd forks nothing
# while it probes; more than this means something else keeps starting processes there.
MOVE_ROUNDS: Final = 5
# How many forks the pids controller refused at pids.max (v1 and v2 alike, Linux 4.8+).
PIDS_EVENTS_FILE: Final = "pids.events"
PIDS_MAX_KEY: Final = "max"
# What a command's forked child writes "0" to, to join its cgroup: v1's per-thread file
# (see CommandCgroup.join_files for why not cgroup.procs there), v2's per-process one.
V1_JOIN_FILE: Final = "tasks"
V2_JOIN_FILE: Final = "cgroup.procs"
# The counter both v1 memory.oom_control (Linux 4.13+) and v2 memory.events keep.
OOM_KILL_KEY: Final = "oom_kill"

_ERRNO_HINTS: Final[dict[int, str]] = {
    errno.EACCES: "run gatewayd as root, or delegate the cgroup to its user",
    errno.EPERM: "run gatewayd as root, or delegate the cgroup to its user",
    errno.EROFS: "the cgroup file system is mounted read-only (a container without cgroup "
    "delegation); limits fall back to rlimits",
    errno.ENOENT: "the cgroup is gone or this kernel lacks the file",
}


class CgroupError(GatewayError):
    """The host refused a cgroup operation or said something unreadable; ``str(exc)`` names
    the file and what the operator can do. gatewayd's or the host's fault, never the
    command's."""


class CgroupVersion(enum.IntEnum):
    V1 = 1  # one hierarchy per controller (legacy and hybrid hosts)
    V2 = 2  # one unified hierarchy (Debian 12's default)


# --- pure: what the kernel says ---------------------------------------------------------


@dataclass(frozen=True, slots=True, kw_only=True)
class CgroupEntry:
    """One line of ``/proc/PID/cgroup``: ``hierarchy-id:controllers:path``. The v2 line
    is ``0::path``."""

    hierarchy_id: int
    controllers: frozenset[str]
    path: str


@dataclass(frozen=True, slots=True, kw_only=True)
class CgroupMount:
    """A mounted cgroup hierarchy, from ``/proc/PID/mountinfo``. ``options`` are the super
    options (v1: the hierarchy's controllers, e.g. ``memory`` or ``name=systemd``)."""

    mount_point: str
    root: str  # the cgroup at the mount point, as seen from our cgroup namespace
    version: CgroupVersion
    options: frozenset[str]


@dataclass(frozen=True, slots=True, kw_only=True)
class OwnCgroups:
    """The directories of this process's own cgroups: per v1 controller, and in the v2
    tree. None where there is no such hierarchy or its directory is not reachable here."""

    v1_memory: Path | None
    v1_pids: Path | None
    v2: Path | None
    v2_mount: Path | None  # the v2 mount point: nothing above it is reachable


def parse_proc_cgroup(text: str) -> tuple[CgroupEntry, ...]:
    """Parse ``/proc/PID/cgroup``.

    Error handling: raises :class:`CgroupError` naming the line the kernel would never
    write (a missing field, a non-numeric id).
    """
    entries = []
    for line in text.splitlines():
        if not line:
            continue
        # The path may itself contain ':', so split at the first two only.
        parts = line.split(":", 2)
        if len(parts) != 3 or not parts[0].isdigit() or not parts[2].startswith("/"):
            raise CgroupError(
                f"unreadable line {line!r} in /proc/self/cgroup: expected "
                "'hierarchy-id:controllers:/path'"
            )
        controllers = frozenset(name for name in parts[1].split(",") if name)
        entries.append(
            CgroupEntry(hierarchy_id=int(parts[0]), controllers=controllers, path=parts[2])
        )
    return tuple(entries)


def parse_mountinfo(text: str) -> tuple[CgroupMount, ...]:
    """The cgroup and cgroup2 mounts in ``/proc/PID/mountinfo``; every other mount is
    skipped.

    A line is ``id parent maj:min root mount-point options [optional...] - fstype source
    super-options``; the optional fields vary in number, so the ``-`` separates them.

    Error handling: raises :class:`CgroupError` for a cgroup line without those fields.
    """
    mounts = []
    for line in text.splitlines():
        fields = line.split(" ")
        if "-" not in fields:
            continue
        dash = fields.index("-")
        tail = fields[dash + 1 :]
        if not tail or tail[0] not in ("cgroup", "cgroup2"):
            continue
        if dash < 6 or len(tail) != 3:
            raise CgroupError(
                f"unreadable cgroup mount {line!r} in /proc/self/mountinfo: expected "
                "'id parent maj:min root mount-point options ... - fstype source options'"
            )
        mounts.append(
            CgroupMount(
                mount_point=_unescape_mount_field(fields[4]),
                root=_unescape_mount_field(fields[3]),
                version=CgroupVersion.V2 if tail[0] == "cgroup2" else CgroupVersion.V1,
                options=frozenset(tail[2].split(",")),
            )
        )
    return tuple(mounts)


def _unescape_mount_field(field: str) -> str:
    r"""mountinfo writes space, tab, newline and backslash as ``\040``, ``\011``, ``\012``,
    ``\134``."""
    return re.sub(r"\\([0-7]{3})", lambda match: chr(int(match.group(1), 8)), field)


def find_own_cgroups(
    entries: tuple[CgroupEntry, ...], mounts: tuple[CgroupMount, ...]
) -> OwnCgroups:
    """Map this process's cgroups onto the mounted hierarchies: the directory of its own
    memory and pids cgroups (v1) and of its v2 cgroup.

    A hierarchy mounted at some inner cgroup (a container's bind mount) only reaches the
    cgroups below that root; a cgroup outside every mount's root, or one shown as ``/..``
    (outside our cgroup namespace), is not reachable and gives None.
    """

    def directory(entry: CgroupEntry, version: CgroupVersion) -> tuple[Path, Path] | None:
        for mount in mounts:
            if mount.version != version:
                continue
            if version == CgroupVersion.V1 and not entry.controllers <= mount.options:
                continue
            relative = _below(entry.path, mount.root)
            if relative is not None:
                return Path(mount.mount_point, relative), Path(mount.mount_point)
        return None

    v1_memory = v1_pids = v2 = None
    for entry in entries:
        if entry.hierarchy_id == 0 and not entry.controllers:
            v2 = directory(entry, CgroupVersion.V2)
        elif "memory" in entry.controllers:
            v1_memory = directory(entry, CgroupVersion.V1)
        elif "pids" in entry.controllers:
            v1_pids = directory(entry, CgroupVersion.V1)
    return OwnCgroups(
        v1_memory=v1_memory[0] if v1_memory else None,
        v1_pids=v1_pids[0] if v1_pids else None,
        v2=v2[0] if v2 else None,
        v2_mount=v2[1] if v2 else None,
    )


def _below(path: str, root: str) -> str | None:
    """``path`` relative to ``root`` (both absolute cgroup paths), or None if outside."""
    parts = [part for part in path.split("/") if part]
    root_parts = [part for part in root.split("/") if part]
    if ".." in parts or parts[: len(root_parts)] != root_parts:
        return None
    return "/".join(parts[len(root_parts) :])


def parse_counters(text: str, *, source: str) -> dict[str, int]:
    """Parse a flat keyed file (``key value`` per line), such as ``memory.oom_control`` or
    ``memory.events``.

    Error handling: raises :class:`CgroupError` naming ``source`` for a line that is not
    a name and a whole number.
    """
    counters = {}
    for line in text.splitlines():
        if not line:
            continue
        parts = line.split()
        if len(parts) != 2 or not parts[1].isdigit():
            raise CgroupError(f"unreadable line {line!r} in {source}: expected 'name number'")
        counters[parts[0]] = int(parts[1])
    return counters


def oom_kill_count(text: str, *, source: str) -> int:
    """How many processes the kernel OOM-killed in a cgroup: ``oom_kill`` of v1
    ``memory.oom_control`` or v2 ``memory.events``.

    Error handling: raises :class:`CgroupError` when the counter is missing (v1 before
    Linux 4.13 keeps none): without it an OOM kill cannot be told from any other SIGKILL.
    """
    counters = parse_counters(text, source=source)
    if OOM_KILL_KEY not in counters:
        raise CgroupError(
            f"{source} has no '{OOM_KILL_KEY}' counter (it has: {', '.join(sorted(counters))}); "
            "Linux 4.13 or later keeps it, and without it oom_killed cannot be reported"
        )
    return counters[OOM_KILL_KEY]


# --- pure: what to write ------------------------------------------------------------------


def command_cgroup_name(run_id: str, suffix: str) -> str:
    """``cogni-<run id>-<suffix>``: names the run, unique per command.

    Error handling: ``ValueError`` (a caller bug) unless ``run_id`` is 32 lowercase hex
    digits and ``suffix`` 8; the name becomes a path.
    """
    if not _RUN_ID_RE.fullmatch(run_id) or not _SUFFIX_RE.fullmatch(suffix):
        raise ValueError(
            f"cgroup name parts {run_id!r}, {suffix!r} are not allowed: the run id must be 32 "
            "lowercase hex digits and the suffix 8"
        )
    return f"{CGROUP_PREFIX}{run_id}-{suffix}"


def memory_settings(
    version: CgroupVersion, memory_bytes: int, *, swap_limited: bool
) -> tuple[tuple[str, str], ...]:
    """``(file, value)`` to write, in order, to limit a command cgroup's memory to
    ``memory_bytes`` with swap included.

    v1 needs ``memory.limit_in_bytes`` first: ``memory.memsw.limit_in_bytes`` (memory plus
    swap) may never be below it. Without swap accounting (no memsw files) swappiness 0
    keeps the cgroup's anonymous memory out of swap instead. v2 counts swap apart, so
    ``memory.swap.max`` is 0; a kernel without it cannot stop swapping.
    """
    limit = str(memory_bytes)
    if version == CgroupVersion.V1:
        swap = (
            ("memory.memsw.limit_in_bytes", limit) if swap_limited else ("memory.swappiness", "0")
        )
        return (("memory.limit_in_bytes", limit), swap)
    settings = [("memory.max", limit)]
    if swap_limited:
        settings.append(("memory.swap.max", "0"))
    return tuple(settings)


def pids_settings(max_processes: int) -> tuple[tuple[str, str], ...]:
    """``(file, value)`` to cap the tasks (processes and threads) of a command cgroup."""
    return (("pids.max", str(max_processes)),)


def oom_counter_file(version: CgroupVersion) -> str:
    """The file of a memory cgroup that counts its OOM kills."""
    return "memory.oom_control" if version == CgroupVersion.V1 else "memory.events"


def swap_limit_file(version: CgroupVersion) -> str:
    """The file a memory cgroup has only when the kernel accounts its swap."""
    return "memory.memsw.limit_in_bytes" if version == CgroupVersion.V1 else "memory.swap.max"


@dataclass(frozen=True, slots=True)
class EnterLeaf:
    """gatewayd's own cgroup is delegated to it but holds its processes: move them into
    ``parent / DAEMON_LEAF`` and enable ``controllers`` for ``parent``'s children; command
    cgroups then go in ``parent``."""

    parent: Path
    controllers: frozenset[str]


def v2_parent(
    own: Path,
    *,
    own_subtree: frozenset[str],
    parent_subtree: frozenset[str] | None,
    parent_delegated: bool,
    own_delegated: bool = False,
    own_controllers: frozenset[str] = frozenset(),
) -> Path | EnterLeaf | str:
    """Where v2 command cgroups may go (module doc), or why nowhere.

    ``own_subtree`` and ``parent_subtree`` are the controllers in ``cgroup.subtree_control``
    of gatewayd's cgroup and of its parent (None when gatewayd's cgroup is the top of the
    tree it can see); ``own_controllers`` those its own cgroup may use
    (``cgroup.controllers``), and ``own_delegated`` whether it carries systemd's
    delegation mark.
    """
    if "memory" in own_subtree:
        return own  # only the root cgroup may hold processes and hand controllers down
    parent = own.parent
    if parent_subtree is not None and parent_delegated and "memory" in parent_subtree:
        return parent
    if own_delegated and "memory" in own_controllers:
        return EnterLeaf(own, frozenset({"memory", "pids"}) & own_controllers)
    if own_delegated:
        return (
            f"gatewayd's delegated cgroup {own} was given no memory controller (its "
            "cgroup.controllers lacks it): enable memory in the slice above it "
            "(systemd: Delegate=yes gives every controller the slice has)"
        )
    if parent_subtree is not None and parent_delegated:
        return (
            f"the delegated cgroup {parent} does not enable memory for its children: enable "
            f"it (echo '+memory +pids' > {parent}/cgroup.subtree_control)"
        )
    if parent_subtree is None:
        return (
            f"gatewayd's cgroup {own} is the top of the cgroup tree it can see and does not "
            "enable memory for children (cgroup.subtree_control); gatewayd edits no cgroup it "
            "was not given: run it in a delegated cgroup's leaf (systemd: Delegate=yes, "
            "DelegateSubgroup=supervisor)"
        )
    return (
        f"gatewayd's cgroup {own} holds processes, so it may not hand the memory controller "
        "to children (cgroup v2 has no internal processes), and its parent is not delegated "
        "to gatewayd: run it in a delegated cgroup's leaf (systemd: Delegate=yes, "
        "DelegateSubgroup=supervisor) so command cgroups go beside it"
    )


# --- I/O: probing ------------------------------------------------------------------------


@dataclass(frozen=True, slots=True, kw_only=True)
class CgroupSupport:
    """What this host offers for per-command cgroups, found once at daemon start.

    ``memory_parent`` is where command memory cgroups go (None: unavailable, see
    ``reason``); ``pids_parent`` the same for pids (None: no pids controller; in v2 it is
    ``memory_parent``). ``swap_limited`` says whether swap is counted in the memory limit.
    ``reason`` says why cgroups are unavailable, or what is missing when they are.
    """

    version: CgroupVersion | None
    memory_parent: Path | None
    pids_parent: Path | None
    swap_limited: bool
    reason: str

    def __post_init__(self) -> None:
        if (self.version is None) != (self.memory_parent is None):
            raise ValueError("a CgroupSupport has a version exactly when it has a memory parent")
        if self.memory_parent is None and (self.pids_parent is not None or not self.reason):
            raise ValueError("an unavailable CgroupSupport has no pids parent and says why")
        if self.version == CgroupVersion.V2 and self.pids_parent not in (
            None,
            self.memory_parent,
        ):
            raise ValueError("in cgroup v2 memory and pids share one directory")

    @property
    def available(self) -> bool:
        return self.memory_parent is not None

    @classmethod
    def unavailable(cls, reason: str) -> CgroupSupport:
        return cls(
            version=None, memory_parent=None, pids_parent=None, swap_limited=False, reason=reason
        )


def probe_cgroups(
    *, proc_cgroup: Path = PROC_SELF_CGROUP, mountinfo: Path = PROC_SELF_MOUNTINFO
) -> CgroupSupport:
    """Find where this process may create command cgroups, and what they can limit.

    Proves it by creating and removing a probe cgroup (``cogni-probe-<hex>``) under each
    parent and looking at the files the kernel gives it. Call once at daemon start.

    Error handling: never raises for what the host lacks; the answer is then
    ``CgroupSupport.unavailable(reason)``, and the reason names the file or controller and
    what the operator can do.
    """
    try:
        own = find_own_cgroups(
            parse_proc_cgroup(proc_cgroup.read_text()), parse_mountinfo(mountinfo.read_text())
        )
    except (OSError, CgroupError) as exc:
        return CgroupSupport.unavailable(f"cannot read this process's cgroups: {exc}")
    if own.v1_memory is not None:
        return _probe_v1(own.v1_memory, own.v1_pids)
    if own.v2 is not None and own.v2_mount is not None:
        return _probe_v2(own.v2, at_top=own.v2 == own.v2_mount)
    return CgroupSupport.unavailable(
        "no mounted cgroup hierarchy has the memory controller for this process "
        f"(see {proc_cgroup} and {mountinfo}); limits fall back to rlimits"
    )


def _probe_v1(memory: Path, pids: Path | None) -> CgroupSupport:
    try:
        with _probe_child(memory) as child:
            oom_kill_count(_read(child / "memory.oom_control"), source=str(memory))
            swap_limited = (child / swap_limit_file(CgroupVersion.V1)).exists()
    except CgroupError as exc:
        return CgroupSupport.unavailable(f"cgroup v1 memory controller unusable: {exc}")
    notes = [] if swap_limited else [_NO_SWAP_ACCOUNTING_V1]
    pids_parent = None
    if pids is None:
        notes.append("no cgroup v1 pids hierarchy; the process count stays an rlimit")
    else:
        try:
            with _probe_child(pids) as child:
                _read(child / "pids.max")
            pids_parent = pids
        except CgroupError as exc:
            notes.append(f"pids controller unusable ({exc}); the process count stays an rlimit")
    return CgroupSupport(
        version=CgroupVersion.V1,
        memory_parent=memory,
        pids_parent=pids_parent,
        swap_limited=swap_limited,
        reason="; ".join(notes),
    )


_NO_SWAP_ACCOUNTING_V1: Final = (
    "no swap accounting (memory.memsw.*; boot with swapaccount=1): swappiness 0 keeps "
    "commands out of swap instead"
)


def _probe_v2(own: Path, *, at_top: bool) -> CgroupSupport:
    try:
        own_subtree = _controllers(own / "cgroup.subtree_control")
        own_controllers = _controllers(own / "cgroup.controllers")
        parent_subtree = None if at_top else _controllers(own.parent / "cgroup.subtree_control")
    except CgroupError as exc:
        return CgroupSupport.unavailable(f"cgroup v2 unusable: {exc}")
    parent = v2_parent(
        own,
        own_subtree=own_subtree,
        parent_subtree=parent_subtree,
        parent_delegated=not at_top and _delegated(own.parent),
        own_delegated=not at_top and _delegated(own),
        own_controllers=own_controllers,
    )
    if isinstance(parent, str):
        return CgroupSupport.unavailable(parent)
    if isinstance(parent, EnterLeaf):
        try:
            enter_delegated_leaf(parent.parent, parent.controllers)
        except CgroupError as exc:
            return CgroupSupport.unavailable(f"cgroup v2 delegated subtree unusable: {exc}")
        parent = parent.parent
    try:
        with _probe_child(parent) as child:
            oom_kill_count(_read(child / "memory.events"), source=str(parent))
            swap_limited = (child / swap_limit_file(CgroupVersion.V2)).exists()
            has_pids = (child / "pids.max").exists()
    except CgroupError as exc:
        return CgroupSupport.unavailable(f"cgroup v2 memory controller unusable: {exc}")
    notes = []
    if not swap_limited:
        notes.append("no memory.swap.max (no swap accounting): swap is not limited")
    if not has_pids:
        notes.append(f"pids is not enabled in {parent}; the process count stays an rlimit")
    return CgroupSupport(
        version=CgroupVersion.V2,
        memory_parent=parent,
        pids_parent=parent if has_pids else None,
        swap_limited=swap_limited,
        reason="; ".join(notes),
    )


def enter_delegated_leaf(own: Path, controllers: Collection[str]) -> Path:
    """Move every process of the delegated cgroup ``own`` (gatewayd itself) into its
    leaf ``own / DAEMON_LEAF``, then enable ``controllers`` for ``own``'s children, so
    command cgroups can be made beside the leaf. Idempotent: a restarted gatewayd, put
    back into ``own`` by systemd, moves again. Returns the leaf.

    Error handling: :class:`CgroupError` naming the file when the kernel refuses, or
    when processes keep appearing in ``own`` for MOVE_ROUNDS rounds.
    """
    leaf = own / DAEMON_LEAF
    try:
        leaf.mkdir(exist_ok=True)
    except OSError as exc:
        raise CgroupError(_explain(f"cannot create cgroup {leaf}", exc)) from exc
    for _ in range(MOVE_ROUNDS):
        try:
            pids = _pids(own / "cgroup.procs")
        except OSError as exc:
            raise CgroupError(_explain(f"cannot read {own / 'cgroup.procs'}", exc)) from exc
        if not pids:
            break
        for pid in sorted(pids):
            try:
                _write_settings(leaf, (("cgroup.procs", str(pid)),))
            except CgroupError as exc:
                if isinstance(exc.__cause__, ProcessLookupError):
                    continue  # it ended meanwhile
                raise
    else:
        raise CgroupError(
            f"processes kept appearing in {own} for {MOVE_ROUNDS} rounds of moving them "
            f"into {leaf}: something besides gatewayd starts processes in its cgroup"
        )
    if controllers:
        enable = " ".join(f"+{name}" for name in sorted(controllers))
        _write_settings(own, (("cgroup.subtree_control", enable),))
    return leaf


def _controllers(path: Path) -> frozenset[str]:
    return frozenset(_read(path).split())


def _delegated(path: Path) -> bool:
    for name in DELEGATE_XATTRS:
        with contextlib.suppress(OSError):
            if os.getxattr(path, name) == b"1":
                return True
    return False


@contextlib.contextmanager
def _probe_child(parent: Path) -> Iterator[Path]:
    child = parent / f"{CGROUP_PREFIX}probe-{secrets.token_hex(SUFFIX_BYTES)}"
    try:
        child.mkdir()
    except OSError as exc:
        raise CgroupError(_explain(f"cannot create a cgroup in {parent}", exc)) from exc
    try:
        yield child
    finally:
        with contextlib.suppress(OSError):
            child.rmdir()


def _read(path: Path) -> str:
    try:
        return path.read_text()
    except OSError as exc:
        raise CgroupError(_explain(f"cannot read {path}", exc)) from exc


def _explain(what: str, exc: OSError) -> str:
    hint = _ERRNO_HINTS.get(exc.errno or 0)
    reason = exc.strerror or str(exc)
    return f"{what}: {reason} ({hint})" if hint else f"{what}: {reason}"


# --- I/O: one command's cgroup -------------------------------------------------------------


@dataclass(frozen=True, slots=True, kw_only=True)
class CommandCgroup:
    """The cgroup(s) of one sandboxed command: one directory in v2, one per controller in
    v1. Made by :func:`create_command_cgroup`; the launcher's child joins it by writing
    ``0`` to each of ``join_files``; :meth:`remove` when the command is over."""

    version: CgroupVersion
    memory_dir: Path
    pids_dir: Path | None  # None: no pids controller; in v2 the memory directory

    @property
    def dirs(self) -> tuple[Path, ...]:
        if self.pids_dir is None or self.pids_dir == self.memory_dir:
            return (self.memory_dir,)
        return (self.memory_dir, self.pids_dir)

    @property
    def procs_files(self) -> tuple[bytes, ...]:
        """Encoded paths of the ``cgroup.procs`` files to join, ready for a forked child
        that must not allocate much."""
        return tuple(os.fsencode(directory / "cgroup.procs") for directory in self.dirs)

    @property
    def join_files(self) -> tuple[bytes, ...]:
        """Encoded paths of the files a freshly forked, single-threaded child writes ``0``
        to, to move itself into this cgroup before it execs.

        v1: each directory's ``tasks`` file, which moves the writing *thread*. The forked
        child has exactly one thread (fork copies only the caller's), so that thread is
        the whole process, as ``cgroup.procs`` would move it, and every thread and process
        it makes later is born inside. What differs is the kernel's cost: moving a whole
        thread group takes the global ``cgroup_threadgroup_rwsem`` for writing, which
        waits for an RCU grace period whenever no migration happened a moment before
        (~10 ms at the median on this kind of host, the bulk of a command's start),
        while a thread moving *itself* cannot exit or exec meanwhile, so the kernel skips
        that lock (Linux 6.0+; older kernels take it either way, no slower than
        ``cgroup.procs``). v2: ``cgroup.procs``; its ``cgroup.threads`` moves a thread only
        within one threaded subtree, never into another domain cgroup."""
        name = V1_JOIN_FILE if self.version == CgroupVersion.V1 else V2_JOIN_FILE
        return tuple(os.fsencode(directory / name) for directory in self.dirs)

    def oom_killed(self) -> bool:
        """Whether the kernel OOM-killed any process in this cgroup so far.

        Error handling: :class:`CgroupError` when the counter cannot be read.
        """
        path = self.memory_dir / oom_counter_file(self.version)
        return oom_kill_count(_read(path), source=str(path)) > 0

    def pids_limit_hit(self) -> bool | None:
        """Whether the kernel refused a fork or a thread in this cgroup at its
        ``pids.max`` so far (``pids.events``' ``max`` counter); None when there is no
        pids controller or its counter cannot be read (an unanswered question, which
        only a hint asks: never a failure of the command)."""
        if self.pids_dir is None:
            return None
        path = self.pids_dir / PIDS_EVENTS_FILE
        try:
            counters = parse_counters(_read(path), source=str(path))
        except (CgroupError, OSError):
            return None
        hits = counters.get(PIDS_MAX_KEY)
        return None if hits is None else hits > 0

    async def remove(self) -> None:
        """SIGKILL whatever is still inside, then remove the directories. Tolerant of races:
        a process that ends first, or a directory already gone, is fine.

        Error handling: :class:`CgroupError` naming the directory if it is still busy after
        ``REMOVE_TIMEOUT_S``.
        """
        with trio.move_on_after(REMOVE_TIMEOUT_S):
            pending = list(self.dirs)
            pause = REMOVE_FIRST_POLL_S
            while pending:
                pending = [directory for directory in pending if not _try_remove(directory)]
                if pending:
                    await trio.sleep(pause)
                    pause = min(pause * 2, REMOVE_POLL_S)
            return
        raise CgroupError(
            f"cgroup {pending[0]} still has processes {REMOVE_TIMEOUT_S} s after SIGKILL; "
            "it is left behind (remove it once they are gone)"
        )


def create_command_cgroup(
    support: CgroupSupport, *, run_id: str, memory_bytes: int, max_processes: int
) -> CommandCgroup:
    """Make a command's cgroup under ``support``'s parents and set its limits.

    Resource handling: on failure every directory made so far is removed again.

    Error handling: ``ValueError`` if ``support`` is unavailable or ``run_id`` malformed
    (caller bugs); :class:`CgroupError` naming the file when the kernel refuses.
    """
    if support.version is None or support.memory_parent is None:
        raise ValueError(f"cgroups are unavailable here ({support.reason}); use rlimits")
    name = command_cgroup_name(run_id, secrets.token_hex(SUFFIX_BYTES))
    memory_dir = support.memory_parent / name
    pids_dir = support.pids_parent / name if support.pids_parent is not None else None
    cgroup = CommandCgroup(version=support.version, memory_dir=memory_dir, pids_dir=pids_dir)
    made: list[Path] = []
    try:
        for directory in cgroup.dirs:
            try:
                directory.mkdir()
            except OSError as exc:
                raise CgroupError(_explain(f"cannot create cgroup {directory}", exc)) from exc
            made.append(directory)
        settings = memory_settings(support.version, memory_bytes, swap_limited=support.swap_limited)
        _write_settings(memory_dir, settings)
        if pids_dir is not None:
            _write_settings(pids_dir, pids_settings(max_processes))
    except BaseException:
        for directory in made:
            with contextlib.suppress(OSError):
                directory.rmdir()
        raise
    return cgroup


class DeferredRemovals:
    """Command cgroups removed after their command's result is on its way, not before.

    Once a command's tree is reaped and its OOM and pids counters are read, nothing
    about its cgroup can change its result; removing it (an rmdir per controller, often
    answered EBUSY for a moment while the kernel finishes the exited pid namespace) need
    not delay the answer. :meth:`remove_later` hands a cgroup over and returns at once;
    the removal starts ``REMOVE_AFTER_S`` later, after the answer's own work, or at once
    when the owner (a run's sandbox) awaits :meth:`wait`, as it does before it lets its
    run end, so no cgroup outlives its run, and the daemon's stop ends every run first.

    Resource handling: each removal is a trio *system* task (the caller that handed it
    over may be cancelled or gone before it ends), under a shielded scope, so even the
    event loop's own end waits for it (at most ``REMOVE_TIMEOUT_S``). A daemon killed
    meanwhile leaves the cgroup empty (its command is dead), and the next start's sweep
    (:func:`remove_empty_leftovers`) removes it with the run's other leftovers.

    Error handling: a removal that fails is never raised into the event loop (a system
    task's exception would end the daemon); :meth:`wait` returns the failures, each with
    its :class:`CgroupError` message naming the directory, for the owner to retry once
    the run's processes are gone and to report.
    """

    def __init__(self) -> None:
        self._pending = 0
        self._idle = trio.Event()
        self._idle.set()
        self._hurry = trio.Event()  # set by wait(): no removal is put off from then on
        self._failed: list[tuple[CommandCgroup, str]] = []

    @property
    def pending(self) -> int:
        """How many removals are under way."""
        return self._pending

    def remove_later(self, cgroup: CommandCgroup) -> None:
        """Start removing ``cgroup`` in the background; call from the trio thread."""
        if self._pending == 0:
            self._idle = trio.Event()
        self._pending += 1
        trio.lowlevel.spawn_system_task(
            self._remove, cgroup, name=f"remove cgroup {cgroup.memory_dir.name}"
        )

    async def _remove(self, cgroup: CommandCgroup) -> None:
        try:
            with trio.CancelScope(shield=True):
                with trio.move_on_after(REMOVE_AFTER_S):
                    await self._hurry.wait()
                await cgroup.remove()
        except CgroupError as exc:
            self._failed.append((cgroup, str(exc)))
        except Exception as exc:  # a bug must still not end the daemon; reported at the end
            self._failed.append((cgroup, f"cannot remove cgroup {cgroup.memory_dir}: {exc!r}"))
        finally:
            self._pending -= 1
            if self._pending == 0:
                self._idle.set()

    async def wait(self) -> tuple[tuple[CommandCgroup, str], ...]:
        """Start every removal handed over now (and any handed over later at once: the
        owner is ending), and wait until each has ended; returns (and forgets) those
        that failed, with why."""
        self._hurry.set()
        await self._idle.wait()
        failed, self._failed = tuple(self._failed), []
        return failed


def _write_settings(directory: Path, settings: tuple[tuple[str, str], ...]) -> None:
    for file, value in settings:
        path = directory / file
        try:
            # No O_CREAT: on a cgroup file system a missing file means a missing feature.
            fd = os.open(path, os.O_WRONLY | os.O_CLOEXEC)
            try:
                # One write, never a loop: the kernel takes a control file's value
                # whole or refuses it (EINVAL), it never takes part of one.
                os.write(fd, value.encode())
            finally:
                os.close(fd)
        except OSError as exc:
            raise CgroupError(_explain(f"cannot set {path} to {value}", exc)) from exc


def _try_remove(directory: Path) -> bool:
    """One attempt: kill what is inside, rmdir. True once the directory is gone."""
    try:
        directory.rmdir()
        return True
    except FileNotFoundError:
        return True
    except OSError as exc:
        if exc.errno != errno.EBUSY:
            raise CgroupError(_explain(f"cannot remove cgroup {directory}", exc)) from exc
    _kill_members(directory)
    return False


def _kill_members(directory: Path) -> None:
    """SIGKILL every process listed in ``cgroup.procs``, through a pidfd opened *before*
    checking that the pid is still a member: so a pid reused by a process elsewhere is
    never signalled."""
    procs = directory / "cgroup.procs"
    try:
        before = _pids(procs)
    except OSError:
        return  # gone meanwhile; the next rmdir says so
    for pid in before:
        try:
            pidfd = os.pidfd_open(pid)
        except OSError:
            continue  # it ended
        try:
            if pid in _pids(procs):
                signal.pidfd_send_signal(pidfd, signal.SIGKILL)
        except OSError:
            pass  # it ended, or the cgroup went
        finally:
            os.close(pidfd)


def _pids(procs: Path) -> set[int]:
    return {int(line) for line in procs.read_text().split()}


# --- leftovers ------------------------------------------------------------------------------

_COMMAND_CGROUP_RE: Final = re.compile(re.escape(CGROUP_PREFIX) + r"([0-9a-f]{32})-[0-9a-f]{8}")


def remove_empty_leftovers(support: CgroupSupport, run_ids: Collection[str]) -> list[str]:
    """Remove the command cgroups a crashed daemon left for ``run_ids`` (the runs whose
    directories it left in this daemon's state directory) under ``support``'s parents;
    returns their paths. Only those runs' cgroups are considered: another live daemon
    sharing the parent has empty cgroups of its own for a moment (between mkdir and its
    child joining), and they must never be touched. Only *empty* ones go (rmdir refuses
    the others; a crashed daemon's commands died with it)."""
    removed: list[str] = []
    parents = [p for p in (support.memory_parent, support.pids_parent) if p is not None]
    for parent in dict.fromkeys(parents):
        try:
            names = [entry.name for entry in os.scandir(parent) if entry.is_dir()]
        except OSError:
            continue
        for name in names:
            match = _COMMAND_CGROUP_RE.fullmatch(name)
            if match and match.group(1) in run_ids:
                with contextlib.suppress(OSError):
                    (parent / name).rmdir()
                    removed.append(str(parent / name))
    return sorted(removed)
