"""``http.fetch``: one HTTP request made on the host for a sandbox that has no network of
its own (invariant NETWORK_DEFAULT_DENY), within the run's policy ``network`` section.

Threat model: the agent chooses the URL, and a redirect lets the server choose the next
one, so every hop is checked before a byte is sent: scheme, method, the host against
``network.allow_domains``, the port against ``network.ports``, then every address the
host resolves to against the SSRF guard (private, loopback, link-local, multicast,
reserved, unspecified, cloud metadata), unless ``network.allow_private`` names the host
or the address's network. The connection then goes to those checked addresses only: a
pinned httpcore network backend (httpx's own transport layer) maps the URL's host to
them, so no second DNS lookup can answer differently (DNS rebinding), while TLS still
sends the name as SNI and verifies the certificate against it.

The checks (:func:`check_method`, :func:`check_destination`, :func:`resolve_checked`) and
the pinned connector (:class:`PinnedBackend`) are shared with the egress proxy
(:mod:`gatewayd.egress`), so both paths out of the sandbox enforce one policy one way.
"""

from __future__ import annotations

import base64
import functools
import ipaddress
import re
import socket
import ssl
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass
from typing import Annotated, Any, Final

import httpcore
import httpx
import msgspec
import trio

from gatewayd.errors import InvalidArguments, PolicyViolation, ToolFailed
from gatewayd.policy.model import HttpMethod, NetworkSection
from gatewayd.policy.paths import ResolvedPath
from gatewayd.review.structured import domain_matches
from gatewayd.tools.registry import ToolContext, ToolSpec

IpAddress = ipaddress.IPv4Address | ipaddress.IPv6Address
# (host, port) -> the addresses it resolves to; injectable so tests can name hosts.
Resolver = Callable[[str, int], Awaitable[tuple[IpAddress, ...]]]

# Longer than any real URL; a longer one is data smuggled out in a URL.
MAX_URL_CHARS: Final = 8192
# Real clients send a dozen headers; more is abuse of the server or of gatewayd's memory.
MAX_REQUEST_HEADERS: Final = 64
MAX_HEADER_VALUE_CHARS: Final = 8192
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
# Never follow a redirect to another origin: a token meant for one host stays there.
CREDENTIAL_HEADERS: Final = frozenset({"authorization", "cookie"})
# Cloud instance metadata (AWS/GCP/Azure IPv4, AWS IPv6): a host name in allow_private
# does not unlock these; only a network entry that contains them does.
METADATA_ADDRESSES: Final = frozenset(
    {ipaddress.ip_address("169.254.169.254"), ipaddress.ip_address("fd00:ec2::254")}
)
REDIRECT_STATUSES: Final = frozenset({301, 302, 303, 307, 308})
_TOKEN_RE: Final = re.compile(r"[!#$%&'*+.^_`|~0-9A-Za-z-]{1,256}")


class FetchArgs(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """Fetch one URL on the host, within the run's policy network section."""

    url: Annotated[
        str,
        msgspec.Meta(
            min_length=1,
            max_length=MAX_URL_CHARS,
            description="absolute http(s) URL whose host is in network.allow_domains",
        ),
    ]
    method: Annotated[
        HttpMethod, msgspec.Meta(description="HTTP method (default GET); see network.methods")
    ] = "GET"
    headers: Annotated[
        dict[str, str],
        msgspec.Meta(
            max_length=MAX_REQUEST_HEADERS,
            description="request headers; Host, Content-Length and hop-by-hop ones are refused",
        ),
    ] = msgspec.field(default_factory=dict)
    body: Annotated[
        str | None,
        msgspec.Meta(description="request body as UTF-8 text (network.max_request_bytes)"),
    ] = None


@dataclass(frozen=True, slots=True, kw_only=True)
class _Answer:
    """One hop's response: a redirect's body is never read."""

    status: int
    headers: tuple[tuple[str, str], ...]
    body: bytes
    location: str | None


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


def _privately_allowed(host: str, address: IpAddress, entries: Iterable[str]) -> bool:
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
        if reason is not None and not _privately_allowed(host, address, net.allow_private):
            raise PolicyViolation(
                f"{host} resolves to {address}, {reason}; gatewayd fetches such addresses "
                "only when the policy's network.allow_private names the host or its network "
                "(metadata addresses: only by network)"
            )


def check_method(method: str, net: NetworkSection) -> None:
    """Refuse (PolicyViolation) a method ``network.methods`` does not list."""
    if method not in net.methods:
        raise PolicyViolation(
            f"method {method} is not allowed; allowed: {', '.join(net.methods)} (network.methods)"
        )


def check_destination(url: httpx.URL, net: NetworkSection) -> tuple[str, int]:
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
    host = url.raw_host.decode("ascii").rstrip(".")
    if not host:
        raise InvalidArguments(f"URL {str(url)!r} has no host")
    if not any(domain_matches(domain, host) for domain in net.allow_domains):
        allowed = ", ".join(net.allow_domains) or "none (network.allow_domains is empty)"
        raise PolicyViolation(
            f"host {host!r} is not allowed; allowed domains: {allowed} "
            "(network.allow_domains; '*.x' means subdomains of x)"
        )
    port = url.port or (443 if url.scheme == "https" else 80)
    if port not in net.ports:
        allowed = ", ".join(str(p) for p in net.ports) or "none"
        raise PolicyViolation(
            f"port {port} is not allowed; allowed ports: {allowed} (network.ports)"
        )
    return host, port


async def resolve_checked(
    host: str, port: int, net: NetworkSection, resolve: Resolver = resolve_host
) -> tuple[IpAddress, ...]:
    """The addresses of ``host``, looked up once and passed through the SSRF guard: the
    only addresses a connection to ``host`` may then use (see :class:`PinnedBackend`).

    Error handling: ToolFailed for a name that does not resolve (or resolves to nothing),
    PolicyViolation from :func:`guard_addresses`.
    """
    addresses = await resolve(host, port)
    if not addresses:
        raise ToolFailed(f"{host!r} resolves to no address")
    guard_addresses(host, addresses, net)
    return addresses


def _check_headers(headers: dict[str, str]) -> dict[str, str]:
    checked: dict[str, str] = {}
    for name, value in headers.items():
        lower = name.lower()
        if not _TOKEN_RE.fullmatch(name):
            raise InvalidArguments(f"header name {name!r} is not an HTTP token")
        if lower in REFUSED_HEADERS:
            raise InvalidArguments(
                f"header {name!r} is set by gatewayd; refused: {', '.join(sorted(REFUSED_HEADERS))}"
            )
        if len(value) > MAX_HEADER_VALUE_CHARS or any(c in value for c in "\r\n\x00"):
            raise InvalidArguments(
                f"header {name!r}: a value is at most {MAX_HEADER_VALUE_CHARS} characters "
                "without CR, LF or NUL"
            )
        checked[lower] = value
    return checked


class PinnedBackend(httpcore.AsyncNetworkBackend):
    """Connects to ``host`` only, and only at the addresses already checked for it
    (:func:`resolve_checked`): no second DNS lookup can answer differently."""

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


async def _send(
    url: httpx.URL,
    host: str,
    addresses: tuple[IpAddress, ...],
    method: str,
    headers: dict[str, str],
    body: bytes | None,
    net: NetworkSection,
) -> _Answer:
    """One request to the pinned addresses; the body read up to the policy's cap."""
    # The host's CA store; httpcore's default would be certifi's.
    context = ssl.create_default_context() if url.scheme == "https" else None
    backend = PinnedBackend(host, addresses)
    try:
        async with (
            httpcore.AsyncConnectionPool(
                ssl_context=context, network_backend=backend, max_connections=1
            ) as pool,
            pool.stream(method, str(url), headers=list(headers.items()), content=body) as response,
        ):
            answer_headers = tuple(
                (k.decode("latin-1").lower(), v.decode("latin-1")) for k, v in response.headers
            )
            location = next((v for k, v in answer_headers if k == "location"), None)
            if response.status in REDIRECT_STATUSES and location is not None:
                return _Answer(
                    status=response.status, headers=answer_headers, body=b"", location=location
                )
            return _Answer(
                status=response.status,
                headers=answer_headers,
                body=await _read_capped(response, net.max_response_bytes),
                location=None,
            )
    except (
        httpcore.NetworkError,
        httpcore.TimeoutException,
        httpcore.ProtocolError,
        httpcore.UnsupportedProtocol,
        OSError,
    ) as exc:
        raise ToolFailed(f"{method} {url} failed: {type(exc).__name__}: {exc}") from None


async def _read_capped(response: httpcore.Response, cap: int) -> bytes:
    chunks: list[bytes] = []
    total = 0
    async for chunk in response.aiter_stream():
        total += len(chunk)
        if total > cap:
            raise ToolFailed(
                f"response over {cap} bytes (network.max_response_bytes); nothing is returned"
            )
        chunks.append(chunk)
    return b"".join(chunks)


def _value(answer: _Answer, url: httpx.URL, redirects: list[str]) -> dict[str, Any]:
    headers: dict[str, str] = {}
    for name, value in answer.headers:
        headers[name] = f"{headers[name]}, {value}" if name in headers else value
    try:
        body, encoding = answer.body.decode("utf-8"), "utf-8"
    except UnicodeDecodeError:
        body, encoding = base64.b64encode(answer.body).decode("ascii"), "base64"
    return {
        "status": answer.status,
        "headers": headers,
        "body": body,
        "bodyEncoding": encoding,
        "url": str(url),
        "redirects": redirects,
    }


def _parse_url(text: str) -> httpx.URL:
    try:
        url = httpx.URL(text)
    except httpx.InvalidURL as exc:
        raise InvalidArguments(f"not a valid URL: {exc}") from None
    if not url.is_absolute_url:
        raise InvalidArguments(f"URL {text!r} must be absolute: scheme://host/path")
    return url


async def fetch(
    args: FetchArgs, net: NetworkSection, resolve: Resolver = resolve_host
) -> dict[str, Any]:
    """Make the request, following up to ``net.max_redirects`` redirects, each re-checked.

    Error handling: PolicyViolation for what the policy forbids (scheme, method, host,
    port, address, body size), InvalidArguments for malformed URLs or headers, ToolFailed
    for network errors, an oversize response, too many redirects or ``net.timeout_s``
    passing.
    """
    if not net.allow_domains:
        raise PolicyViolation(
            "this run may reach no host: the policy's network.allow_domains is empty"
        )
    headers = _check_headers(args.headers)
    body = None if args.body is None else args.body.encode("utf-8")
    if body is not None and len(body) > net.max_request_bytes:
        raise PolicyViolation(
            f"request body is {len(body)} bytes; network.max_request_bytes allows "
            f"{net.max_request_bytes}"
        )
    url = _parse_url(args.url)
    method: str = args.method
    redirects: list[str] = []
    with trio.move_on_after(net.timeout_s):
        while True:
            check_method(method, net)
            host, port = check_destination(url, net)
            addresses = await resolve_checked(host, port, net, resolve)
            answer = await _send(url, host, addresses, method, headers, body, net)
            if answer.location is None:
                return _value(answer, url, redirects)
            if len(redirects) >= net.max_redirects:
                raise ToolFailed(
                    f"more than {net.max_redirects} redirects (network.max_redirects); "
                    f"the last pointed to {answer.location!r}"
                )
            try:
                target = url.join(answer.location)
            except httpx.InvalidURL:
                raise ToolFailed(f"redirected to an invalid URL {answer.location!r}") from None
            if answer.status in (301, 302, 303) and method != "HEAD":
                method, body = "GET", None  # what browsers do; 307 and 308 keep both
            if (target.scheme, target.host, target.port) != (url.scheme, url.host, url.port):
                headers = {k: v for k, v in headers.items() if k not in CREDENTIAL_HEADERS}
            redirects.append(str(target))
            url = target
    raise ToolFailed(
        f"no complete answer within {net.timeout_s:g} s (network.timeout_s); "
        f"redirects followed: {len(redirects)}"
    )


async def run_fetch(
    args: FetchArgs, ctx: ToolContext, _resolved: tuple[ResolvedPath, ...]
) -> dict[str, Any]:
    """``{"status", "headers", "body", "bodyEncoding", "url", "redirects"}``: header names
    lowercase (repeats joined with ", "), the body as text when UTF-8 else base64, the
    final URL and every redirect followed."""
    if ctx.network is None:
        raise PolicyViolation("this run has no network section in its policy; no host allowed")
    return await fetch(args, ctx.network, ctx.resolve or resolve_host)


HTTP_FETCH: ToolSpec[FetchArgs] = ToolSpec(
    name="http.fetch",
    summary="Fetch a URL on the host (the sandbox has no network): allowed domains, schemes "
    "and methods only, private addresses refused, redirects re-checked, bodies capped.",
    args_type=FetchArgs,
    run=run_fetch,
)
