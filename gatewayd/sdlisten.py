"""systemd's socket activation (sd_listen_fds(3)) without libsystemd: the listening
sockets systemd passes to the service it starts.

systemd opens the sockets of ``gatewayd.socket`` itself and passes them to gatewayd as
descriptors 3, 4, ... (``SD_LISTEN_FDS_START``), saying so in ``$LISTEN_FDS`` (how many),
``$LISTEN_PID`` (for which process: a variable inherited by a child is not the child's)
and ``$LISTEN_FDNAMES`` (their ``FileDescriptorName=``, colon-separated). gatewayd takes
the one named ``control`` as its control socket (:func:`passed_control_socket`): the path
then outlives every restart of the service, and a client connecting meanwhile waits in
the socket's backlog instead of finding no socket.

Hand-written, like :mod:`gatewayd.sdnotify`: the protocol is three variables, and the
maintained bindings (python-systemd) need libsystemd's headers to build.
"""

from __future__ import annotations

import fcntl
import os
import socket
import stat
from collections.abc import MutableMapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Final

import structlog

log = structlog.get_logger("gatewayd.sdlisten")

# The first passed descriptor: 0-2 are stdin, stdout and stderr.
SD_LISTEN_FDS_START: Final = 3
LISTEN_FDS_ENV: Final = "LISTEN_FDS"
LISTEN_PID_ENV: Final = "LISTEN_PID"
LISTEN_FDNAMES_ENV: Final = "LISTEN_FDNAMES"
# gatewayd.socket's FileDescriptorName=.
CONTROL_FD_NAME: Final = "control"
# systemd's name for a descriptor without FileDescriptorName= (or without LISTEN_FDNAMES).
UNKNOWN_FD_NAME: Final = "unknown"
# More than this is no unit of ours: gatewayd.socket passes one. It bounds what a
# mistaken environment makes gatewayd look at (each is fstat'd and marked close-on-exec).
MAX_LISTEN_FDS: Final = 64


class PassedSocketError(Exception):
    """systemd's socket activation variables or the passed socket are not what gatewayd
    can serve on; the message says which and what to change."""


@dataclass(frozen=True, slots=True)
class PassedFd:
    """One descriptor systemd passed: its number and its ``FileDescriptorName=``."""

    fd: int
    name: str


def listen_fds(
    environ: MutableMapping[str, str] | None = None, *, pid: int | None = None
) -> tuple[PassedFd, ...]:
    """The descriptors systemd passed to this process (``pid``, default this one), each
    marked close-on-exec so no sandbox or child inherits it; () when none were passed.

    The three variables are removed from ``environ`` (default ``os.environ``) either
    way, as sd_listen_fds(3) does: a child gatewayd starts must never take them for its
    own. ``$LISTEN_PID`` naming another process (the variables were inherited) means
    nothing was passed to this one: logged and ignored.

    Error handling: PassedSocketError when ``$LISTEN_FDS`` or ``$LISTEN_PID`` is not a
    number, the count is out of range, or a counted descriptor is not open.
    """
    env = os.environ if environ is None else environ
    count_text = env.pop(LISTEN_FDS_ENV, None)
    pid_text = env.pop(LISTEN_PID_ENV, None)
    names_text = env.pop(LISTEN_FDNAMES_ENV, None)
    if count_text is None:
        return ()
    me = os.getpid() if pid is None else pid
    if pid_text is None or not _is_number(pid_text):
        raise PassedSocketError(
            f"${LISTEN_FDS_ENV} is set but ${LISTEN_PID_ENV} is {pid_text!r}, not a process "
            "id: the environment was not made by systemd's socket activation; unset both"
        )
    if int(pid_text) != me:
        log.warning("listen_fds_not_ours", listen_pid=int(pid_text), pid=me)
        return ()
    if not _is_number(count_text) or not 1 <= int(count_text) <= MAX_LISTEN_FDS:
        raise PassedSocketError(
            f"${LISTEN_FDS_ENV} is {count_text!r}: expected a count from 1 to "
            f"{MAX_LISTEN_FDS} (the unit passes one socket, gatewayd.socket's)"
        )
    count = int(count_text)
    names = names_text.split(":") if names_text else []
    if len(names) != count:
        names = [UNKNOWN_FD_NAME] * count  # as sd_listen_fds_with_names: unnamed
    passed = []
    for offset, name in enumerate(names):
        fd = SD_LISTEN_FDS_START + offset
        try:
            flags = fcntl.fcntl(fd, fcntl.F_GETFD)
            fcntl.fcntl(fd, fcntl.F_SETFD, flags | fcntl.FD_CLOEXEC)
        except OSError as exc:
            raise PassedSocketError(
                f"${LISTEN_FDS_ENV} counts descriptor {fd} ({name}) but it is not open "
                f"({exc.strerror}): the environment does not describe this process"
            ) from exc
        passed.append(PassedFd(fd, name))
    return tuple(passed)


def _is_number(text: str) -> bool:
    """Whether ``text`` is a decimal number int() reads: str.isdigit() alone also takes
    digits such as "\u00b9", on which int() raises."""
    return text.isascii() and text.isdigit()


def passed_control_socket(passed: Sequence[PassedFd], path: Path) -> socket.socket | None:
    """The listening control socket among ``passed``: the one named ``control``, or the
    only one when it is unnamed; checked to be a listening unix stream socket bound at
    ``path`` (the control socket gatewayd is configured with). None when nothing was
    passed: gatewayd binds ``path`` itself.

    Error handling: PassedSocketError naming the descriptor and what it is instead: not
    a socket, not AF_UNIX, not SOCK_STREAM, not listening, bound elsewhere; or several
    passed and none named ``control``. The descriptor is left open (systemd's).
    """
    if not passed:
        return None
    chosen = [one for one in passed if one.name == CONTROL_FD_NAME]
    if not chosen and len(passed) == 1 and passed[0].name == UNKNOWN_FD_NAME:
        chosen = list(passed)
    if len(chosen) != 1:
        raise PassedSocketError(
            f"systemd passed {len(passed)} descriptors named "
            f"{', '.join(one.name for one in passed)}; gatewayd serves exactly one named "
            f"{CONTROL_FD_NAME!r} (FileDescriptorName={CONTROL_FD_NAME} in gatewayd.socket)"
        )
    one = chosen[0]
    what = f"the passed descriptor {one.fd} ({one.name})"
    mode = os.fstat(one.fd).st_mode
    if not stat.S_ISSOCK(mode):
        raise PassedSocketError(
            f"{what} is not a socket: gatewayd.socket must say ListenStream=, not "
            "ListenFIFO= or a file"
        )
    sock = socket.socket(fileno=os.dup(one.fd))
    try:
        problem = _problem(sock, path)
    except BaseException:
        sock.close()
        raise
    if problem is not None:
        sock.close()
        raise PassedSocketError(f"{what} {problem}")
    sock.set_inheritable(False)
    return sock


def _problem(sock: socket.socket, path: Path) -> str | None:
    if sock.family != socket.AF_UNIX:
        return (
            f"is a {sock.family.name} socket, not AF_UNIX: the control socket is a unix "
            "socket path (ListenStream=/var/lib/gatewayd/control.sock)"
        )
    if sock.type != socket.SOCK_STREAM:
        return f"is a {sock.type.name} socket, not SOCK_STREAM (ListenStream=, not ListenDatagram=)"
    if not sock.getsockopt(socket.SOL_SOCKET, socket.SO_ACCEPTCONN):
        return "is not listening (a connected socket, not one from ListenStream=)"
    bound = sock.getsockname()
    if not isinstance(bound, str) or not bound.startswith("/"):
        return (
            f"is bound to {bound!r}, not a path: the control socket is a file clients find "
            f"at {path}"
        )
    if os.path.realpath(bound) != os.path.realpath(path):
        return (
            f"is bound at {bound}, but gatewayd's control socket is {path}: make "
            "gatewayd.socket's ListenStream= and the configuration's control_socket name "
            "the same path"
        )
    return None
