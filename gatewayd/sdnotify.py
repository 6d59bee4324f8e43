"""systemd's service notification protocol (sd_notify(3)) without libsystemd: one
datagram of ``KEY=value`` lines to the socket named by ``$NOTIFY_SOCKET``.

``gatewayd serve`` says ``READY=1`` once its control socket accepts connections (the
unit is ``Type=notify``: systemd starts dependent units only then) and ``STOPPING=1``
when a stop begins. Started by anything but systemd, there is no ``$NOTIFY_SOCKET`` and
every call is a no-op.
"""

from __future__ import annotations

import os
import socket
from collections.abc import Mapping

import structlog

log = structlog.get_logger("gatewayd.sdnotify")

NOTIFY_SOCKET_ENV = "NOTIFY_SOCKET"


def notify(state: str, environ: Mapping[str, str] | None = None) -> bool:
    """Send ``state`` (e.g. ``"READY=1\\nSTATUS=serving"``) to systemd; True if sent.

    Error handling: never raises. An unusable ``$NOTIFY_SOCKET`` or a failed send is
    logged: the service still runs, and systemd says why it timed out waiting.
    """
    env = os.environ if environ is None else environ
    target = env.get(NOTIFY_SOCKET_ENV, "")
    if not target:
        return False
    if target.startswith("@"):  # an abstract socket name
        address = "\0" + target[1:]
    elif target.startswith("/"):
        address = target
    else:
        log.warning("sd_notify_bad_socket", socket=target, reason="not a path or @name")
        return False
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC) as sock:
            sock.connect(address)
            sock.sendall(state.encode("utf-8"))
    except OSError as exc:
        log.warning("sd_notify_failed", socket=target, error=str(exc))
        return False
    return True
