"""Hash-line primitives: hash a body, seal it into a line, split a line back apart.

These know nothing about what an entry holds. A *body* is the compact JSON object of
an entry without its hash (``{...,"prev":"<hex>"}``); its hash is ``sha256(body)``;
the *line* is the body with ``,"hash":"<hex>"`` spliced in before the closing brace,
plus a newline. Because the hash is taken over the exact bytes written, there is no
canonicalization step that verify has to reproduce: slicing the fixed-length suffix
off gives the hashed bytes back.

Every check is an explicit ``if``/``raise`` (``python -O`` strips ``assert``) and
digests are compared in constant time.
"""

from __future__ import annotations

import hashlib
import hmac

from gatewayd.audit.jsonform import JsonFormError, loads

# typing's flag without importing typing: the readers start without it
TYPE_CHECKING = False
if TYPE_CHECKING:
    from typing import Any, Final

# One line must fit the tail reader's window and the verifier's line buffer, and one
# call must not be able to bloat the log (the readers, which import this module and not
# the entry's schema, read a line at most this long).
MAX_LINE_BYTES: Final = 64 * 1024
HASH_HEX_CHARS: Final = 64
# The ``prev`` of the first entry: there is nothing before it.
GENESIS_HASH: Final = "0" * HASH_HEX_CHARS

_SUFFIX_HEAD: Final = b',"hash":"'
_SUFFIX_TAIL: Final = b'"}'
# ,"hash":"<64 hex>"}  — fixed length, so the hashed body is recovered by slicing.
HASH_SUFFIX_BYTES: Final = len(_SUFFIX_HEAD) + HASH_HEX_CHARS + len(_SUFFIX_TAIL)
_HEX: Final = frozenset(b"0123456789abcdef")
_HEX_CHARS: Final = frozenset("0123456789abcdef")


def parse_object(content: bytes) -> dict[str, Any] | None:
    """A line's JSON object, for the readers that show or filter the log (verify checks
    lines its own way), or None when it is none: not UTF-8, not JSON (as msgspec, the
    writer's codec, reads it: :mod:`gatewayd.audit.jsonform`), nested too deep to
    decode, or not an object. Never raises: a damaged or hostile log is shown as
    damaged."""
    try:
        value = loads(content)
    except JsonFormError:
        return None
    return value if isinstance(value, dict) else None


class LineFormatError(ValueError):
    """A line is not ``<body>`` + ``,"hash":"<64 lowercase hex>"}``."""


def body_hash(body: bytes) -> str:
    """The entry hash of ``body``: sha256 as 64 lowercase hex characters."""
    return hashlib.sha256(body).hexdigest()


def is_hash_hex(text: str) -> bool:
    """Whether ``text`` is 64 lowercase hex characters (the form every hash takes here)."""
    return len(text) == HASH_HEX_CHARS and _HEX_CHARS.issuperset(text)


def hashes_equal(a: str, b: str) -> bool:
    """Constant-time comparison of two hex digests."""
    return hmac.compare_digest(a.encode("ascii", "replace"), b.encode("ascii", "replace"))


def seal(body: bytes) -> tuple[bytes, str]:
    """The line to write for ``body`` (newline included) and the body's hash."""
    if len(body) < 2 or body[:1] != b"{" or body[-1:] != b"}":
        raise ValueError("an entry body must be a compact JSON object")
    digest = body_hash(body)
    return b"".join((body[:-1], _SUFFIX_HEAD, digest.encode("ascii"), _SUFFIX_TAIL, b"\n")), digest


def unseal(line: bytes) -> tuple[bytes, str]:
    """Split a line (without its newline) into the hashed body and the hash it claims.

    The claimed hash is not checked against the body here; that is the recipe's job.
    Raises :class:`LineFormatError` when the line does not have the sealed shape.
    """
    if len(line) < HASH_SUFFIX_BYTES + 2 or line[:1] != b"{":
        raise LineFormatError("it does not start with '{' or is too short to hold a hash")
    suffix = line[-HASH_SUFFIX_BYTES:]
    if not suffix.startswith(_SUFFIX_HEAD) or not suffix.endswith(_SUFFIX_TAIL):
        raise LineFormatError('it does not end with ,"hash":"<64 hex>"}')
    digest = suffix[len(_SUFFIX_HEAD) : len(_SUFFIX_HEAD) + HASH_HEX_CHARS]
    if not _HEX.issuperset(digest):
        raise LineFormatError("its hash is not 64 lowercase hex characters")
    return line[:-HASH_SUFFIX_BYTES] + b"}", digest.decode("ascii")
