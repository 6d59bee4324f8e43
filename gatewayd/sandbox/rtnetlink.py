"""The few route-netlink requests a fresh network namespace needs: bring ``lo`` up, then
list its interfaces and addresses, over a socket of the calling thread's namespace.

The messages are pyroute2's (``ifinfmsg``, ``ifaddrmsg``, parsed by its ``MarshalRtnl``):
the maintained encoder and parser of the kernel's format. The socket is ours, a plain
``NETLINK_ROUTE`` socket: pyroute2's ``IPRoute`` runs each request through an asyncio
event loop of its own (about 2 ms of CPU per namespace, four times the kernel's work
here), and its ``netns=`` argument forks the process to open a socket elsewhere, which
is what :mod:`gatewayd.sandbox.netns` avoids. A socket belongs to the namespace of the
thread that opens it, so the caller opens it inside the namespace it asks about.

Blocking. Error handling: the kernel's refusals are raised as pyroute2's
``NetlinkError`` (``.code``: the errno); socket failures as ``OSError``; an answer that
does not come within :data:`ANSWER_TIMEOUT_S` as ``TimeoutError``.
"""

from __future__ import annotations

import socket
from typing import Any, Final

# The kernel answers a request on a fresh namespace at once; a wait this long means it
# will not, and the namespace's creation fails instead of hanging a run's start.
ANSWER_TIMEOUT_S: Final = 5.0
# One read takes a whole answer of a namespace holding only lo (about 2 KiB); the kernel
# never sends a single message larger than a page, and 64 KiB holds many.
RECV_BYTES: Final = 64 * 1024
_IFF_UP: Final = 0x1  # <linux/if.h>


class RouteSocket:
    """A ``NETLINK_ROUTE`` socket of the calling thread's network namespace.

    Use as a context manager; one request at a time (each waits for its whole answer).
    """

    def __init__(self) -> None:
        from pyroute2.netlink.rtnl.marshal import MarshalRtnl

        self._sock = socket.socket(
            socket.AF_NETLINK, socket.SOCK_RAW | socket.SOCK_CLOEXEC, socket.NETLINK_ROUTE
        )
        try:
            self._sock.settimeout(ANSWER_TIMEOUT_S)
            self._sock.bind((0, 0))  # the kernel picks our port id
        except BaseException:
            self._sock.close()
            raise
        self._marshal = MarshalRtnl()
        self._seq = 0

    def __enter__(self) -> RouteSocket:
        return self

    def __exit__(self, *exc: object) -> None:
        self._sock.close()

    def links(self) -> tuple[Any, ...]:
        """Every interface (``RTM_GETLINK`` dump): pyroute2 ``ifinfmsg`` messages."""
        from pyroute2.netlink import NLM_F_DUMP, NLM_F_REQUEST
        from pyroute2.netlink.rtnl import RTM_GETLINK
        from pyroute2.netlink.rtnl.ifinfmsg import ifinfmsg

        return self._request(ifinfmsg(), RTM_GETLINK, NLM_F_REQUEST | NLM_F_DUMP)

    def addresses(self) -> tuple[Any, ...]:
        """Every address (``RTM_GETADDR`` dump): pyroute2 ``ifaddrmsg`` messages."""
        from pyroute2.netlink import NLM_F_DUMP, NLM_F_REQUEST
        from pyroute2.netlink.rtnl import RTM_GETADDR
        from pyroute2.netlink.rtnl.ifaddrmsg import ifaddrmsg

        return self._request(ifaddrmsg(), RTM_GETADDR, NLM_F_REQUEST | NLM_F_DUMP)

    def set_up(self, index: int) -> None:
        """Bring the interface ``index`` up (``RTM_NEWLINK``, acknowledged)."""
        from pyroute2.netlink import NLM_F_ACK, NLM_F_REQUEST
        from pyroute2.netlink.rtnl import RTM_NEWLINK
        from pyroute2.netlink.rtnl.ifinfmsg import ifinfmsg

        msg = ifinfmsg()
        msg["index"] = index
        msg["flags"] = _IFF_UP
        msg["change"] = _IFF_UP  # only this flag changes
        self._request(msg, RTM_NEWLINK, NLM_F_REQUEST | NLM_F_ACK)

    def _request(self, msg: Any, msg_type: int, flags: int) -> tuple[Any, ...]:
        """Send ``msg``; return the answer's messages once the kernel ends it (a dump's
        ``NLMSG_DONE``, an acknowledgement's ``NLMSG_ERROR`` of 0)."""
        from pyroute2.netlink import NLMSG_DONE, NLMSG_ERROR

        self._seq += 1
        header = msg["header"]
        header["type"] = msg_type
        header["flags"] = flags
        header["sequence_number"] = self._seq
        msg.encode()
        self._sock.send(msg.data)
        answer: list[Any] = []
        while True:
            for reply in self._marshal.parse(self._sock.recv(RECV_BYTES)):
                reply_header = reply["header"]
                if reply_header["sequence_number"] != self._seq:
                    continue  # not ours (nothing else is asked on this socket)
                error = reply_header.get("error")
                if error is not None:
                    raise error
                if reply_header["type"] in (NLMSG_DONE, NLMSG_ERROR):
                    return tuple(answer)
                answer.append(reply)
