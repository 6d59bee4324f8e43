"""Opening a pull request through the forge's REST API (GitHub's
``POST /repos/{owner}/{repo}/pulls``), for an agent run's pushed branch.

The token goes to ``api_base`` only: as a header that is not carried over a redirect, no
redirect followed, no proxy from the environment. Whatever the forge answers is read
under gatewayd's JSON discipline and quoted, scrubbed of the token, in the error.
"""

from __future__ import annotations

import http.client
import json
import re
import urllib.error
import urllib.request
from typing import Final
from urllib.parse import urlsplit

from gatewayd import strictjson
from gatewayd.agent.repo import LOOPBACK_HOSTS, RepoError, has_control, scrub

# Opening a pull request is one small API request.
PR_TIMEOUT_S: Final = 30.0
# A forge's answer to "open a pull request" is a few KiB; anything bigger is not one.
FORGE_RESPONSE_LIMIT: Final = 1 << 20
# A pull request's URL goes into the run's result, its progress line and the audit log:
# a forge's is well under this; a longer one is not the URL of a pull request.
MAX_PR_URL_CHARS: Final = 2048
# The forge's words quoted in an error: enough to say what it refused.
FORGE_QUOTE_CHARS: Final = 200

_REPOSITORY_RE: Final = re.compile(r"[A-Za-z0-9._-]+/[A-Za-z0-9._-]+")


class _NoRedirect(urllib.request.HTTPRedirectHandler):
    """A redirect becomes an error: the token must go to ``api_base`` and nowhere else."""

    def redirect_request(self, *args: object, **kwargs: object) -> None:
        return None


def _forge_message(raw: bytes, token: str) -> str:
    """The forge's own words: GitHub's ``{"message", "errors": [...]}``, else the text.

    Parsed under gatewayd's JSON discipline (gatewayd/strictjson.py): an answer nested
    deep enough to exhaust a parser, or of any other shape, is quoted, never a failure of
    its own."""
    try:
        doc = strictjson.loads(raw)
    except strictjson.JsonInputError:
        doc = None
    if not isinstance(doc, dict):
        return scrub(_quoted(raw), [token]) or "no message"
    text = _shown(doc.get("message")) or "no message"
    errors = doc.get("errors")
    details = []
    for item in errors if isinstance(errors, list) else []:
        said = item.get("message") or item.get("code") or item if isinstance(item, dict) else item
        details.append(_shown(said))
    if details:
        text += " (" + "; ".join(details) + ")"
    return scrub(text, [token])


def _shown(value: object) -> str:
    """A value of the forge's answer as a short line of text."""
    text = value if isinstance(value, str) else json.dumps(value)
    return " ".join(text.split())[:FORGE_QUOTE_CHARS]


def _quoted(raw: bytes) -> str:
    """The start of an answer that is not the JSON expected, as one line of text."""
    return " ".join(raw[: FORGE_QUOTE_CHARS * 4].decode("utf-8", "replace").split())[
        :FORGE_QUOTE_CHARS
    ]


def _pull_request_url(raw: bytes) -> tuple[str | None, str]:
    """The ``html_url`` of the forge's answer to a new pull request, or None and why not.

    Only an http(s) URL of printable ASCII, at most MAX_PR_URL_CHARS long, is one: it is
    shown to the operator and written to the audit log."""
    try:
        doc = strictjson.loads(raw)
    except strictjson.JsonInputError as exc:
        return None, f"it is not JSON gatewayd accepts ({exc})"
    url = doc.get("html_url") if isinstance(doc, dict) else None
    if not isinstance(url, str):
        return None, "it has no html_url"
    if len(url) > MAX_PR_URL_CHARS:
        return None, f"its html_url is {len(url)} characters long (at most {MAX_PR_URL_CHARS})"
    if not url.isascii() or not url.isprintable() or " " in url:
        return None, "its html_url holds characters a URL cannot"
    if urlsplit(url).scheme not in ("https", "http"):
        return None, "its html_url is not an http(s) URL"
    return url, ""


def open_pull_request(
    api_base: str,
    repository: str,
    *,
    source_branch: str,
    target_branch: str,
    title: str,
    body: str,
    token: str,
    timeout_s: float = PR_TIMEOUT_S,
) -> str:
    """Open a pull request (GitHub REST ``POST /repos/{owner}/{repo}/pulls``); its URL."""
    parts = urlsplit(api_base)
    if parts.scheme not in ("https", "http") or "@" in parts.netloc or not parts.hostname:
        raise RepoError(
            "the forge API base must be an https:// URL without credentials in it, "
            "e.g. https://api.github.com"
        )
    if parts.scheme == "http" and parts.hostname not in LOOPBACK_HOSTS:
        raise RepoError(f"refusing to send the token over plain http to {parts.hostname}")
    if not _REPOSITORY_RE.fullmatch(repository):
        raise RepoError(f"repository {repository!r} is not of the form owner/name")
    if not token or has_control(token):
        raise RepoError("the forge token is empty or contains control characters")
    if not title.strip():
        raise RepoError("the pull request title is empty")
    url = f"{api_base.rstrip('/')}/repos/{repository}/pulls"
    payload = {"title": title, "body": body, "head": source_branch, "base": target_branch}
    request = urllib.request.Request(  # noqa: S310 - scheme checked above: http(s) only
        url,
        data=json.dumps(payload).encode(),
        method="POST",
        headers={
            "Accept": "application/vnd.github+json",
            "Content-Type": "application/json",
            "User-Agent": "cogni-gatewayd",
        },
    )
    request.add_unredirected_header("Authorization", f"Bearer {token}")
    # No proxy from the environment and no redirects: the token goes to api_base only.
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}), _NoRedirect())
    where = f"{repository} at {api_base}"
    try:
        with opener.open(request, timeout=timeout_s) as response:
            raw = response.read(FORGE_RESPONSE_LIMIT)
    except urllib.error.HTTPError as exc:
        detail = _forge_message(_error_body(exc), token)
        raise RepoError(
            f"opening a pull request {source_branch} -> {target_branch} on {where} failed: "
            f"the forge answered {exc.code}: {detail}"
        ) from None
    except http.client.HTTPException as exc:  # an answer that is not HTTP, or cut short
        raise RepoError(
            f"the forge's answer to opening a pull request on {where} could not be read "
            f"({type(exc).__name__}: {scrub(_quoted(str(exc).encode()), [token])}); the "
            "pull request may or may not exist: check the forge, and its API URL"
        ) from None
    except (urllib.error.URLError, OSError) as exc:
        reason = getattr(exc, "reason", exc)
        raise RepoError(
            f"could not reach the forge to open a pull request on {where}: "
            f"{scrub(str(reason), [token])}; check the API URL and the network"
        ) from None
    html_url, why = _pull_request_url(raw)
    if html_url is None:
        raise RepoError(
            f"the forge's answer to opening a pull request on {where} is not a pull "
            f"request: {why}: {scrub(_quoted(raw), [token]) or 'an empty answer'}"
        )
    return html_url


def _error_body(exc: urllib.error.HTTPError) -> bytes:
    """As much of an error answer's body as arrives; the status says enough without it."""
    try:
        return exc.read(FORGE_RESPONSE_LIMIT)
    except (http.client.HTTPException, OSError, ValueError):  # ValueError: a closed body
        return b""
