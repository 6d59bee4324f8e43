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
    process still running on the host (a leftover of a crashed daemon)."""

    def __init__(self, uids: UidRange) -> None:
        self.range = uids
        self._taken: set[int] = set()
        self._next = uids.base

    def acquire(self) -> HostUser:
        """A free uid as a :class:`HostUser` (gid = uid).

        Error handling: :class:`UidPoolExhausted` naming the range when none is free.
        """
        busy = uids_with_processes()
        for _ in range(self.range.count):
            uid = self._next
            self._next = (
                uid + 1 if uid + 1 < self.range.base + self.range.count else self.range.base
            )
            if uid not in self._taken and uid not in busy:
                self._taken.add(uid)
                return HostUser(uid=uid, gid=uid)
        raise UidPoolExhausted(
            f"all {self.range.count} sandbox uids ({self.range.base}.."
            f"{self.range.base + self.range.count - 1}) are in use by live runs or their "
            "processes; end a run or configure a larger range"
        )

    def release(self, user: HostUser) -> None:
        self._taken.discard(user.uid)

    @property
    def in_use(self) -> int:
        return len(self._taken)


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
    return [pid for pid, ids in _process_ids() if uid in ids]


def _process_ids() -> Iterator[tuple[int, frozenset[int]]]:
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/status", "rb") as status:
                ids: set[int] = set()
                zombie = False
                for line in status:
                    if line.startswith(b"State:"):
                        # A zombie runs nothing and holds no resource but a pid.
                        zombie = line.split()[1] == b"Z"
                    elif line.startswith((b"Uid:", b"Gid:")):
                        ids.update(int(field) for field in line.split()[1:5])
                        if line.startswith(b"Gid:"):
                            break
        except (OSError, ValueError):
            continue  # it ended while we looked
        if not zombie:
            yield int(entry), frozenset(ids)
