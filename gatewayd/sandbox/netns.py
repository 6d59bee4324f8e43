"""A run's network namespace: loopback only, named after the run, removed when it ends.

Invariant 3 (NETWORK_DEFAULT_DENY) starts here: the sandboxed process joins a namespace
whose only interface is its own ``lo``, so there is no route to the host's loopback
services or to any outside address; all egress is a gateway call.

Namespaces are named ``<prefix><run id>`` and pinned as files under ``/run/netns`` (the
iproute2 convention, so ``ip netns list`` shows them and ``nsenter --net=PATH`` joins them).
The name becomes a path, so run ids and prefixes are validated before anything touches
the system.

How a namespace is made, without forking the daemon: one long-lived thread of
gatewayd's (:class:`_NamespaceThread`) unshares a new network namespace for itself alone
(``unshare(CLONE_NEWNET)`` changes only the calling thread's), bind-mounts its
``/proc/thread-self/ns/net`` onto the pinned file, opens a netlink socket there to bring
``lo`` up and verify it (:mod:`gatewayd.sandbox.rtnetlink`), and joins the daemon's own
namespace again (``setns`` on a descriptor of it kept open). Nothing else ever runs in
that thread, so no other work of the daemon can find itself in a run's namespace; a
thread that cannot get back is retired, and the next creation starts a fresh one. The
steps and their order are iproute2's ``ip netns add`` (and were pyroute2's
``netns.create``, which forked a child to run them): ``/run/netns`` made a shared mount
point of its own first, so the pin propagates to mount namespaces made from the
daemon's, then an empty file with mode 0 to mount the namespace on. Removal is
``umount2(MNT_DETACH)`` and ``unlink``, in the calling thread.

Blocking: every function here is synchronous. The daemon calls them through
``trio.to_thread.run_sync``; they hold no state but the namespace thread, which takes one
creation at a time, so concurrent calls for different runs are safe.

Error handling: every failure of the system (OSError, the kernel's netlink errors) is
raised as :class:`NetnsError`, whose message names the namespace, the
step that failed and, where the errno says it, what the operator can do. Invalid input is
a ``ValueError`` (a caller bug, never the system's fault).
"""

from __future__ import annotations

import ctypes
import dataclasses
import errno
import os
import queue
import re
import socket
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any, Final

from gatewayd.files import LIBC
from gatewayd.sandbox.seccomp import CLONE_NEWNET

# Where iproute2 and pyroute2 pin named namespaces (pyroute2 says /var/run/netns, a
# symlink to /run on Debian). We always hand pyroute2 the full path, so both agree.
NETNS_RUN_DIR = Path("/run/netns")

# The stem of every prefix gatewayd derives (``cogni-<8 hex of the state directory's
# hash>-``, gatewayd.sandbox.daemons), and the prefix of callers that name none. A
# daemon's start removes every namespace with its prefix (:func:`sweeps`), so two live
# daemons never share one: the host's registry of daemons refuses the second.
NETNS_PREFIX = "cogni-"

# A netns name is a file name under /run/netns, so the file system's NAME_MAX applies;
# iproute2 refuses longer names for the same reason.
NAME_MAX = 255

# Run ids are 32 lowercase hex digits (16 random bytes, invariant 1). Anything else is
# refused: the name becomes a path, so "../x" must never get this far.
RUN_ID_LENGTH = 32
_RUN_ID_RE = re.compile(r"[0-9a-f]{32}")

# A prefix is short, lowercase, starts with a letter and ends with "-" so the run id
# stands out in `ip netns list`. 64 leaves room for the id well under NAME_MAX.
MAX_PREFIX_LENGTH = 64
_PREFIX_RE = re.compile(r"[a-z][a-z0-9-]*-")
_RUN_NETNS_NAME_RE = re.compile(r"[a-z][a-z0-9-]*-[0-9a-f]{32}")

LOOPBACK = "lo"
# The index the kernel gives every namespace's loopback device (LOOPBACK_IFINDEX in
# include/net/net_namespace.h): lo is brought up by it, without a dump of the
# interfaces first (a quarter of a creation's netlink work); the dump after it checks
# that lo is the only interface, and up.
_LOOPBACK_INDEX: Final = 1
_IFF_UP = 0x1  # <linux/if.h>
_IFF_LOOPBACK = 0x8
# What the kernel gives lo when it comes up. IPv6 is absent when the host disables it.
_EXPECTED_IPV4 = frozenset({("127.0.0.1", 8)})
_ALLOWED_IPV6 = frozenset({("::1", 128)})

_ERRNO_HINTS: dict[int, str] = {
    errno.EPERM: "needs CAP_SYS_ADMIN and CAP_NET_ADMIN: run gatewayd as root",
    errno.EACCES: "needs CAP_SYS_ADMIN and CAP_NET_ADMIN: run gatewayd as root",
    errno.ENOSPC: "the host's namespace limit is reached (sysctl user.max_net_namespaces)",
    errno.EROFS: f"{NETNS_RUN_DIR} is on a read-only file system",
    errno.EBUSY: "it is still mounted; unmounting needs CAP_SYS_ADMIN",
}


class NetnsError(Exception):
    """The system refused a network-namespace operation; ``str(exc)`` says which and why."""

    def __init__(self, name: str, message: str) -> None:
        super().__init__(message)
        self.name = name


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class NetnsHandle:
    """A run's network namespace, created, loopback up and verified loopback-only."""

    run_id: str
    name: str
    path: Path  # join it with setns(2) on an fd of this file, or `nsenter --net=PATH`


def netns_name(run_id: str, *, prefix: str = NETNS_PREFIX) -> str:
    """The namespace name for ``run_id``: ``prefix`` followed by the 32-hex run id.

    Raises ``ValueError`` for a run id that is not 32 lowercase hex digits or a prefix
    that is not lowercase letters, digits and "-" ending in "-".
    """
    _check_prefix(prefix)
    if not isinstance(run_id, str) or not _RUN_ID_RE.fullmatch(run_id):
        raise ValueError(
            f"run id {run_id!r} is not allowed: a run id is exactly {RUN_ID_LENGTH} "
            "lowercase hex digits (0-9, a-f)"
        )
    return prefix + run_id


def netns_path(name: str) -> Path:
    """Where the namespace ``name`` is pinned; ``ValueError`` if it is not a run's name."""
    _check_run_netns_name(name)
    return NETNS_RUN_DIR / name


def create_run_netns(run_id: str, *, prefix: str = NETNS_PREFIX) -> NetnsHandle:
    """Create the run's namespace, bring ``lo`` up and verify it is the only interface.

    Refuses (``NetnsError``) when the namespace already exists: a run id is fresh, so an
    existing one is a leftover the caller must remove first. On any later failure the
    half-made namespace is removed before the error is raised. Made by the namespace
    thread (see the module's doc), never by a forked process. Blocking: call it through
    ``trio.to_thread.run_sync``.
    """
    name = netns_name(run_id, prefix=prefix)
    path = NETNS_RUN_DIR / name
    if os.path.lexists(path):
        raise _leftover(name, path)
    _NAMESPACE_THREAD.run(lambda home: _make(name, path, home))
    return NetnsHandle(run_id=run_id, name=name, path=path)


def remove_run_netns(name: str) -> bool:
    """Remove the namespace ``name``; True if it existed, False if it was already gone.

    Idempotent. Processes still inside keep the namespace alive (still loopback-only)
    until they exit; only its name goes. Raises ``ValueError`` for a name that is not
    ``<prefix><run id>``, ``NetnsError`` if the system refuses. Blocking.
    """
    path = netns_path(name)
    if not os.path.lexists(path):
        return False
    try:
        _unmount(path)
    except FileNotFoundError:
        return False  # removed by someone else in between
    except OSError as exc:
        raise NetnsError(
            name, _explain(f"cannot unmount network namespace {name!r} at {path}", exc)
        ) from exc
    try:
        os.unlink(path)
    except FileNotFoundError:
        return False
    except OSError as exc:
        raise NetnsError(
            name, _explain(f"cannot remove network namespace {name!r} at {path}", exc)
        ) from exc
    return True


def sweeps(prefix: str, name: str) -> bool:
    """Does the start-up sweep of a daemon with ``prefix`` take the namespace ``name``?
    Exactly when ``name`` is ``prefix`` followed by a 32-hex run id. Pure."""
    _check_prefix(prefix)
    return (
        name.startswith(prefix)
        and len(name) == len(prefix) + RUN_ID_LENGTH
        and _RUN_ID_RE.fullmatch(name, len(prefix)) is not None
    )


def prefixes_clash(a: str, b: str) -> bool:
    """Would a daemon with prefix ``a`` sweep a namespace of one with ``b``, or the other
    way round? Only when ``a == b``: a run's name is its prefix and exactly 32 hex
    digits, so two names of equal length have prefixes of equal length, and a prefix
    ends with "-", which no run id holds. Pure; ``ValueError`` for an invalid prefix."""
    _check_prefix(a)
    _check_prefix(b)
    return a == b


def stale_netns(prefix: str) -> list[str]:
    """Names under /run/netns that look like ours: ``prefix`` followed by a 32-hex run id
    (:func:`sweeps`).

    At daemon start no run of this daemon exists yet, so every such name is a crashed
    daemon's leftover (no other live daemon has this prefix: the registry of daemons
    sees to that). Other namespaces (other prefixes, or ours without a run id) are never
    listed. Sorted.
    """
    _check_prefix(prefix)
    try:
        entries = os.listdir(NETNS_RUN_DIR)
    except FileNotFoundError:
        return []  # no namespace was ever pinned on this host since boot
    except OSError as exc:
        raise NetnsError(prefix, _explain(f"cannot list {NETNS_RUN_DIR}", exc)) from exc
    return sorted(entry for entry in entries if sweeps(prefix, entry))


def remove_stale_netns(prefix: str) -> list[str]:
    """Remove every :func:`stale_netns` namespace; return the names removed.

    Tries them all before failing, so one stuck namespace does not keep the others;
    then raises one ``NetnsError`` naming each that could not be removed. Blocking.
    """
    removed: list[str] = []
    failures: list[NetnsError] = []
    for name in stale_netns(prefix):
        try:
            if remove_run_netns(name):
                removed.append(name)
        except NetnsError as error:
            failures.append(error)
    if failures:
        detail = "; ".join(str(error) for error in failures)
        raise NetnsError(
            failures[0].name,
            f"removed {len(removed)} stale network namespace(s) but {len(failures)} "
            f"remain: {detail}",
        )
    return removed


# --- internals ----------------------------------------------------------------------


def _check_prefix(prefix: str) -> None:
    if (
        not isinstance(prefix, str)
        or len(prefix) > MAX_PREFIX_LENGTH
        or not _PREFIX_RE.fullmatch(prefix)
    ):
        raise ValueError(
            f"namespace prefix {prefix!r} is not allowed: use at most {MAX_PREFIX_LENGTH} "
            "characters, lowercase letters, digits and '-', starting with a letter and "
            "ending with '-' (unset, gatewayd derives one from its state directory, "
            "e.g. 'cogni-1a2b3c4d-')"
        )


def _check_run_netns_name(name: str) -> None:
    if (
        not isinstance(name, str)
        or len(name) > MAX_PREFIX_LENGTH + RUN_ID_LENGTH
        or not _RUN_NETNS_NAME_RE.fullmatch(name)
    ):
        raise ValueError(
            f"network namespace name {name!r} is not a run's: a run's namespace is named "
            f"'<prefix><run id>', e.g. {NETNS_PREFIX + '0' * RUN_ID_LENGTH!r}"
        )


def _system_errors() -> tuple[type[Exception], ...]:
    """What the system raises when it refuses: OSError from syscalls and sockets,
    pyroute2's NetlinkError from the kernel's netlink answers."""
    from pyroute2.netlink.exceptions import NetlinkError

    return (OSError, NetlinkError)


def _explain(what: str, exc: BaseException) -> str:
    code = getattr(exc, "errno", None) or getattr(exc, "code", None)
    if isinstance(code, int) and code > 0:
        reason = f"{errno.errorcode.get(code, str(code))} ({os.strerror(code)})"
        hint = _ERRNO_HINTS.get(code)
        return f"{what}: {reason}; {hint}" if hint else f"{what}: {reason}"
    return f"{what}: {type(exc).__name__}: {exc}"


def _leftover(name: str, path: Path) -> NetnsError:
    return NetnsError(
        name,
        f"network namespace {name!r} already exists at {path}; a run id is fresh, so this "
        "is a leftover of an earlier daemon: remove it (remove_stale_netns at daemon "
        "start, or `ip netns delete NAME`) before creating the run",
    )


def _discard(name: str, error: NetnsError) -> None:
    """Best-effort removal after a failed create; a failure is noted on ``error``."""
    try:
        remove_run_netns(name)
    except NetnsError as cleanup:
        error.add_note(f"cleanup also failed, the namespace may be left behind: {cleanup}")


# Where a thread finds its own network namespace (/proc/self would name the main
# thread's): the namespace thread checks it is at home again by it after each creation.
_THREAD_NETNS: Final = "/proc/thread-self/ns/net"
# What the namespace thread bind-mounts onto the pinned file: its own namespace, the new
# one (a name of its own so a test can make the mount fail).
_BIND_SOURCE = _THREAD_NETNS
# The daemon's own network namespace: the main thread's, which nothing of gatewayd moves.
_DAEMON_NETNS: Final = "/proc/self/ns/net"
_NAMESPACE_THREAD_NAME: Final = "gatewayd-netns"
_RUN_DIR_MODE: Final = 0o755  # iproute2's for /run/netns: everyone may join a namespace
# <sys/mount.h>
_MS_BIND: Final = 0x1000
_MS_REC: Final = 0x4000
_MS_SHARED: Final = 1 << 20
_MNT_DETACH: Final = 0x2


@dataclasses.dataclass(eq=False)
class _Job:
    """One creation handed to the namespace thread; ``step`` gets the descriptor of the
    daemon's namespace, the thread's home."""

    step: Callable[[int], None]
    done: threading.Event = dataclasses.field(default_factory=threading.Event)
    error: BaseException | None = None


class _NamespaceThread:
    """The thread that makes every namespace (see the module's doc). Started on first
    use; runs one creation at a time; retired when it finds itself outside the daemon's
    namespace after one (the next creation starts another)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._jobs: queue.SimpleQueue[_Job] | None = None
        # How many namespace threads have retired so far (the tests look at it).
        self.retired = 0

    def run(self, step: Callable[[int], None]) -> None:
        """Run ``step`` in the namespace thread and wait for it; re-raises its error."""
        job = _Job(step)
        self._dispatch(job)
        job.done.wait()
        if job.error is not None:
            raise job.error

    def _dispatch(self, job: _Job) -> None:
        with self._lock:
            if self._jobs is None:
                self._jobs = queue.SimpleQueue()
                threading.Thread(
                    target=self._serve, args=(self._jobs,), name=_NAMESPACE_THREAD_NAME, daemon=True
                ).start()
            self._jobs.put(job)

    def _serve(self, jobs: queue.SimpleQueue[_Job]) -> None:
        try:
            home = os.open(_DAEMON_NETNS, os.O_RDONLY | os.O_CLOEXEC)
        except OSError as exc:
            self._retire(jobs, exc)
            return
        try:
            home_id = _identity(os.fstat(home))
            while True:
                job = jobs.get()
                try:
                    job.step(home)
                except BaseException as exc:  # handed to the caller, who re-raises it
                    job.error = exc
                finally:
                    job.done.set()
                if not _at(home_id):
                    return
        finally:
            # However it ends (not at home, or an error of its own): no job waits on
            # its queue for nobody.
            self._retire(jobs, None)
            os.close(home)

    def _retire(self, jobs: queue.SimpleQueue[_Job], error: OSError | None) -> None:
        """Stop taking jobs; those queued already go to a new thread (or fail with
        ``error``, the reason no thread can serve them)."""
        with self._lock:
            if self._jobs is jobs:
                self._jobs = None
            self.retired += 1
        while True:
            try:
                job = jobs.get_nowait()
            except queue.Empty:
                return
            if error is None:
                self._dispatch(job)
            else:
                job.error = NetnsError(
                    "",
                    _explain(
                        f"cannot open gatewayd's own network namespace {_DAEMON_NETNS}", error
                    ),
                )
                job.done.set()


_NAMESPACE_THREAD: Final = _NamespaceThread()


def _make(name: str, path: Path, home: int) -> None:
    """In the namespace thread: ``ip netns add``'s steps (see the module's doc), then lo
    up and verified. On failure nothing is left: no file, no mount, and the thread is
    back in the daemon's namespace (``home``) or raises saying it is not."""
    step = f"make {NETNS_RUN_DIR} a shared mount point of its own"
    try:
        _share_run_dir()
        step = "create its mount point"
        os.close(os.open(path, os.O_RDONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0))
    except FileExistsError as exc:
        # Someone pinned it between our check and the create: still a leftover, not ours.
        raise _leftover(name, path) from exc
    except OSError as exc:
        raise NetnsError(
            name, _explain(f"cannot create network namespace {name!r} ({step})", exc)
        ) from exc
    try:
        step = "unshare a new network namespace"
        _check(LIBC.unshare(CLONE_NEWNET), path)
        try:
            step = f"bind-mount {_BIND_SOURCE} onto its mount point"
            _check(
                LIBC.mount(os.fsencode(_BIND_SOURCE), os.fsencode(path), b"none", _MS_BIND, None),
                path,
            )
            _bring_up_loopback(name)
        finally:
            if LIBC.setns(home, CLONE_NEWNET) != 0:
                # The thread retires (it is not at home: _NamespaceThread._serve sees it).
                step = "return the thread that made it to gatewayd's own network namespace"
                _check(-1, _DAEMON_NETNS)
    except BaseException as exc:
        error = (
            exc
            if isinstance(exc, NetnsError)
            else NetnsError(
                name, _explain(f"cannot create network namespace {name!r} ({step})", exc)
            )
        )
        _discard(name, error)
        if error is exc:
            raise
        raise error from exc


class _RunDirShared:
    """Whether this process made ``/run/netns`` a shared mount point already: once is
    enough while the directory stays (it stays one until someone unmounts it, and the
    sandbox joins its namespace by a descriptor, not through the mount). iproute2
    shares it again at every ``ip netns add``; here that was a recursive mount call per
    run (over every pin there, under the kernel's mount lock, which the session's
    overlay mount waits for meanwhile). Set only by the namespace thread."""

    done: bool = False


_RUN_DIR_SHARED: Final = _RunDirShared()


def _share_run_dir() -> None:
    """``/run/netns`` exists and is a shared mount point of its own, as iproute2 makes it:
    the namespaces pinned there then show in every mount namespace made from ours. Made
    so once per process (:class:`_RunDirShared`), and again if the directory had to be
    made again."""
    try:
        os.mkdir(NETNS_RUN_DIR, _RUN_DIR_MODE)
    except FileExistsError:
        if _RUN_DIR_SHARED.done:
            return
    target = os.fsencode(NETNS_RUN_DIR)
    if LIBC.mount(b"", target, b"none", _MS_SHARED | _MS_REC, None) != 0:
        if ctypes.get_errno() != errno.EINVAL:
            _check(-1, NETNS_RUN_DIR)
        # Not a mount point yet (EINVAL): make it one, bound onto itself, then share it.
        _check(LIBC.mount(target, target, b"none", _MS_BIND | _MS_REC, None), NETNS_RUN_DIR)
        _check(LIBC.mount(b"", target, b"none", _MS_SHARED | _MS_REC, None), NETNS_RUN_DIR)
    _RUN_DIR_SHARED.done = True


def _unmount(path: Path) -> None:
    """Detach the namespace mounted at ``path``; a file with nothing mounted on it (a
    failed creation's) is left for the caller to unlink. ``OSError`` otherwise."""
    if LIBC.umount2(os.fsencode(path), _MNT_DETACH) != 0 and ctypes.get_errno() != errno.EINVAL:
        _check(-1, path)


def _check(result: int, path: Path | str) -> None:
    """Raise the ``OSError`` of a libc call that returned ``result`` (-1: it failed)."""
    if result != 0:
        code = ctypes.get_errno()
        raise OSError(code, os.strerror(code), str(path))


def _identity(st: os.stat_result) -> tuple[int, int]:
    return (st.st_dev, st.st_ino)


def _at(home_id: tuple[int, int]) -> bool:
    """Is the calling thread in the namespace ``home_id``? False also when it cannot
    tell (the thread then retires all the same)."""
    try:
        return _identity(os.stat(_THREAD_NETNS)) == home_id
    except OSError:
        return False


def _bring_up_loopback(name: str) -> None:
    """In the new namespace (the calling thread's): lo up, then verified alone."""
    from pyroute2.netlink.exceptions import NetlinkError

    from gatewayd.sandbox.rtnetlink import RouteSocket

    step = "open a netlink socket inside it"
    try:
        with RouteSocket() as route:
            step = "bring lo up"
            try:
                route.set_up(_LOOPBACK_INDEX)
            except NetlinkError as exc:
                if exc.code != errno.ENODEV:
                    raise
                raise NetnsError(
                    name, f"network namespace {name!r} has no {LOOPBACK!r} interface"
                ) from exc
            step = "list its interfaces and addresses"
            links = route.links()
            addresses = route.addresses()
    except _system_errors() as exc:
        raise NetnsError(name, _explain(f"network namespace {name!r}: cannot {step}", exc)) from exc
    _verify_loopback_only(name, links, addresses)


def _verify_loopback_only(name: str, links: tuple[Any, ...], addresses: tuple[Any, ...]) -> None:
    """Check the namespace holds exactly ``lo``, up, with only the loopback addresses.

    An explicit check, not an assert: ``python -O`` must not strip it.
    """
    found = sorted(str(link.get_attr("IFLA_IFNAME")) for link in links)
    if found != [LOOPBACK]:
        raise NetnsError(
            name,
            f"network namespace {name!r} is not loopback-only: it has interfaces {found}, "
            f"and only {LOOPBACK!r} is allowed",
        )
    flags = int(links[0]["flags"])
    if not flags & _IFF_UP or not flags & _IFF_LOOPBACK:
        raise NetnsError(
            name, f"network namespace {name!r}: {LOOPBACK!r} is not an up loopback device"
        )
    ipv4 = {
        (str(a.get_attr("IFA_ADDRESS")), int(a["prefixlen"]))
        for a in addresses
        if a["family"] == socket.AF_INET
    }
    ipv6 = {
        (str(a.get_attr("IFA_ADDRESS")), int(a["prefixlen"]))
        for a in addresses
        if a["family"] == socket.AF_INET6
    }
    other = [a for a in addresses if a["family"] not in (socket.AF_INET, socket.AF_INET6)]
    if ipv4 != _EXPECTED_IPV4 or not ipv6 <= _ALLOWED_IPV6 or other:
        raise NetnsError(
            name,
            f"network namespace {name!r} has unexpected addresses: IPv4 {sorted(ipv4)}, "
            f"IPv6 {sorted(ipv6)}; only 127.0.0.1/8 and ::1/128 on {LOOPBACK!r} are allowed",
        )
