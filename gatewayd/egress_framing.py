"""The egress proxy's HTTP/1.1 framing, without I/O (gatewayd/egress.py moves the bytes).

The request target of a ``CONNECT`` (``host:port``) or of a plain-HTTP absolute-form
request (``http://host:port/path``) is parsed into a URL for the destination checks;
request and response headers are rewritten for the other side (hop-by-hop and
``Proxy-*`` headers dropped, the body framing re-derived, ``Connection: close``); a
refusal is a complete plain-text answer that closes the connection.
"""

from __future__ import annotations

import http
import re
from collections.abc import Iterable
from typing import Final

import httpx

from gatewayd.policy.network import REFUSED_HEADERS
from gatewayd.protocol import ErrorCode

# Hop-by-hop headers (RFC 9110 7.6.1) are the proxy's own: never forwarded either way.
HOP_BY_HOP_HEADERS: Final = frozenset(
    {
        "connection",
        "keep-alive",
        "proxy-authenticate",
        "proxy-authorization",
        "proxy-connection",
        "te",
        "trailer",
        "transfer-encoding",
        "upgrade",
    }
)
# What gatewayd sets itself on a forwarded request (as for http.fetch: Host and framing
# are re-derived from what was checked), plus Expect: the proxy answers 100-continue.
_DROPPED_REQUEST_HEADERS: Final = REFUSED_HEADERS | HOP_BY_HOP_HEADERS | {"expect"}
# CONNECT's target: host:port, the host a DNS name (ASCII) or a bracketed IPv6 literal.
_AUTHORITY_RE: Final = re.compile(r"(\[[0-9A-Fa-f:.]{2,45}\]|[A-Za-z0-9.-]{1,253}):([0-9]{1,5})")
# The answer to an allowed CONNECT, sent once its entry is durable; the tunnel follows.
CONNECTED: Final = b"HTTP/1.1 200 Connection established\r\n\r\n"


class Refused(Exception):
    """Answer the client with ``status`` and ``reason``; audited with ``code``."""

    def __init__(
        self,
        status: int,
        code: ErrorCode,
        reason: str,
        *,
        headers: tuple[tuple[str, str], ...] = (),
    ) -> None:
        super().__init__(reason)
        self.status = status
        self.code = code
        self.reason = reason
        self.headers = headers


def error_response(
    status: int,
    message: str,
    *,
    head_only: bool = False,
    headers: Iterable[tuple[str, str]] = (),
) -> bytes:
    """A complete ``text/plain`` answer that closes the connection (``message`` + newline)."""
    body = f"cogni egress proxy: {message}\n".encode()
    lines = [
        f"HTTP/1.1 {status} {http.HTTPStatus(status).phrase}",
        "Content-Type: text/plain; charset=utf-8",
        f"Content-Length: {len(body)}",
        "Connection: close",
        *(f"{name}: {value}" for name, value in headers),
    ]
    head = ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1")
    return head if head_only else head + body


def _connection_tokens(headers: Iterable[tuple[str, bytes]]) -> set[str]:
    """Header names a ``Connection`` header marks as hop-by-hop."""
    return {
        token.strip().lower()
        for name, value in headers
        if name == "connection"
        for token in value.decode("latin-1").split(",")
    }


def _named(headers: Iterable[tuple[bytes, bytes]]) -> list[tuple[str, bytes, bytes]]:
    """(lowercase name, name as sent, value): compared by the first, forwarded as sent."""
    return [(name.decode("latin-1").lower(), name, value) for name, value in headers]


def forwarded_request_headers(
    headers: Iterable[tuple[bytes, bytes]], netloc: bytes
) -> list[tuple[bytes, bytes]]:
    """The client's request headers as sent upstream: Host from the checked URL, the
    body framing re-derived (chunked wins over Content-Length, as h11 read it), no
    ``Proxy-*``, hop-by-hop or ``Expect`` header, and ``Connection: close``."""
    items = _named(headers)
    drop = _connection_tokens((lower, value) for lower, _, value in items)
    out: list[tuple[bytes, bytes]] = [(b"Host", netloc)]
    for lower, name, value in items:
        if lower in _DROPPED_REQUEST_HEADERS or lower in drop or lower.startswith("proxy-"):
            continue
        out.append((name, value))
    lengths = [value for lower, _, value in items if lower == "content-length"]
    if any(lower == "transfer-encoding" for lower, _, _ in items):  # h11 took it as chunked
        out.append((b"Transfer-Encoding", b"chunked"))
    elif lengths:  # h11 checked that repeats agree
        out.append((b"Content-Length", lengths[0]))
    out.append((b"Connection", b"close"))
    return out


def forwarded_response_headers(headers: Iterable[tuple[bytes, bytes]]) -> list[tuple[bytes, bytes]]:
    """The origin's response headers as sent to the client: hop-by-hop ones dropped (h11
    re-frames the body; a chunked body's Content-Length, which h11 ignored, goes too),
    ``Connection: close`` added."""
    items = _named(headers)
    drop = _connection_tokens((lower, value) for lower, _, value in items) | HOP_BY_HOP_HEADERS
    if any(lower == "transfer-encoding" for lower, _, _ in items):
        drop.add("content-length")
    out = [(name, value) for lower, name, value in items if lower not in drop]
    out.append((b"Connection", b"close"))
    return out


def parse_connect_target(target: str) -> httpx.URL:
    match = _AUTHORITY_RE.fullmatch(target)
    if match is None:
        raise Refused(
            400,
            ErrorCode.BAD_REQUEST,
            f"CONNECT needs host:port (e.g. CONNECT pypi.org:443), not {target[:200]!r}",
        )
    try:
        return httpx.URL(f"https://{target}/")
    except httpx.InvalidURL as exc:
        raise Refused(
            400, ErrorCode.BAD_REQUEST, f"CONNECT target {target[:200]!r}: {exc}"
        ) from None


def parse_absolute_target(target: str) -> httpx.URL:
    scheme = target.partition("://")[0].lower() if "://" in target else ""
    if scheme == "https":
        raise Refused(
            400,
            ErrorCode.BAD_REQUEST,
            "an https:// URL goes through a CONNECT tunnel: use HTTPS_PROXY, not a plain "
            "request to the proxy",
        )
    if scheme != "http":
        raise Refused(
            400,
            ErrorCode.BAD_REQUEST,
            "this is a forward proxy: send an absolute URL (GET http://host/path HTTP/1.1), "
            f"or CONNECT host:port for https; got the target {target[:200]!r}",
        )
    try:
        url = httpx.URL(target)
    except httpx.InvalidURL as exc:
        raise Refused(400, ErrorCode.BAD_REQUEST, f"not a valid URL: {exc}") from None
    if url.fragment:
        raise Refused(400, ErrorCode.BAD_REQUEST, "a request URL may not carry a #fragment")
    return url
