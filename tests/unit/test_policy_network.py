"""Network decisions shared by http.fetch and the egress proxy: schemes, methods, hosts,
ports, request bodies and the SSRF guard, each decided without a socket."""

from __future__ import annotations

import ipaddress
from typing import Any

import httpx
import pytest

from gatewayd.errors import GatewayError, InvalidArguments, PolicyViolation
from gatewayd.policy.model import NetworkSection
from gatewayd.policy.network import (
    METADATA_ADDRESSES,
    IpAddress,
    check_any_host_allowed,
    check_destination,
    check_method,
    check_request_body,
    domain_matches,
    guard_addresses,
    privately_allowed,
    refused_reason,
)


def network(**fields: Any) -> NetworkSection:
    return NetworkSection.model_validate(fields)


NET = network(allow_domains=["example.org", "*.corp.example"], schemes=["http", "https"])


def ip(text: str) -> IpAddress:
    return ipaddress.ip_address(text)


# --- domains -----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("domain", "host", "matches"),
    [
        ("example.org", "example.org", True),
        ("example.org", "www.example.org", False),
        ("example.org", "badexample.org", False),
        ("*.example.org", "www.example.org", True),
        ("*.example.org", "a.b.example.org", True),
        ("*.example.org", "example.org", False),  # strict subdomains, as a TLS wildcard
        ("*.example.org", "badexample.org", False),
        ("*.example.org", "example.org.evil.net", False),
    ],
)
def test_a_domain_matches_itself_and_a_wildcard_strict_subdomains(
    domain: str, host: str, matches: bool
) -> None:
    assert domain_matches(domain, host) is matches


# --- destinations --------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("url", "host", "port"),
    [
        ("https://example.org/x", "example.org", 443),
        ("http://example.org/x", "example.org", 80),
        ("https://EXAMPLE.org./", "example.org", 443),  # case and a trailing dot
        ("https://api.corp.example/v1", "api.corp.example", 443),
        ("https://bücher.corp.example/", "xn--bcher-kva.corp.example", 443),  # IDNA form
    ],
)
def test_an_allowed_destination_gives_its_ascii_host_and_port(
    url: str, host: str, port: int
) -> None:
    assert check_destination(httpx.URL(url), NET) == (host, port)


@pytest.mark.parametrize(
    ("net", "url", "error", "message"),
    [
        (
            network(allow_domains=["example.org"]),
            "http://example.org/",
            PolicyViolation,
            "scheme 'http' is not allowed; allowed: https (network.schemes)",
        ),
        (
            NET,
            "https://user:pw@example.org/",
            InvalidArguments,
            "a URL may not carry a user name or password; use a header",
        ),
        (
            # The scheme is decided first: user info in a refused scheme is a policy denial.
            network(allow_domains=["example.org"]),
            "http://user:pw@example.org/",
            PolicyViolation,
            "scheme 'http' is not allowed; allowed: https (network.schemes)",
        ),
        (
            NET,
            "https://evil.net/",
            PolicyViolation,
            "host 'evil.net' is not allowed; allowed domains: example.org, *.corp.example "
            "(network.allow_domains; '*.x' means subdomains of x)",
        ),
        (
            NET,
            "https://corp.example/",
            PolicyViolation,
            "host 'corp.example' is not allowed; allowed domains: example.org, *.corp.example "
            "(network.allow_domains; '*.x' means subdomains of x)",
        ),
        (
            network(),
            "https://example.org/",
            PolicyViolation,
            "host 'example.org' is not allowed; allowed domains: none "
            "(network.allow_domains is empty) (network.allow_domains; '*.x' means subdomains of x)",
        ),
        (
            NET,
            "https://example.org:8443/",
            PolicyViolation,
            "port 8443 is not allowed; allowed ports: 80, 443 (network.ports)",
        ),
        (
            network(allow_domains=["example.org"], ports=[8443]),
            "https://example.org/",
            PolicyViolation,
            "port 443 is not allowed; allowed ports: 8443 (network.ports)",
        ),
    ],
)
def test_a_refused_destination_says_what_is_allowed(
    net: NetworkSection, url: str, error: type[GatewayError], message: str
) -> None:
    with pytest.raises(error) as caught:
        check_destination(httpx.URL(url), net)
    assert type(caught.value) is error
    assert str(caught.value) == message


def test_a_url_without_a_host_is_invalid_arguments() -> None:
    url = httpx.URL("https:///path")
    with pytest.raises(InvalidArguments, match="has no host"):
        check_destination(url, NET)


def test_the_port_given_explicitly_is_checked_not_the_schemes_default() -> None:
    net = network(allow_domains=["example.org"], ports=[443, 8443])
    assert check_destination(httpx.URL("https://example.org:8443/"), net) == ("example.org", 8443)


# --- methods, bodies, an empty allowlist ---------------------------------------------------


@pytest.mark.parametrize(
    ("methods", "method", "allowed"),
    [
        (None, "GET", True),
        (None, "HEAD", True),
        (None, "POST", False),
        (["GET", "POST"], "POST", True),
        (["GET", "POST"], "DELETE", False),
        (["GET"], "get", False),  # methods are case-sensitive tokens
        (["GET"], "CONNECT", False),
    ],
)
def test_only_the_policys_methods_are_allowed(
    methods: list[str] | None, method: str, allowed: bool
) -> None:
    net = network() if methods is None else network(methods=methods)
    if allowed:
        check_method(method, net)
        return
    with pytest.raises(PolicyViolation) as caught:
        check_method(method, net)
    assert str(caught.value) == (
        f"method {method} is not allowed; allowed: {', '.join(net.methods)} (network.methods)"
    )


@pytest.mark.parametrize(("size", "allowed"), [(0, True), (100, True), (101, False)])
def test_a_request_body_is_held_to_max_request_bytes(size: int, allowed: bool) -> None:
    net = network(allow_domains=["example.org"], max_request_bytes=100)
    if allowed:
        check_request_body(size, net)
        return
    with pytest.raises(PolicyViolation) as caught:
        check_request_body(size, net)
    assert str(caught.value) == "request body is 101 bytes; network.max_request_bytes allows 100"


def test_an_empty_allowlist_reaches_no_host_and_says_so() -> None:
    check_any_host_allowed(NET)
    with pytest.raises(PolicyViolation) as caught:
        check_any_host_allowed(network())
    assert str(caught.value) == (
        "this run may reach no host: the policy's network.allow_domains is empty"
    )


# --- the SSRF guard ------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("address", "reason"),
    [
        ("93.184.216.34", None),
        ("2606:2800:220:1:248:1893:25c8:1946", None),
        ("169.254.169.254", "a cloud metadata address"),
        ("fd00:ec2::254", "a cloud metadata address"),
        ("127.0.0.1", "a loopback address"),
        ("127.8.9.10", "a loopback address"),
        ("::1", "a loopback address"),
        ("169.254.1.1", "a link-local address"),
        ("fe80::1", "a link-local address"),
        ("224.0.0.1", "a multicast address"),
        ("ff02::1", "a multicast address"),
        ("0.0.0.0", "the unspecified address"),
        ("::", "the unspecified address"),
        ("10.1.2.3", "a private address"),
        ("172.16.0.1", "a private address"),
        ("192.168.1.1", "a private address"),
        ("fd12:3456::1", "a private address"),
        ("100.64.0.1", "a reserved, not globally routable address"),  # carrier-grade NAT
        # An IPv4-mapped IPv6 address is judged as the IPv4 address it carries.
        ("::ffff:127.0.0.1", "a loopback address"),
        ("::ffff:169.254.169.254", "a cloud metadata address"),
        ("::ffff:10.0.0.1", "a private address"),
        ("::ffff:93.184.216.34", None),
    ],
)
def test_the_ssrf_guard_names_why_it_refuses_an_address(address: str, reason: str | None) -> None:
    assert refused_reason(ip(address)) == reason


@pytest.mark.parametrize(
    ("host", "address", "entries", "allowed"),
    [
        ("intranet.corp", "10.0.0.5", ["intranet.corp"], True),
        ("intranet.corp", "10.0.0.5", ["*.corp"], True),
        ("other.corp", "10.0.0.5", ["intranet.corp"], False),
        ("intranet.corp", "10.0.0.5", ["10.0.0.0/8"], True),
        ("intranet.corp", "10.0.0.5", ["192.168.0.0/16"], False),
        ("localhost", "127.0.0.1", ["127.0.0.1/32"], True),
        ("localhost", "::ffff:127.0.0.1", ["127.0.0.0/8"], True),  # mapped, by network
        # A host name never unlocks a metadata address; only a network that contains it.
        ("metadata.corp", "169.254.169.254", ["metadata.corp"], False),
        ("metadata.corp", "169.254.169.254", ["169.254.0.0/16"], True),
        ("any", "10.0.0.5", [], False),
    ],
)
def test_allow_private_unlocks_by_host_name_or_by_network(
    host: str, address: str, entries: list[str], allowed: bool
) -> None:
    assert privately_allowed(host, ip(address), entries) is allowed


def test_every_metadata_address_is_refused_by_default() -> None:
    for address in METADATA_ADDRESSES:
        assert refused_reason(address) == "a cloud metadata address"


def test_one_refused_address_among_public_ones_refuses_the_host() -> None:
    addresses = (ip("93.184.216.34"), ip("10.0.0.1"))
    with pytest.raises(PolicyViolation) as caught:
        guard_addresses("example.org", addresses, NET)
    assert str(caught.value) == (
        "example.org resolves to 10.0.0.1, a private address; gatewayd fetches such "
        "addresses only when the policy's network.allow_private names the host or its "
        "network (metadata addresses: only by network)"
    )


def test_public_addresses_and_privately_allowed_ones_pass_the_guard() -> None:
    guard_addresses("example.org", (ip("93.184.216.34"),), NET)
    net = network(allow_domains=["intranet.corp"], allow_private=["intranet.corp"])
    guard_addresses("intranet.corp", (ip("10.0.0.1"), ip("93.184.216.34")), net)
