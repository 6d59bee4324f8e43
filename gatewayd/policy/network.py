"""Where a run may connect: the network decisions ``http.fetch`` and the egress proxy share.

Both ways out of the sandbox, the ``http.fetch`` tool (:mod:`gatewayd.tools.http`) and
the run's egress proxy (:mod:`gatewayd.egress`), ask these functions, so one policy is
enforced one way. Each one is pure: it sees a URL's parts, a method, an address, the
policy's ``network`` section, and returns or raises. Looking a name up and connecting
to the addresses checked here is I/O and lives at the edge (:mod:`gatewayd.dialer`).

Threat model: the agent chooses the URL, and a redirect lets the server choose the next
one, so every hop is checked before a byte is sent: scheme, method, the host against
``network.allow_domains``, the port against ``network.ports``, then every address the
host resolves to against the SSRF guard (private, loopback, link-local, multicast,
reserved, unspecified, cloud metadata), unless ``network.allow_private`` names the host
or the address's network.
"""

from __future__ import annotations

import ipaddress
from collections.abc import Iterable, Sequence
from typing import Final, Protocol

from pydantic import TypeAdapter, ValidationError

from gatewayd.errors import InvalidArguments, PolicyViolation
from gatewayd.policy.model import NetworkSection
from gatewayd.policy.package_managers import package_manager_domains, unknown_package_manager
from gatewayd.policy.review_section import Domain

IpAddress = ipaddress.IPv4Address | ipaddress.IPv6Address
# A refused domain is quoted in a message; the caller wrote it, so it is cut.
MAX_SHOWN_DOMAIN_CHARS: Final = 100

# Cloud instance metadata (AWS/GCP/Azure IPv4, AWS IPv6): a host name in allow_private
# does not unlock these; only a network entry that contains them does.
METADATA_ADDRESSES: Final = frozenset(
    {ipaddress.ip_address("169.254.169.254"), ipaddress.ip_address("fd00:ec2::254")}
)
# Framing and hop-by-hop headers are gatewayd's to set: an agent's Host or
# Content-Length could make the request say something other than what was checked.
REFUSED_HEADERS: Final = frozenset(
    {
        "host",
        "content-length",
        "transfer-encoding",
        "connection",
        "keep-alive",
        "proxy-authorization",
        "proxy-connection",
        "te",
        "trailer",
        "upgrade",
    }
)


class DestinationUrl(Protocol):
    """The parts of a parsed URL the destination check reads (``httpx.URL`` has them);
    ``str()`` of it is the URL as shown in messages."""

    @property
    def scheme(self) -> str: ...

    @property
    def userinfo(self) -> bytes: ...

    @property
    def raw_host(self) -> bytes: ...

    @property
    def port(self) -> int | None: ...


def domain_matches(domain: str, host: str) -> bool:
    """``example.org`` matches itself; ``*.example.org`` matches strict subdomains."""
    if domain.startswith("*."):
        return host.endswith(domain[1:])
    return host == domain


def check_any_host_allowed(net: NetworkSection) -> None:
    """Refuse (PolicyViolation) at once when ``network.allow_domains`` is empty (and no
    ``network.package_managers`` adds a domain)."""
    if not net.reachable_domains:
        raise PolicyViolation(
            "this run may reach no host: the policy's network.allow_domains is empty"
        )


def check_request_body(size: int, net: NetworkSection) -> None:
    """Refuse (PolicyViolation) a request body over ``network.max_request_bytes``."""
    if size > net.max_request_bytes:
        raise PolicyViolation(
            f"request body is {size} bytes; network.max_request_bytes allows "
            f"{net.max_request_bytes}"
        )


def check_method(method: str, net: NetworkSection) -> None:
    """Refuse (PolicyViolation) a method ``network.methods`` does not list."""
    if method not in net.methods:
        raise PolicyViolation(
            f"method {method} is not allowed; allowed: {', '.join(net.methods)} (network.methods)"
        )


def url_host(url: DestinationUrl) -> str:
    """The host of ``url`` as the allowlist is written: ASCII (IDNA form), no final dot."""
    return url.raw_host.decode("ascii").rstrip(".")


def check_host(host: str, net: NetworkSection) -> None:
    """Refuse (PolicyViolation) a host ``network.allow_domains`` (with the domains of
    ``network.package_managers``) does not match."""
    reachable = net.reachable_domains
    if not any(domain_matches(domain, host) for domain in reachable):
        allowed = ", ".join(reachable) or "none (network.allow_domains is empty)"
        managers = (
            f", package managers: {', '.join(net.package_managers)}" if net.package_managers else ""
        )
        raise PolicyViolation(
            f"host {host!r} is not allowed; allowed domains: {allowed} "
            f"(network.allow_domains{managers}; '*.x' means subdomains of x)"
        )


def check_destination(url: DestinationUrl, net: NetworkSection) -> tuple[str, int]:
    """The host (ASCII, IDNA form) and port of ``url`` once its scheme, host and port are
    ones the policy allows; else PolicyViolation (InvalidArguments for a URL with user
    info or no host). A URL without a port means 443 for https, 80 for http."""
    if url.scheme not in net.schemes:
        raise PolicyViolation(
            f"scheme {url.scheme!r} is not allowed; allowed: {', '.join(net.schemes)} "
            "(network.schemes)"
        )
    if url.userinfo:
        raise InvalidArguments("a URL may not carry a user name or password; use a header")
    # The ASCII (IDNA) form: what the allowlist is written in and what httpcore connects to.
    host = url_host(url)
    if not host:
        raise InvalidArguments(f"URL {str(url)!r} has no host")
    check_host(host, net)
    port = url.port or (443 if url.scheme == "https" else 80)
    if port not in net.ports:
        allowed = ", ".join(str(p) for p in net.ports) or "none"
        raise PolicyViolation(
            f"port {port} is not allowed; allowed ports: {allowed} (network.ports)"
        )
    return host, port


def refused_reason(address: IpAddress) -> str | None:
    """Why the SSRF guard refuses ``address`` by default, or None for a public address."""
    if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped is not None:
        address = address.ipv4_mapped
    checks = (
        (address in METADATA_ADDRESSES, "a cloud metadata address"),
        (address.is_loopback, "a loopback address"),
        (address.is_link_local, "a link-local address"),
        (address.is_multicast, "a multicast address"),
        (address.is_unspecified, "the unspecified address"),
        (address.is_private, "a private address"),
        (not address.is_global, "a reserved, not globally routable address"),
    )
    return next((reason for hit, reason in checks if hit), None)


def privately_allowed(host: str, address: IpAddress, entries: Iterable[str]) -> bool:
    """Does an ``allow_private`` entry unlock ``address`` for ``host``? A network entry
    that contains the address does; a host name entry does, except for metadata."""
    if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped is not None:
        address = address.ipv4_mapped
    for entry in entries:
        if "/" in entry:  # the policy normalizes networks to "addr/prefix"
            if address in ipaddress.ip_network(entry):
                return True
        elif address not in METADATA_ADDRESSES and domain_matches(entry, host):
            return True
    return False


def guard_addresses(host: str, addresses: tuple[IpAddress, ...], net: NetworkSection) -> None:
    """Refuse (PolicyViolation) if ANY address is one the SSRF guard refuses and the
    policy's ``allow_private`` does not name the host or the address's network."""
    for address in addresses:
        reason = refused_reason(address)
        if reason is not None and not privately_allowed(host, address, net.allow_private):
            raise PolicyViolation(
                f"{host} resolves to {address}, {reason}; gatewayd fetches such addresses "
                "only when the policy's network.allow_private names the host or its network "
                "(metadata addresses: only by network)"
            )


# --- one command's network, narrower than its run's ------------------------------------

# A command names a few hosts; more is a list to copy the policy's from, not a narrowing.
MAX_COMMAND_DOMAINS: Final = 64
_DOMAIN: Final = TypeAdapter(Domain)


def narrowed_network(
    net: NetworkSection,
    *,
    domains: Sequence[str] | None,
    managers: Sequence[str] | None,
) -> NetworkSection | None:
    """The network section of one command that asks for ``domains`` and the package
    manager sets ``managers`` (an exec's ``allowedDomains`` and ``packageManagers``):
    the run's, its allowlist replaced by what the command asked for. None when it asks
    for neither (the command keeps the run's network). An empty result (``[]`` asked)
    is a command with no way out at all.

    A command may only narrow: each domain must be one the run reaches (a host any
    entry matches, or a wildcard an entry lists or lies beneath), each set one the
    policy lists (``network.package_managers``), and a command that asks for any host
    needs the run's proxy on (``network.proxy.enabled``), since it would connect as any
    program of the run does.

    Error handling: InvalidArguments for a malformed domain, an unknown set or too many
    domains; PolicyViolation naming the first thing that would widen the run's network.
    """
    if domains is None and managers is None:
        return None
    domains = tuple(domains or ())
    managers = tuple(managers or ())
    if len(domains) > MAX_COMMAND_DOMAINS:
        raise InvalidArguments(
            f"allowedDomains names {len(domains)} domains; at most {MAX_COMMAND_DOMAINS}"
        )
    reachable = net.reachable_domains
    allowed = ", ".join(reachable) or "none (network.allow_domains is empty)"
    for domain in domains:
        try:
            _DOMAIN.validate_python(domain)
        except ValidationError:
            raise InvalidArguments(
                f"allowedDomains: {domain[:MAX_SHOWN_DOMAIN_CHARS]!r} is not a domain; give "
                "a lowercase host name ('example.org') or a subdomain wildcard "
                "('*.example.org')"
            ) from None
        if not any(domain == entry or domain_matches(entry, domain) for entry in reachable):
            raise PolicyViolation(
                f"allowedDomains: {domain!r} is not among the domains this run may reach, "
                f"and a command may only narrow them; it may reach: {allowed} "
                "(network.allow_domains, network.package_managers)"
            )
    for name in managers:
        unknown = unknown_package_manager(name)
        if unknown is not None:
            raise InvalidArguments(f"packageManagers: {unknown}")
        if name not in net.package_managers:
            granted = ", ".join(net.package_managers) or "none"
            raise PolicyViolation(
                f"packageManagers: {name!r} is not allowed for this run, and a command may "
                f"only narrow its network; allowed: {granted} (network.package_managers)"
            )
    wanted = (*domains, *package_manager_domains(managers))
    wanted = tuple(dict.fromkeys(wanted))
    if wanted and not net.proxy.enabled:
        raise PolicyViolation(
            "this run's policy lets no program in its sandbox connect out "
            "(network.proxy.enabled is false), so no command may ask for a domain; "
            "http.fetch reaches the run's allowed domains"
        )
    return net.model_copy(update={"allow_domains": wanted, "package_managers": ()})
