"""The pool of unprivileged host uids that sandboxes run as: one uid per live run.

Why one per run: RLIMIT_NPROC counts the processes of a *host uid*, so runs sharing a uid
would share one process budget (a fork bomb in one would starve the others), and files a
run leaves behind are told apart by their owner. The uid is also the sandbox's only
identity on the host: it owns nothing outside the run's workspace, which gatewayd lends
to it for the run's lifetime (see :mod:`gatewayd.sandbox.lease`).

Unless the daemon's configuration sets one, the range lies in systemd's "container" uid
range (524288-1879048191), which no login or system user is given, at a place derived
from the state directory (:func:`gatewayd.sandbox.daemons.derived_uid_range`), so two
daemons on one host get two ranges; the host's registry of daemons refuses a daemon
whose range overlaps a live one's, whatever the settings.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Final

from gatewayd.errors import GatewayError
from gatewayd.sandbox.limits import MAX_ID, HostUser

DEFAULT_UID_COUNT: Final = 1024
_MIN_UID_BASE: Final = 1000  # below: system users (Debian's policy, /etc/adduser.conf)
# systemd's range for container uids (systemd.io/UIDS-GIDS): derived ranges lie in it.
CONTAINER_UID_FIRST: Final = 0x0008_0000  # 524288
CONTAINER_UID_LAST: Final = 0x6FFF_FFFF  # 1879048191
# /proc/PID/status is about 1.5 KiB; its Uid: and Gid: lines are within the first 1 KiB
# (they follow Name, Umask, State, Tgid, Ngid, Pid, PPid and TracerPid).
_STATUS_READ_BYTES: Final = 4096


class UidPoolExhausted(GatewayError):
    """Every uid of the pool belongs to a live run (or to a process still alive)."""


@dataclass(frozen=True, slots=True)
class UidRange:
    """``count`` uids starting at ``base``; the gid is the same number."""

    base: int
    count: int = DEFAULT_UID_COUNT

    def __post_init__(self) -> None:
        if self.count < 1 or self.base < _MIN_UID_BASE or self.base + self.count - 1 > MAX_ID:
            raise ValueError(
                f"sandbox uid range {self.base}+{self.count} is not usable: it must lie "
                f"within {_MIN_UID_BASE}..{MAX_ID} and hold at least one uid (unset, "
                f"gatewayd derives {DEFAULT_UID_COUNT} uids from its state directory)"
            )

    def __contains__(self, uid: object) -> bool:
        return isinstance(uid, int) and self.base <= uid < self.base + self.count

    def overlaps(self, other: UidRange) -> bool:
        """Do the two ranges share a uid?"""
        return self.base < other.base + other.count and other.base < self.base + self.count

    def describe(self) -> str:
        """``first..last`` (``BASE+COUNT``), as an operator reads and writes it."""
        return f"{self.base}..{self.base + self.count - 1} ({self.base}+{self.count})"


def below_every_range(uid: int) -> bool:
    """Is ``uid`` below every sandbox uid range a daemon may have (a system user's, as
    root is)? :class:`UidRange` refuses a range that starts lower, so such a uid is no
    sandbox's on this host without reading the registry of daemons. Pure."""
    return uid < _MIN_UID_BASE


def check_derivable_count(count: int) -> None:
    """A range of ``count`` uids can be derived in the container range; else
    ``ValueError`` saying the limit."""
    span = CONTAINER_UID_LAST - CONTAINER_UID_FIRST + 1
    if not 1 <= count <= span:
        raise ValueError(
            f"sandbox_uids count {count} cannot be placed in systemd's container uid range "
            f"({CONTAINER_UID_FIRST}..{CONTAINER_UID_LAST}): give 1..{span}, or set base too"
        )


class UidPool:
    """Hands out uids of a :class:`UidRange`, never one in use by a live run or by any
    process still running on the host (a leftover of a crashed daemon).

    The pool keeps its own records instead of scanning ``/proc`` at every start: the
    uids it lent (``in use`` until released) and the uids some process held when the
    pool was made (a crashed daemon's leftovers, or another program's). A uid is given
    back (:meth:`release`) only once no process of it is left: a run's end kills every
    process of its uid and sees none left before it releases it (``RunSandbox.close``),
    and after the lease is given back no file of the run's uid is left from which a
    process could gain it again. So a uid the pool lent and got back is free without a
    scan; those held at the last look are looked at again (one scan for all of them) only
    when no other uid is free. What the records cannot see, and the old scan at every start
    only narrowed: a program other than gatewayd starting to use a uid of the range
    after the pool was made (a range shared with another program is a configuration
    error; the derived ranges lie in systemd's container range, which no user is given).

    Thread-safe: one lock around the records (the scan runs outside it).
    """

    def __init__(self, uids: UidRange) -> None:
        self.range = uids
        self._lock = threading.Lock()
        # Each lent uid with the very lease it was lent as: a release must bring back
        # that lease, so a second release of an old one (after the uid was lent again)
        # cannot free the live run's.
        self._taken: dict[int, HostUser] = {}
        self._next = uids.base
        # Uids some process held when last looked at: not lent until a scan finds
        # them free. At start: a crashed daemon's leftovers (its start-up sweep kills
        # them just after) or another program's processes.
        self._held = {uid for uid in uids_with_processes() if uid in uids}
        # Scans made since the pool was made (the start-up one not counted).
        self.scans = 0

    def acquire(self) -> HostUser:
        """A free uid as a :class:`HostUser` (gid = uid).

        Error handling: :class:`UidPoolExhausted` naming the range when none is free.
        """
        with self._lock:
            user = self._take()
            looked_at = frozenset(self._held)
        if user is None and looked_at:
            # Every uid lent or held at the last look: look again, once.
            busy = uids_with_processes()
            with self._lock:
                self.scans += 1
                # Only those held before the scan began are cleared by it: one a
                # release(processes_gone=False) added meanwhile was not looked at.
                self._held -= looked_at - busy
                user = self._take()
        if user is None:
            raise UidPoolExhausted(
                f"all {self.range.count} sandbox uids ({self.range.base}.."
                f"{self.range.base + self.range.count - 1}) are in use by live runs or their "
                "processes; end a run or configure a larger range"
            )
        return user

    def _take(self) -> HostUser | None:
        """The next uid neither lent nor held, from the cursor on, lent. Lock held."""
        for _ in range(self.range.count):
            uid = self._next
            self._next = (
                uid + 1 if uid + 1 < self.range.base + self.range.count else self.range.base
            )
            if uid not in self._taken and uid not in self._held:
                user = self._taken[uid] = HostUser(uid=uid, gid=uid)
                return user
        return None

    def release(self, user: HostUser, *, processes_gone: bool = True) -> None:
        """Take ``user``'s uid back. ``processes_gone``: the caller made sure no process
        of the uid is left (a run's end: it killed them and saw none left; a run that
        never started one); False: some may be (a probe's process that just exited):
        the uid is then scanned again before it is lent again.

        Only the lease :meth:`acquire` returned counts: releasing one already given back
        changes nothing, even when its uid has been lent again since (two owners each
        giving it back once on a failed start must not free a third's live run)."""
        with self._lock:
            if self._taken.get(user.uid) is not user:
                return
            del self._taken[user.uid]
            if not processes_gone:
                self._held.add(user.uid)

    @property
    def in_use(self) -> int:
        return len(self._taken)

    @property
    def held(self) -> frozenset[int]:
        """Uids of the range a process held at the last look, not lent until free."""
        return frozenset(self._held)


def uids_with_processes() -> frozenset[int]:
    """Every uid and gid any process on the host holds (real, effective, saved or
    filesystem), from /proc."""
    held: set[int] = set()
    for _, ids in _process_ids():
        held |= ids
    return frozenset(held)


def pids_of_uid(uid: int) -> list[int]:
    """Every process holding ``uid`` as any of its user or group ids (real, effective,
    saved, filesystem): a host user who runs a set-user-ID file the run's uid owns has it
    only as its effective and saved uid, and must count as the run's too."""
    # The uid as a field of the Uid: and Gid: lines (each field follows a tab and ends
    # at a tab or the line's end), found by byte searches: the scan runs at every run's
    # end, and turning each process's eight ids into numbers was a quarter of its CPU.
    fields = (b"\t%d\t" % uid, b"\t%d\n" % uid)
    return [pid for pid, status in _statuses() if _holds(status, fields)]


def _process_ids() -> Iterator[tuple[int, frozenset[int]]]:
    """(pid, its user and group ids) of every live process but zombies."""
    for pid, status in _statuses():
        ids = _ids_of(status)
        if ids is not None:
            yield pid, ids


def _statuses() -> Iterator[tuple[int, bytes]]:
    """(pid, the start of its ``/proc/PID/status``) of every process, each read with one
    ``os.read`` (the kernel's formatting of the file is most of a scan's cost; a
    line-by-line Python parse doubled it)."""
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            fd = os.open(f"/proc/{entry}/status", os.O_RDONLY | os.O_CLOEXEC)
            try:
                status = os.read(fd, _STATUS_READ_BYTES)
            finally:
                os.close(fd)
        except OSError:
            continue  # it ended while we looked
        yield int(entry), status


def _id_lines(status: bytes) -> tuple[int, int, int] | None:
    """Where a ``/proc/PID/status``'s Uid: line starts, its Gid: line starts and that
    ends; None for a zombie (it runs nothing and holds no resource but a pid) or a file
    cut short (the process was ending)."""
    state = status.find(b"\nState:")
    if state < 0 or status[state + 8 : state + 10].strip()[:1] == b"Z":
        return None
    uid_line = status.find(b"\nUid:")
    gid_line = status.find(b"\nGid:", uid_line + 1)
    end = status.find(b"\n", gid_line + 1)
    if uid_line < 0 or gid_line < 0 or end < 0:
        return None
    return uid_line, gid_line, end


def _holds(status: bytes, fields: tuple[bytes, bytes]) -> bool:
    """Does the ``/proc/PID/status`` hold one of ``fields`` (an id between a tab and a
    tab or newline) in its Uid: or Gid: line? False for a zombie or a file cut short."""
    lines = _id_lines(status)
    if lines is None:
        return False
    uid_line, _, end = lines
    ids = status[uid_line + 5 : end + 1]
    return fields[0] in ids or fields[1] in ids


def _ids_of(status: bytes) -> frozenset[int] | None:
    """The uids and gids in a ``/proc/PID/status``; None for a zombie or a file cut
    short (:func:`_id_lines`)."""
    lines = _id_lines(status)
    if lines is None:
        return None
    uid_line, gid_line, end = lines
    try:
        return frozenset(
            int(field)
            for field in (
                *status[uid_line + 5 : gid_line].split(),
                *status[gid_line + 5 : end].split(),
            )
        )
    except ValueError:
        return None
