"""The pinned httpcore network backend of :mod:`gatewayd.dialer`: connections to the
addresses :func:`gatewayd.dialer.resolve_checked` checked for a host, and to no others
(the threat model is the dialer's: DNS rebinding). A module of its own so that resolving
(which the run lifecycle and the daemon do) does not load httpcore, which only
``http.fetch`` and the egress proxy use (gatewayd.libraries).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import httpcore

from gatewayd.policy.network import IpAddress


class PinnedBackend(httpcore.AsyncNetworkBackend):
    """Connects to ``host`` only, and only at the addresses already checked for it
    (:func:`gatewayd.dialer.resolve_checked`): no second DNS lookup can answer
    differently."""

    def __init__(self, host: str, addresses: tuple[IpAddress, ...]) -> None:
        self._host = host
        self._addresses = addresses
        self._inner = httpcore.TrioBackend()

    async def connect_tcp(
        self,
        host: str,
        port: int,
        timeout: float | None = None,
        local_address: str | None = None,
        socket_options: Iterable[Any] | None = None,
    ) -> httpcore.AsyncNetworkStream:
        if host.rstrip(".") != self._host:
            raise httpcore.ConnectError(f"{host} is not the checked host {self._host}")
        last: Exception = httpcore.ConnectError(f"{host} has no address")
        for address in self._addresses:  # in resolver order, like a normal client
            try:
                return await self._inner.connect_tcp(
                    str(address), port, timeout, local_address, socket_options
                )
            except (httpcore.ConnectError, httpcore.ConnectTimeout) as exc:
                last = exc
        raise last

    async def sleep(self, seconds: float) -> None:
        await self._inner.sleep(seconds)
