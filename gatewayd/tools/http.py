"""``http.fetch``: one HTTP request made on the host for a sandbox that has no network of
its own (invariant NETWORK_DEFAULT_DENY), within the run's policy ``network`` section.

The destination checks (scheme, method, host, port, the SSRF guard) are
:mod:`gatewayd.policy.network`'s and the lookup and pinned connection
:mod:`gatewayd.dialer`'s, both shared with the egress proxy (:mod:`gatewayd.egress`), so
both paths out of the sandbox enforce one policy one way. What is this tool's own: the
argument schema, the request headers an agent may set, following redirects (each hop
checked again, credentials dropped when it leaves the origin) and the capped answer.

httpx (the URL parser) and httpcore (the connection) are imported where they are used: a
daemon whose runs can reach this tool loads them first, off its event loop
(:mod:`gatewayd.libraries`), and one whose runs cannot never pays for them.
"""

from __future__ import annotations

import base64
import re
import ssl
from dataclasses import dataclass
from typing import TYPE_CHECKING, Annotated, Any, Final

import msgspec
import trio

from gatewayd.dialer import Resolver, resolve_checked, resolve_host
from gatewayd.errors import InvalidArguments, PolicyViolation, ToolFailed
from gatewayd.policy.capabilities import ANY, NO_REQUEST, Capabilities, CapabilityRequest
from gatewayd.policy.model import HttpMethod, NetworkSection
from gatewayd.policy.network import (
    REFUSED_HEADERS,
    IpAddress,
    check_any_host_allowed,
    check_destination,
    check_method,
    check_request_body,
    url_host,
)
from gatewayd.tools.builtin import builtin_tool
from gatewayd.tools.registry import Tool, ToolContext

if TYPE_CHECKING:
    import httpcore
    import httpx

# Longer than any real URL; a longer one is data smuggled out in a URL.
MAX_URL_CHARS: Final = 8192
# Real clients send a dozen headers; more is abuse of the server or of gatewayd's memory.
MAX_REQUEST_HEADERS: Final = 64
MAX_HEADER_VALUE_CHARS: Final = 8192
# Never follow a redirect to another origin: a token meant for one host stays there.
CREDENTIAL_HEADERS: Final = frozenset({"authorization", "cookie"})
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
    import httpcore

    from gatewayd.pinned_backend import PinnedBackend

    # The host's CA store; httpcore's default would be certifi's. Read in a worker
    # thread: loading the store takes tens of milliseconds the event loop cannot spare.
    context = (
        await trio.to_thread.run_sync(ssl.create_default_context) if url.scheme == "https" else None
    )
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
    import httpx

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
    import httpx

    check_any_host_allowed(net)
    headers = _check_headers(args.headers)
    body = None if args.body is None else args.body.encode("utf-8")
    if body is not None:
        check_request_body(len(body), net)
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


def fetch_request(args: FetchArgs) -> CapabilityRequest:
    """A fetch asks for its URL's host, which the policy step checks against the run's
    ``network`` section. A URL that does not parse, or has no host, asks for nothing:
    the runner refuses it as ``invalid_args`` (and checks every hop again, redirects
    included, before a byte is sent)."""
    import httpx

    try:
        url = httpx.URL(args.url)
    except httpx.InvalidURL:
        return NO_REQUEST
    host = url_host(url) if url.is_absolute_url else ""
    return CapabilityRequest(domains=(host,)) if host else NO_REQUEST


async def run_fetch(args: FetchArgs, ctx: ToolContext) -> dict[str, Any]:
    """``{"status", "headers", "body", "bodyEncoding", "url", "redirects"}``: header names
    lowercase (repeats joined with ", "), the body as text when UTF-8 else base64, the
    final URL and every redirect followed."""
    if ctx.network is None:
        raise PolicyViolation("this run has no network section in its policy; no host allowed")
    return await fetch(args, ctx.network, ctx.resolve or resolve_host)


HTTP_FETCH: Tool[FetchArgs] = builtin_tool(
    name="http.fetch",
    summary="Fetch a URL on the host (the sandbox has no network): allowed domains, schemes "
    "and methods only, private addresses refused, redirects re-checked, bodies capped.",
    args_type=FetchArgs,
    run=run_fetch,
    requests=fetch_request,
    capabilities=Capabilities(network=(ANY,)),
)
