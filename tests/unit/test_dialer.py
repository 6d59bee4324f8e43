"""The lookup edge of the network decisions: a host is looked up once and every address
it resolves to passes the SSRF guard before anything may connect."""

from __future__ import annotations

import ipaddress

import pytest
import trio

from gatewayd.dialer import resolve_checked
from gatewayd.errors import PolicyViolation, ToolFailed
from gatewayd.policy.model import NetworkSection
from gatewayd.policy.network import IpAddress

NET = NetworkSection.model_validate({"allow_domains": ["example.org", "*.example.org"]})


def ip(text: str) -> IpAddress:
    return ipaddress.ip_address(text)


async def test_resolve_checked_looks_up_once_and_guards_every_address() -> None:
    lookups: list[tuple[str, int]] = []

    async def resolve(host: str, port: int) -> tuple[IpAddress, ...]:
        lookups.append((host, port))
        await trio.lowlevel.checkpoint()
        return {"example.org": (ip("93.184.216.34"),), "inside.example.org": (ip("10.0.0.9"),)}[
            host
        ]

    assert await resolve_checked("example.org", 443, NET, resolve) == (ip("93.184.216.34"),)
    with pytest.raises(PolicyViolation) as caught:
        await resolve_checked("inside.example.org", 443, NET, resolve)
    assert str(caught.value).startswith("inside.example.org resolves to 10.0.0.9, a private")
    assert lookups == [("example.org", 443), ("inside.example.org", 443)]


async def test_a_name_that_resolves_to_nothing_is_tool_failed() -> None:
    async def resolve(_host: str, _port: int) -> tuple[IpAddress, ...]:
        await trio.lowlevel.checkpoint()
        return ()

    with pytest.raises(ToolFailed) as caught:
        await resolve_checked("example.org", 443, NET, resolve)
    assert str(caught.value) == "'example.org' resolves to no address"
