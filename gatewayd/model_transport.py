"""How gatewayd's model calls reach a provider: litellm, imported and configured once,
and the capped HTTP transport every reply is read through (:mod:`gatewayd.model_client`
makes the call and reads its answer).

litellm takes seconds to import, so it is imported lazily, never when gatewayd is
imported: :func:`~gatewayd.model_client.preload` pays for it once at daemon start (run
it in a thread), and :func:`~gatewayd.model_client.complete` imports it on first use
otherwise. Before the import, the environment is set so litellm never fetches anything
at import or call time and never reads a ``.env`` file; after it, every logging callback
is cleared so nothing but the call itself leaves the host.

Replies are bounded: every byte litellm reads from a provider passes
:class:`CappedTransport`, installed in litellm at import for both of its HTTP paths (the
OpenAI SDK's client, ``litellm.client_session``, and its own handler's transport,
``litellm.sync_transport``). It counts the reply while it is read, after decoding (a
gzip body is inflated a bounded piece at a time), and stops reading and closes the
connection once the alias's ``max_reply_bytes`` is passed: the call fails as
``too_large``, having held no more than the cap. Model calls go to the alias's endpoint
directly: gatewayd's ``HTTP(S)_PROXY`` is not used, so the key goes nowhere else.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import importlib
import logging
import os
import threading
import zlib
from collections.abc import Iterator
from typing import Any, Final

import httpx

from gatewayd.config import DEFAULT_MAX_REPLY_BYTES

# A compressed reply is inflated at most this much at a time, so a small body that
# inflates hugely (a gzip bomb) is counted against the cap before it can fill memory.
INFLATE_PIECE_BYTES: Final = 64 << 10
# The one content coding gatewayd asks providers for: zlib inflates it in bounded
# pieces. A reply in a coding gatewayd cannot bound that way (br, zstd) is refused.
ACCEPT_ENCODING: Final = "gzip"
# Codings zlib inflates (its automatic header detection takes gzip and zlib streams).
_INFLATED_CODINGS: Final = frozenset({"gzip", "x-gzip", "deflate"})

# Set before litellm is imported; each stops a fetch or a file read we did not ask for.
_LITELLM_ENV: Final = {
    "LITELLM_LOCAL_MODEL_COST_MAP": "True",  # the price map from GitHub, at import
    "LITELLM_LOCAL_ANTHROPIC_BETA_HEADERS": "True",  # a header map from GitHub, per call
    "LITELLM_LOCAL_BLOG_POSTS": "True",  # an RSS feed (proxy UI; set for completeness)
    "LITELLM_MODE": "PRODUCTION",  # DEV (the default) loads a .env found above its install
}
# litellm's loggers print request headers and prompts at DEBUG; a daemon-wide DEBUG
# level must not turn that on.
_LITELLM_LOGGERS: Final = ("LiteLLM", "LiteLLM Router", "LiteLLM Proxy")
# What litellm 1.x imports lazily on its first OpenAI-style call (~0.8 s, measured with
# litellm 1.106): imported by preload() too, so the first review does not pay for it.
_FIRST_CALL_MODULES: Final = (
    "openai.resources",
    "httpcore",
    "litellm.proxy.openai_files_endpoints.common_utils",
)
_LITELLM_CALLBACK_LISTS: Final = (
    "callbacks",
    "input_callback",
    "success_callback",
    "failure_callback",
    "service_callback",
)


# --- the reply cap -------------------------------------------------------------------

# The cap of the call running in this thread: complete() sets it around litellm's call,
# which reads the reply in the same thread. Outside a call the default holds.
_REPLY_CAP: Final = contextvars.ContextVar(
    "gatewayd_model_reply_cap", default=DEFAULT_MAX_REPLY_BYTES
)


class ReplyTooLarge(Exception):
    """A provider's reply passed ``cap`` bytes while it was read; reading stopped there."""

    def __init__(self, cap: int) -> None:
        super().__init__(f"the provider's reply is over {cap} bytes")
        self.cap = cap


class CappedTransport(httpx.BaseTransport):
    """An httpx transport whose replies are read at most up to the current call's cap.

    It asks for ``gzip`` only, inflates a compressed reply itself in bounded pieces (the
    reply then reaches httpx decoded, without Content-Encoding), counts both the bytes on
    the wire and the decoded ones, and raises :class:`ReplyTooLarge` as soon as either
    passes the cap, before a byte more is read; httpx then closes the connection. A reply
    whose Content-Length is over the cap fails before its body is read at all.
    A redirect reaches the client without its ``Location``, so it is never followed.

    Resource handling: the wrapped transport (its connection pool) is shared by every
    client litellm builds on it and lives as long as the process; :meth:`close` leaves
    it open, since litellm closes the clients it evicts from its cache.

    Error handling: :class:`ReplyTooLarge` past the cap; :class:`httpx.DecodingError`
    for a coding gatewayd did not ask for, stacked codings, or a corrupt gzip body.
    """

    def __init__(self, inner: httpx.BaseTransport) -> None:
        self._inner = inner

    def handle_request(self, request: httpx.Request) -> httpx.Response:
        request.headers["Accept-Encoding"] = ACCEPT_ENCODING
        cap = _REPLY_CAP.get()
        response = self._inner.handle_request(request)
        try:
            inflate = _inflater(response.headers.get_list("content-encoding", split_commas=True))
            headers = response.headers
            dropped: set[str] = set()
            if response.is_redirect:
                # Never followed: a redirect would carry the request, and a key in a header
                # httpx does not strip across origins (x-api-key), to wherever it points.
                # Without its Location the reply is an error status like any other.
                dropped.add("location")
            if inflate is not None:
                dropped |= {"content-encoding", "content-length"}
            elif _declared_length(headers) > cap:
                raise ReplyTooLarge(cap)
            if dropped:
                headers = httpx.Headers(
                    [(k, v) for k, v in headers.multi_items() if k.lower() not in dropped]
                )
        except BaseException:
            response.close()
            raise
        return httpx.Response(
            response.status_code,
            headers=headers,
            stream=_CappedStream(response, inflate, cap),
            extensions=response.extensions,
        )

    def close(self) -> None:
        pass  # the shared pool outlives any one client (see the class docstring)


class _CappedStream(httpx.SyncByteStream):
    """The body of ``inner`` (the wrapped transport's response), counted and inflated."""

    def __init__(self, inner: httpx.Response, inflate: _Inflater | None, cap: int) -> None:
        self._inner = inner
        self._inflate = inflate  # None: an identity body
        self._cap = cap

    def __iter__(self) -> Iterator[bytes]:
        wire = decoded = 0
        for chunk in self._inner.iter_raw():
            wire += len(chunk)
            if wire > self._cap:
                raise ReplyTooLarge(self._cap)
            for piece in self._inflate.feed(chunk) if self._inflate else (chunk,):
                decoded += len(piece)
                if decoded > self._cap:
                    raise ReplyTooLarge(self._cap)
                yield piece

    def close(self) -> None:
        self._inner.close()


def _inflater(codings: list[str]) -> _Inflater | None:
    """The inflater for the reply's content coding; None for an identity body."""
    codings = [c.strip().lower() for c in codings if c.strip().lower() not in ("", "identity")]
    if not codings:
        return None
    if len(codings) > 1:
        raise httpx.DecodingError(
            f"the reply has stacked content codings ({', '.join(codings)}); "
            f"gatewayd asks for {ACCEPT_ENCODING} alone"
        )
    if codings[0] not in _INFLATED_CODINGS:
        raise httpx.DecodingError(
            f"the reply is in content coding {codings[0][:40]!r}, which gatewayd did not "
            f"ask for (it asks for {ACCEPT_ENCODING})"
        )
    return _Inflater()


class _Inflater:
    """A gzip (or zlib) body, inflated INFLATE_PIECE_BYTES at most at a time."""

    def __init__(self) -> None:
        self._zlib = zlib.decompressobj(zlib.MAX_WBITS | 32)  # | 32: gzip or zlib header

    def feed(self, data: bytes) -> Iterator[bytes]:
        """What ``data`` inflates to, in pieces; the rest of it waits in zlib's tail."""
        while True:
            try:
                piece = self._zlib.decompress(data, INFLATE_PIECE_BYTES)
            except zlib.error as exc:
                raise httpx.DecodingError(f"the reply's gzip body is corrupt ({exc})") from None
            if piece:
                yield piece
            data = self._zlib.unconsumed_tail
            if not data and len(piece) < INFLATE_PIECE_BYTES:
                return


def _declared_length(headers: httpx.Headers) -> int:
    """The Content-Length, 0 when absent or unreadable (the count while reading holds)."""
    try:
        return int(headers.get("content-length", "0"))
    except ValueError:
        return 0


# --- litellm, imported once ----------------------------------------------------------


class LazyLiteLLM:
    """litellm, imported and configured once, on first use, by whichever thread asks."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._module: Any = None

    @property
    def loaded(self) -> Any:
        """The module once imported, else None (no lock, no thread hop: the hot path)."""
        return self._module

    def get(self) -> Any:
        with self._lock:
            if self._module is None:
                self._module = _import_litellm()
            return self._module


def _import_litellm() -> Any:
    os.environ.update(_LITELLM_ENV)
    litellm: Any = importlib.import_module("litellm")
    litellm.telemetry = False  # older releases phone home; newer ones ignore the name
    litellm.suppress_debug_info = True  # no "Give Feedback / Get Help" prints on errors
    litellm.turn_off_message_logging = True  # prompts stay out of any logging payload
    for name in _LITELLM_CALLBACK_LISTS:
        setattr(litellm, name, [])  # no logging integration sends anything anywhere
    for name in _LITELLM_LOGGERS:
        logger = logging.getLogger(name)
        logger.setLevel(logging.WARNING)
        # litellm hangs its own plain-text stderr handler here; gatewayd's log is JSON
        # lines, scrubbed (gatewayd/logs.py): its records go to the root logger instead.
        logger.handlers.clear()
        logger.propagate = True
    for name in _FIRST_CALL_MODULES:
        with contextlib.suppress(ImportError):  # another litellm release: merely slower
            importlib.import_module(name)
    _install_reply_cap(litellm)
    return litellm


def _install_reply_cap(litellm: Any) -> None:
    """Route every HTTP reply litellm reads through one :class:`CappedTransport`.

    The OpenAI SDK's providers (``openai``, Azure, ...) use ``litellm.client_session``;
    litellm's own handler (``anthropic``, ``hosted_vllm``, ``ollama_chat``, ...) builds its
    clients on ``litellm.sync_transport``. TLS is litellm's own choice (its CA bundle and
    HTTP/2 settings), so only the reading changes.
    """
    verify: Any = True
    http2 = False
    with contextlib.suppress(ImportError):  # another litellm release: httpx's defaults
        handler: Any = importlib.import_module("litellm.llms.custom_httpx.http_handler")
        http2 = bool(handler.http2_enabled())
        verify = handler.get_ssl_configuration(http2=http2)
    # One connection pool for every model call: httpx's default of 100 connections is
    # more than the worker threads that can be in a model call at once (trio's default
    # 40 plus the reviewer's MODEL_THREADS), so no call waits for a connection.
    transport = CappedTransport(httpx.HTTPTransport(verify=verify, http2=http2))
    litellm.sync_transport = transport
    # trust_env=False: no proxy from gatewayd's environment (litellm's handler uses none
    # either once given a transport); the key goes to the alias's endpoint only.
    # Redirects are followed as litellm's own client does (httpx drops the
    # Authorization header when one leaves the origin).
    litellm.client_session = httpx.Client(
        transport=transport, follow_redirects=True, trust_env=False
    )


LITELLM: Final = LazyLiteLLM()


def completion_without_success_logging(
    litellm: Any, request: dict[str, Any], max_reply_bytes: int
) -> Any:
    """``litellm.completion(**request)``, minus the success logging it hands to a
    background thread as it returns (cost maps, payload building: about 1 ms of Python
    that holds the GIL just when the trio thread wants it back; bench/model_overhead.py
    measured it as most of the gateway's added latency). gatewayd has no litellm
    callbacks (see _import_litellm), so that logging goes nowhere anyway.

    litellm skips it for its own internal calls, marked by a context variable; trio runs
    this in a copy of the caller's context, so the mark ends with the call. A litellm
    without that variable logs as before: correct, merely slower.

    ``max_reply_bytes`` is the reply cap :class:`CappedTransport` applies to this call
    (litellm reads the reply in this thread).
    """
    cap = _REPLY_CAP.set(max_reply_bytes)
    internal = _internal_call_marker()
    token = internal.set(True) if internal is not None else None
    try:
        return litellm.completion(**request)
    finally:
        if token is not None:
            internal.reset(token)
        _REPLY_CAP.reset(cap)


@functools.cache
def _internal_call_marker() -> Any:
    try:
        module = importlib.import_module("litellm._internal_context")
    except ImportError:
        return None
    return getattr(module, "is_internal_call", None)
