"""A run's network namespace: loopback only, named after the run, removed when it ends.

Invariant 3 (NETWORK_DEFAULT_DENY) starts here: the sandboxed process joins a namespace
whose only interface is its own ``lo``, so there is no route to the host's loopback
services or to any outside address; all egress is a gateway call.

Namespaces are named ``<prefix><run id>`` and pinned as files under ``/run/netns`` (the
iproute2 convention, so ``ip netns list`` shows them and ``nsenter --net=PATH`` joins them).
The name becomes a path, so run ids and prefixes are validated before anything touches
the system.

Blocking: every function here is synchronous (pyroute2 is; it also forks a short-lived
child to create a namespace and to open a netlink socket inside one). The daemon calls
them through ``trio.to_thread.run_sync``; they hold no shared state, so concurrent calls
for different runs are safe.

Error handling: every failure of the system (OSError, netlink errors, pyroute2's helper
process dying) is raised as :class:`NetnsError`, whose message names the namespace, the
step that failed and, where the errno says it, what the operator can do. Invalid input is
a ``ValueError`` (a caller bug, never the system's fault).
"""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import os
import re
import signal
import socket
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Final

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
    half-made namespace is removed before the error is raised. Blocking: call it through
    ``trio.to_thread.run_sync``.
    """
    name = netns_name(run_id, prefix=prefix)
    path = NETNS_RUN_DIR / name
    if os.path.lexists(path):
        raise _leftover(name, path)
    from pyroute2 import netns as pyroute2_netns

    try:
        with _handled_signals_blocked():
            pyroute2_netns.create(str(path))
    except FileExistsError as exc:
        # Someone pinned it between our check and the create: still a leftover, not ours.
        raise _leftover(name, path) from exc
    except _system_errors() as exc:
        error = NetnsError(name, _explain(f"cannot create network namespace {name!r}", exc))
        _discard(name, error)  # a failed create can leave the mount-point file behind
        raise error from exc
    try:
        _bring_up_loopback(name, path)
    except NetnsError as error:
        _discard(name, error)
        raise
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
    from pyroute2 import netns as pyroute2_netns

    try:
        pyroute2_netns.remove(str(path))  # umount2(MNT_DETACH), then unlink
    except FileNotFoundError:
        return False  # removed by someone else in between
    except _system_errors() as exc:
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
    """What pyroute2 raises when the system refuses: OSError from syscalls, NetlinkError
    from the kernel's netlink answers, RuntimeError when its helper child dies."""
    from pyroute2.netlink.exceptions import NetlinkError

    return (OSError, NetlinkError, RuntimeError)


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


# The signals gatewayd handles in Python (trio's handlers: stop, reload). pyroute2 forks
# a child that runs Python without exec (to create a namespace, to open a netlink socket
# inside one) and sends it SIGTERM once it has answered. A Python handler inherited from
# gatewayd runs there, and one that waits on a lock another of gatewayd's threads held
# at the fork (trio's run_sync_soon does) waits forever, with gatewayd in waitpid for the
# child: a run stuck for good in its namespace's creation (seen in a `gatewayd worker`
# under load). Blocked in the forking thread, they stay blocked in the child, which exits
# on its own right after answering (a pending signal dies with it); pyroute2's SIGKILL
# after its timeout still ends a child that hangs. gatewayd's other threads take them.
_HANDLED_SIGNALS: Final = frozenset({signal.SIGTERM, signal.SIGINT, signal.SIGHUP})


@contextlib.contextmanager
def _handled_signals_blocked() -> Iterator[None]:
    previous = signal.pthread_sigmask(signal.SIG_BLOCK, _HANDLED_SIGNALS)
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, previous)


def _bring_up_loopback(name: str, path: Path) -> None:
    from pyroute2 import IPRoute

    step = "open a netlink socket inside it"
    try:
        # flags=0: open the namespace we just made, never create one implicitly.
        # groups=0: we only ask questions, so subscribe to no event stream.
        with _handled_signals_blocked(), IPRoute(netns=str(path), flags=0, groups=0) as ipr:
            step = "find lo"
            indexes = ipr.link_lookup(ifname=LOOPBACK)
            if len(indexes) != 1:
                raise NetnsError(name, f"network namespace {name!r} has no {LOOPBACK!r} interface")
            step = "bring lo up"
            ipr.link("set", index=indexes[0], state="up")
            step = "list its interfaces and addresses"
            links = tuple(ipr.get_links())
            addresses = tuple(ipr.get_addr())
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
