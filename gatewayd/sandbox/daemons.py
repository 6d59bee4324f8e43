"""The gatewayd daemons of one host, kept apart: each one's share of what the host has
only once, defaults that make shares differ, and a registry that refuses a daemon whose
share would clash with a live one's.

What a daemon takes of the host, and how its start treats it:

- its **state directory**: the start gives back every lease recorded under
  ``STATE/runs/`` (SIGKILL to each lease's uid) and removes those run directories;
- its **agent_dir** (``gatewayd agent run``'s clones): the start removes abandoned work
  directories there (lock-protected, so two daemons may share one), and nothing under
  another daemon's state directory may be one;
- its **network-namespace prefix**: the start removes every namespace named
  ``<prefix><run id>`` under /run/netns (:func:`gatewayd.sandbox.netns.sweeps`);
- its **sandbox uid range**: a uid is handed out when no process holds it, checked
  before the sandbox's first process exists, so two pools over one uid can hand it to
  two runs in that window;
- its **audit log** (the active file, its head file and closed segments) and its
  **control socket** (``gatewayd serve``): one daemon writes one log, and a daemon
  that bound another's control socket path would take its operators' requests and
  remove the path when it stops.

Command cgroups are named after random run ids and swept only for this state directory's
run directories; the probe's cgroup has a random name; so neither is shared.

Two defences. Defaults differ per state directory: unless set, the prefix and the uid
range are derived from a hash of the state directory's path (:func:`derived_netns_prefix`,
:func:`derived_uid_range`). And whatever the settings, every daemon registers in
:data:`DAEMONS_DIR` before it touches anything: one file per live daemon, flocked for the
daemon's life, saying its pid and share. A starting daemon takes the directory's lock,
drops entries nobody holds (a daemon killed with SIGKILL), and refuses to start
(:class:`DaemonClash`) when its share clashes with a live one's (:func:`clashes`).

Threat model: only a process that may make namespaces and switch uids (root, or the
unit's capabilities) can use the registry, whose directory is root's, mode 0700, and is
refused when anyone else could write it (a writer could hide a daemon from the check,
or block every start). An entry's content counts only while its flock is held.

Blocking: :func:`register_daemon` and :meth:`Registration.release` do file I/O and may
wait for another daemon's start to finish with the directory; call them in a thread.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import hashlib
import json
import os
import secrets
import stat
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Final

from gatewayd.audit.head import head_path
from gatewayd.audit.segments import segment_number
from gatewayd.files import write_all
from gatewayd.sandbox.netns import NETNS_PREFIX, prefixes_clash
from gatewayd.sandbox.uids import (
    CONTAINER_UID_FIRST,
    CONTAINER_UID_LAST,
    DEFAULT_UID_COUNT,
    UidRange,
    check_derivable_count,
)

# Under /run: gone at reboot with every namespace and process an entry could speak of.
# A fixed path, not a setting: two daemons pointed at two registries would not see
# each other.
DAEMONS_DIR: Final = Path("/run/gatewayd/daemons")
ENTRY_SUFFIX: Final = ".json"
# Another daemon's start holds the directory's lock for a few file operations (well
# under a second); this long means it is stuck (stopped in a debugger, say).
REGISTRY_LOCK_TIMEOUT_S: Final = 10.0
REGISTRY_LOCK_POLL_S: Final = 0.01
# An entry is a few hundred bytes; a bigger file in the directory is not one of ours.
MAX_ENTRY_BYTES: Final = 64 * 1024
# Hex digits of the state directory's hash in a derived prefix: 32 bits, so two state
# directories share a prefix about once in four billion pairs (and the registry refuses
# the second daemon then, with the setting to change).
PREFIX_HASH_HEX: Final = 8


class DaemonRegistryError(Exception):
    """This daemon may not start: the host's registry of daemons says no, or cannot be
    used. ``str(exc)`` says why and what to change; nothing was touched."""


class DaemonClash(DaemonRegistryError):
    """A live daemon's share clashes with this one's (:func:`clashes`)."""

    def __init__(self, message: str, other: DaemonShare) -> None:
        super().__init__(message)
        self.other = other


# --- pure: shares, defaults and clashes -----------------------------------------------


@dataclass(frozen=True, slots=True, kw_only=True)
class DaemonShare:
    """What one daemon takes of the host. ``netns_prefix`` and ``uids`` are None for a
    daemon without the OS sandbox: it makes and sweeps no namespace and uses no uid.
    ``control_socket`` is None for a daemon without one (``gatewayd run``, ``agent
    run``); ``audit_path`` and ``control_socket`` are None in an entry written by a
    gatewayd that did not register them yet (its audit log's flock still guards the
    active file and head file).
    Every path is a real path (no symbolic link, no ``..``): entries are compared as
    strings."""

    state_dir: Path
    agent_dir: Path
    netns_prefix: str | None
    uids: UidRange | None
    audit_path: Path | None = None
    control_socket: Path | None = None
    pid: int = field(default_factory=os.getpid)

    def to_json(self) -> dict[str, Any]:
        return {
            "pid": self.pid,
            "stateDir": str(self.state_dir),
            "agentDir": str(self.agent_dir),
            "netnsPrefix": self.netns_prefix,
            "uids": None if self.uids is None else [self.uids.base, self.uids.count],
            "auditPath": None if self.audit_path is None else str(self.audit_path),
            "controlSocket": None if self.control_socket is None else str(self.control_socket),
        }

    @classmethod
    def from_json(cls, data: Any) -> DaemonShare:
        """Parse an entry; ``ValueError`` naming what is wrong."""
        try:
            uids = data["uids"]
            return cls(
                pid=_int(data["pid"]),
                state_dir=Path(_text(data["stateDir"])),
                agent_dir=Path(_text(data["agentDir"])),
                netns_prefix=None if data["netnsPrefix"] is None else _text(data["netnsPrefix"]),
                uids=None if uids is None else UidRange(_int(uids[0]), _int(uids[1])),
                audit_path=_optional_path(data, "auditPath"),
                control_socket=_optional_path(data, "controlSocket"),
            )
        except (KeyError, IndexError, TypeError) as exc:
            raise ValueError(f"not a daemon entry: {type(exc).__name__}: {exc}") from None


def _int(value: Any) -> int:
    if type(value) is not int:
        raise TypeError(f"{value!r} is not a whole number")
    return value


def _text(value: Any) -> str:
    if not isinstance(value, str):
        raise TypeError(f"{value!r} is not a string")
    return value


def _optional_path(data: Any, key: str) -> Path | None:
    """A path an entry may leave out: a live daemon of an earlier gatewayd wrote none."""
    if not isinstance(data, dict):
        raise TypeError(f"{data!r} is not an object")
    value = data.get(key)
    return None if value is None else Path(_text(value))


def _state_dir_hash(state_dir: Path) -> bytes:
    """The one hash both derived defaults come from: of the path as configured."""
    return hashlib.sha256(os.fsencode(state_dir)).digest()


def derived_netns_prefix(state_dir: Path) -> str:
    """The namespace prefix of a daemon whose ``netns_prefix`` is not set:
    ``cogni-<8 hex of sha256(state_dir)>-``."""
    return f"{NETNS_PREFIX}{_state_dir_hash(state_dir).hex()[:PREFIX_HASH_HEX]}-"


def derived_uid_range(state_dir: Path, count: int = DEFAULT_UID_COUNT) -> UidRange:
    """The sandbox uids of a daemon whose ``sandbox_uids`` base is not set: ``count``
    uids in systemd's container range (no login or system user is given one), at a
    multiple of ``count`` chosen by the state directory's hash, so two state
    directories share a range about once in (range size / count) pairs.

    ``ValueError`` when ``count`` does not fit the container range.
    """
    check_derivable_count(count)
    slots = (CONTAINER_UID_LAST - CONTAINER_UID_FIRST + 1) // count
    slot = int.from_bytes(_state_dir_hash(state_dir)[8:16], "big") % slots
    return UidRange(CONTAINER_UID_FIRST + slot * count, count)


def _overlap(a: Path, b: Path) -> bool:
    return a == b or a in b.parents or b in a.parents


def _log_file(log: Path, path: Path) -> bool:
    """Is ``path`` one of the files of the audit log whose active file is ``log``: the
    active file, its head file, or a closed segment (``log.000001``...)?"""
    return path in (log, head_path(log)) or segment_number(log, path) is not None


def _swept_by(state_dir: Path, path: Path) -> bool:
    """Would a start on ``state_dir`` remove ``path``? It removes every directory it
    finds in ``state_dir/runs`` (a crashed daemon's run directories), with what is in
    them."""
    runs = state_dir / "runs"
    return runs in path.parents and path.parent != runs


def clashes(mine: DaemonShare, other: DaemonShare) -> list[str]:
    """Why ``mine`` may not start while ``other`` lives, each reason with the setting to
    change; empty when the two cannot break each other.

    - a state directory equal to, inside or around the other's state directory or
      agent_dir: a start sweeps its state directory's ``runs/``, so it would give back
      the other's leases and remove its run directories (or its clones);
    - the same namespace prefix (:func:`gatewayd.sandbox.netns.prefixes_clash`: the only
      way one start's sweep matches the other's namespaces);
    - overlapping uid ranges;
    - one audit log, or its control socket among the other's audit files, or the other
      way round: a file is one daemon's alone (the socket would replace a log file);
    - one control socket: binding it would take the other's, and stopping remove it;
    - an audit log or control socket of one beneath the other's ``runs/``, which that
      daemon's (next) start removes.

    Two daemons may share an agent_dir: its sweep only removes work directories no live
    run holds the lock of.
    """
    reasons = []
    if _overlap(mine.state_dir, other.state_dir):
        reasons.append(
            f"this daemon's state directory {mine.state_dir} "
            f"{'is' if mine.state_dir == other.state_dir else 'overlaps'} its state directory "
            f"{other.state_dir}, and a start gives back the leases and removes the run "
            "directories it finds under its state directory: give this daemon another "
            "--state-dir (state_dir)"
        )
    if _overlap(mine.state_dir, other.agent_dir):
        reasons.append(
            f"this daemon's state directory {mine.state_dir} overlaps its agent_dir "
            f"{other.agent_dir}, where its agent runs' checkouts live, and a start removes "
            "the run directories it finds under its state directory: give this daemon "
            "another --state-dir (state_dir)"
        )
    if _overlap(mine.agent_dir, other.state_dir):
        reasons.append(
            f"this daemon's agent_dir {mine.agent_dir} overlaps its state directory "
            f"{other.state_dir}, and that daemon's next start would remove what it finds "
            "there: set this daemon's agent_dir (or --state-dir, whose sibling it is by "
            "default) elsewhere"
        )
    if (
        mine.netns_prefix is not None
        and other.netns_prefix is not None
        and prefixes_clash(mine.netns_prefix, other.netns_prefix)
    ):
        reasons.append(
            f"both use the network-namespace prefix {mine.netns_prefix!r}, and a start "
            "removes every namespace with its prefix: set another --netns-prefix "
            "(netns_prefix; unset, it is derived from the state directory)"
        )
    if mine.uids is not None and other.uids is not None and mine.uids.overlaps(other.uids):
        reasons.append(
            f"this daemon's sandbox uids {mine.uids.describe()} overlap its "
            f"{other.uids.describe()}, and one uid could go to a run of each: set a "
            "--sandbox-uids (sandbox_uids) range clear of it (unset, it is derived from the "
            "state directory)"
        )
    reasons += _file_clashes(mine, other)
    return reasons


def _file_clashes(mine: DaemonShare, other: DaemonShare) -> list[str]:
    """The reasons of :func:`clashes` about the audit log and the control socket."""
    reasons = []
    audit_setting = "give this daemon another --audit (audit_path)"
    socket_setting = "give this daemon another --control-socket (control_socket)"
    if (
        mine.audit_path is not None
        and other.audit_path is not None
        and (
            _log_file(other.audit_path, mine.audit_path)
            or _log_file(mine.audit_path, other.audit_path)
        )
    ):
        reasons.append(
            f"this daemon's audit log {mine.audit_path} is its audit log "
            f"{other.audit_path} or shares a file with it (the head file "
            f"{head_path(other.audit_path).name}, closed segments "
            f"{other.audit_path.name}.NNNNNN), and one daemon writes one log: "
            f"{audit_setting}"
        )
    if (
        mine.control_socket is not None
        and other.audit_path is not None
        and _log_file(other.audit_path, mine.control_socket)
    ):
        reasons.append(
            f"this daemon's control socket {mine.control_socket} is a file of its audit "
            f"log {other.audit_path}, which the socket would replace: {socket_setting}"
        )
    if (
        mine.audit_path is not None
        and other.control_socket is not None
        and _log_file(mine.audit_path, other.control_socket)
    ):
        reasons.append(
            f"this daemon's audit log {mine.audit_path} would be written at its control "
            f"socket {other.control_socket}: {audit_setting}"
        )
    if mine.control_socket is not None and mine.control_socket == other.control_socket:
        reasons.append(
            f"this daemon's control socket {mine.control_socket} is its control socket: "
            "this one would take the operators' requests meant for it, and remove the "
            f"socket when it stops: {socket_setting}"
        )
    for what, path in (("audit log", other.audit_path), ("control socket", other.control_socket)):
        if path is not None and _swept_by(mine.state_dir, path):
            reasons.append(
                f"its {what} {path} lies in a directory of this daemon's "
                f"{mine.state_dir / 'runs'}, and a start removes those: give this daemon "
                "another --state-dir (state_dir)"
            )
    for what, path, setting in (
        ("audit log", mine.audit_path, audit_setting),
        ("control socket", mine.control_socket, socket_setting),
    ):
        if path is not None and _swept_by(other.state_dir, path):
            reasons.append(
                f"this daemon's {what} {path} lies in a directory of its "
                f"{other.state_dir / 'runs'}, which that daemon's next start would remove: "
                f"{setting}"
            )
    return reasons


def clash_message(other: DaemonShare, reasons: list[str]) -> str:
    """The refusal: who the other daemon is, each reason, and that nothing was done."""
    return (
        f"another gatewayd is running on this host (pid {other.pid}, state directory "
        f"{other.state_dir}); {'; '.join(reasons)}. This daemon did not start and "
        "touched nothing"
    )


# --- the registry ----------------------------------------------------------------------


class Registration:
    """This daemon's entry in the registry, held until :meth:`release`.

    Resource handling: holds one descriptor (the entry, flocked); release it once, at
    the daemon's end; if the process dies first, the kernel drops the flock and the
    next start removes the entry as stale.
    """

    def __init__(self, directory: Path, name: str, fd: int, stale: list[DaemonShare]) -> None:
        self.directory = directory
        self.path = directory / name
        self._name = name
        self._fd = fd
        # Entries of dead daemons that this start removed.
        self.stale = stale

    def release(self) -> None:
        """Remove the entry, then drop its lock. Idempotent; never raises: a daemon
        that is stopping has nothing left to do about a registry it cannot write (its
        entry, unlocked, is removed by the next start). Blocking."""
        if self._fd < 0:
            return
        fd, self._fd = self._fd, -1
        try:
            dfd = _open_directory(self.directory, create=False)
            try:
                # Under the directory's lock: a start never sees the entry half-gone.
                _lock_directory(dfd, self.directory, REGISTRY_LOCK_TIMEOUT_S)
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(self._name, dir_fd=dfd)
            finally:
                os.close(dfd)
        except (OSError, DaemonRegistryError):
            pass
        finally:
            os.close(fd)


def register_daemon(
    share: DaemonShare,
    *,
    directory: Path = DAEMONS_DIR,
    lock_timeout_s: float = REGISTRY_LOCK_TIMEOUT_S,
) -> Registration:
    """Register ``share`` as a live daemon, or refuse.

    Under the directory's lock: every entry whose flock nobody holds is removed (its
    daemon is dead), every live one is checked against ``share`` (:func:`clashes`), and
    only then is this daemon's entry made and locked. Call it before the daemon opens or
    sweeps anything. Blocking.

    Error handling: :class:`DaemonClash` naming the other daemon, why, and the setting
    to change; :class:`DaemonRegistryError` when the registry cannot be used (not
    root, a directory others could write, a live entry that cannot be read, another
    start holding the lock for over ``lock_timeout_s``).
    """
    dfd = _open_directory(directory, create=True)
    try:
        _lock_directory(dfd, directory, lock_timeout_s)
        live, stale = _read_entries(dfd, directory)
        for other in live:
            reasons = clashes(share, other)
            if reasons:
                raise DaemonClash(clash_message(other, reasons), other)
        name = f"{share.pid}-{secrets.token_hex(4)}{ENTRY_SUFFIX}"
        try:
            fd = os.open(
                name,
                os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC,
                0o600,
                dir_fd=dfd,
            )
        except OSError as exc:
            raise _unusable(directory, f"cannot make an entry: {exc.strerror}") from None
        try:
            # A new file, made under the directory's lock: nobody else can hold it yet.
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            write_all(fd, json.dumps(share.to_json()).encode())
        except BaseException:
            os.close(fd)
            with contextlib.suppress(OSError):
                os.unlink(name, dir_fd=dfd)
            raise
        return Registration(directory, name, fd, stale)
    finally:
        os.close(dfd)  # drops the directory's lock


def live_daemons(directory: Path = DAEMONS_DIR) -> list[DaemonShare]:
    """The daemons registered and alive now (for operators and tests). Blocking."""
    dfd = _open_directory(directory, create=False)
    try:
        _lock_directory(dfd, directory, REGISTRY_LOCK_TIMEOUT_S)
        live, _ = _read_entries(dfd, directory, remove_stale=False)
        return live
    finally:
        os.close(dfd)


def sandbox_uid_ranges(directory: Path = DAEMONS_DIR) -> list[UidRange]:
    """The sandbox uid ranges of every live daemon on this host (none when no daemon ever
    registered). A tree owned by one of them is a live run's, whichever daemon lent it:
    lending it again would record that run's uid as the owner to give it back to.
    Blocking; :class:`DaemonRegistryError` when the registry cannot be read."""
    if not os.path.lexists(directory):
        return []
    return [daemon.uids for daemon in live_daemons(directory) if daemon.uids is not None]


# --- internals ---------------------------------------------------------------------------

_HOW_TO_FIX = (
    "every gatewayd registers there so that two daemons on this host never share a state "
    "directory, a namespace prefix or sandbox uids; run gatewayd as root or with the "
    "systemd unit's capabilities (docs/operations.md)"
)


def _unusable(directory: Path, why: str) -> DaemonRegistryError:
    return DaemonRegistryError(
        f"the host's registry of gatewayd daemons ({directory}) {why}; {_HOW_TO_FIX}"
    )


def _open_directory(directory: Path, *, create: bool) -> int:
    if create:
        for path, mode in ((directory.parent, 0o755), (directory, 0o700)):
            try:
                os.mkdir(path, mode)
            except FileExistsError:
                continue
            except OSError as exc:
                raise _unusable(directory, f"cannot be made ({path}: {exc.strerror})") from None
            # Root's, whoever made it: a service user with the unit's capabilities may
            # be first, and a root daemon trusts only root's directories (or its own).
            with contextlib.suppress(OSError):
                os.chown(path, 0, 0)
    try:
        dfd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError as exc:
        if exc.errno in (errno.ELOOP, errno.ENOTDIR):  # O_NOFOLLOW | O_DIRECTORY said no
            what = "a symbolic link" if os.path.islink(directory) else "not a directory"
            raise DaemonRegistryError(
                f"the host's registry of gatewayd daemons ({directory}) is {what}, and "
                f"gatewayd trusts only a directory of root's there: remove {directory} "
                "(gatewayd makes it again)"
            ) from None
        raise _unusable(directory, f"cannot be opened: {exc.strerror}") from None
    try:
        _check_owner(os.fstat(dfd), directory)
        _check_owner(os.stat(directory.parent), directory.parent)
    except BaseException:
        os.close(dfd)
        raise
    return dfd


def _check_owner(st: os.stat_result, path: Path) -> None:
    """Only root (or this daemon's own user) may write the registry or the directory
    holding it: anyone else could hide a live daemon from the check or block every
    start with an entry of their own."""
    if st.st_uid not in (0, os.geteuid()):
        raise DaemonRegistryError(
            f"{path} belongs to uid {st.st_uid}, and the host's registry of gatewayd "
            "daemons must be root's: `chown root:root "
            f"{path}` (or remove it; gatewayd makes it again)"
        )
    if st.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        raise DaemonRegistryError(
            f"{path} is writable by its group or others (mode {stat.S_IMODE(st.st_mode):04o}), "
            "and a writer could hide a live gatewayd from the check that keeps daemons "
            f"apart: `chmod go-w {path}`"
        )


def _lock_directory(dfd: int, directory: Path, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            fcntl.flock(dfd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            if time.monotonic() >= deadline:
                raise DaemonRegistryError(
                    f"another gatewayd's start has held the registry {directory} for over "
                    f"{timeout_s:g} s; it is stuck: find it with `fuser -v {directory}`, "
                    "end it, and start this daemon again"
                ) from None
            time.sleep(REGISTRY_LOCK_POLL_S)
        else:
            return


def _read_entries(
    dfd: int, directory: Path, *, remove_stale: bool = True
) -> tuple[list[DaemonShare], list[DaemonShare]]:
    """(live, stale) entries; stale ones are removed unless told not to. Only under the
    directory's lock."""
    live: list[DaemonShare] = []
    stale: list[DaemonShare] = []
    for name in sorted(os.listdir(dfd)):
        if not name.endswith(ENTRY_SUFFIX):
            continue
        try:
            fd = os.open(
                name, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, dir_fd=dfd
            )
        except FileNotFoundError:
            continue
        except OSError as exc:
            raise _unusable(
                directory, f"has an entry {name} that cannot be opened: {exc}"
            ) from None
        try:
            try:
                fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
            except BlockingIOError:
                live.append(_parse_live(fd, directory / name))
                continue
            # Nobody holds it: its daemon is dead. Kept for the log, if it still reads.
            with contextlib.suppress(ValueError):
                stale.append(_parse(fd))
            if remove_stale:
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(name, dir_fd=dfd)
        finally:
            os.close(fd)
    return live, stale


def _parse(fd: int) -> DaemonShare:
    """An entry's share; ``ValueError`` saying what is wrong with it."""
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        raise ValueError("not a regular file")
    data = os.read(fd, MAX_ENTRY_BYTES + 1)
    if len(data) > MAX_ENTRY_BYTES:
        raise ValueError(f"over {MAX_ENTRY_BYTES} bytes")
    try:
        return DaemonShare.from_json(json.loads(data))
    except RecursionError:
        raise ValueError("nested too deeply") from None


def _parse_live(fd: int, path: Path) -> DaemonShare:
    """A locked entry's share. One that cannot be read is a live process this gatewayd
    does not understand: refusing is the only safe answer."""
    try:
        return _parse(fd)
    except ValueError as exc:
        raise DaemonRegistryError(
            f"the host's registry of gatewayd daemons holds {path}, locked by a live "
            f"process, that this gatewayd cannot read ({exc}); it cannot tell whether that "
            f"process would clash with this one, so it does not start: `fuser -v {path}` "
            "names the process; end it (or give it its own host)"
        ) from None
