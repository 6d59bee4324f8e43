"""Reaching a checked destination: one DNS lookup, its addresses guarded, then connections
to those addresses only. The I/O edge of :mod:`gatewayd.policy.network`, shared by
``http.fetch`` (:mod:`gatewayd.tools.http`) and the egress proxy (:mod:`gatewayd.egress`).

Threat model: a name that resolves to a public address when checked can resolve to a
private one a moment later (DNS rebinding). So a host is looked up once
(:func:`resolve_checked`), every address passes the SSRF guard
(:func:`gatewayd.policy.network.guard_addresses`), and the connection then goes to those
addresses only: a pinned httpcore network backend
(:class:`gatewayd.pinned_backend.PinnedBackend`, httpx's own transport layer, in a module
of its own so that what only resolves does not load httpcore) maps the host to them, so
no second lookup can answer differently, while TLS still sends the name as SNI and
verifies the certificate against it.
"""

from __future__ import annotations

import functools
import ipaddress
import socket
from collections.abc import Awaitable, Callable
from typing import Final

import trio

from gatewayd.errors import ToolFailed
from gatewayd.policy.model import NetworkSection
from gatewayd.policy.network import IpAddress, guard_addresses

# (host, port) -> the addresses it resolves to; injectable so tests can name hosts.
Resolver = Callable[[str, int], Awaitable[tuple[IpAddress, ...]]]

# DNS lookups get threads of their own: a lookup that hangs (a slow name server behind an
# allowlisted wildcard, which a sandbox can aim at with many names at once) holds its
# thread until the C library gives up, and must not hold trio's shared thread pool that
# run set-up, cleanup and the file tools need.
RESOLVER_THREADS: Final = 8
_RESOLVER_LIMITER: Final[trio.lowlevel.RunVar[trio.CapacityLimiter]] = trio.lowlevel.RunVar(
    "gatewayd_resolver_threads"
)


def resolver_threads() -> trio.CapacityLimiter:
    """The DNS lookups' own thread limit, one per trio run."""
    try:
        return _RESOLVER_LIMITER.get()
    except LookupError:
        limiter = trio.CapacityLimiter(RESOLVER_THREADS)
        _RESOLVER_LIMITER.set(limiter)
        return limiter


async def resolve_host(host: str, port: int) -> tuple[IpAddress, ...]:
    """Every address ``host`` resolves to (an IP literal is itself), via the host's resolver.

    Error handling: a name that does not resolve is ToolFailed.
    """
    try:
        return (ipaddress.ip_address(host),)
    except ValueError:
        pass
    try:
        infos = await trio.to_thread.run_sync(
            functools.partial(socket.getaddrinfo, host, port, type=socket.SOCK_STREAM),
            abandon_on_cancel=True,  # the caller's timeout ends the wait, not the thread
            limiter=resolver_threads(),
        )
    except socket.gaierror as exc:
        raise ToolFailed(f"cannot resolve {host!r}: {exc.strerror}") from None
    except UnicodeError:  # the idna codec refuses e.g. a label over 63 characters
        raise ToolFailed(f"cannot resolve {host!r}: not a valid host name") from None
    return tuple(dict.fromkeys(ipaddress.ip_address(info[4][0]) for info in infos))


async def resolve_checked(
    host: str, port: int, net: NetworkSection, resolve: Resolver = resolve_host
) -> tuple[IpAddress, ...]:
    """The addresses of ``host``, looked up once and passed through the SSRF guard: the
    only addresses a connection to ``host`` may then use (see :class:`PinnedBackend`).

    Error handling: ToolFailed for a name that does not resolve (or resolves to nothing),
    PolicyViolation from :func:`gatewayd.policy.network.guard_addresses`.
    """
    addresses = await resolve(host, port)
    if not addresses:
        raise ToolFailed(f"{host!r} resolves to no address")
    guard_addresses(host, addresses, net)
    return addresses
