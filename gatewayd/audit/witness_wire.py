"""The wire format of C2SP tlog-witness, without I/O: the ``add-checkpoint`` request
body (the witness parses it, gatewayd's witness client writes it) and the "409
Conflict" answer that carries the witness's size.

::

    old <size>
    <base64 consistency proof hash>     (zero to 63 lines)
    <empty line>
    <the signed checkpoint note>

Anything that is not this shape is the client's fault: :class:`BadRequest` (HTTP 400)
with a message saying which line is wrong. It sits in the audit package so both the
witness (``gatewayd.witness``, above) and the client (``gatewayd.audit.witnessing``)
use one definition.
"""

from __future__ import annotations

import base64
import binascii
import re
from dataclasses import dataclass
from typing import Final

from gatewayd.audit.merkle import HASH_SIZE

# The spec: "The client MUST NOT send more than 63 consistency proof lines."
MAX_PROOF_LINES: Final = 63
# 16 signatures (the spec's minimum a verifier must accept) of up to ~5 kB each (a
# post-quantum one), a checkpoint and 63 proof lines fit; a bigger body is a flood.
MAX_REQUEST_BYTES: Final = 128 * 1024
# "old" and a decimal without leading zeros ("0" for none); 19 digits bound it below 2^63.
_OLD_LINE: Final = re.compile(r"old (0|[1-9][0-9]{0,18})")


class BadRequest(ValueError):
    """The body is not an add-checkpoint request (HTTP 400); the message says why."""


@dataclass(frozen=True, slots=True, kw_only=True)
class AddCheckpoint:
    """A parsed request: the size the client believes the witness is at, the proof
    from it, and the checkpoint note as sent (signatures not yet checked)."""

    old_size: int
    proof: tuple[bytes, ...]
    note: str


def parse_add_checkpoint(body: bytes) -> AddCheckpoint:
    """Parse an add-checkpoint request body.

    Error handling: BadRequest naming the line that is wrong.
    """
    if len(body) > MAX_REQUEST_BYTES:
        raise BadRequest(f"the request is {len(body)} bytes, over {MAX_REQUEST_BYTES}")
    try:
        text = body.decode()
    except UnicodeDecodeError:
        raise BadRequest("the request is not UTF-8") from None
    header, blank, note = text.partition("\n\n")
    if not blank:
        raise BadRequest(
            "the request is 'old N', the proof lines, an empty line, then the checkpoint; "
            "no empty line was found"
        )
    lines = header.split("\n")
    match = _OLD_LINE.fullmatch(lines[0])
    if match is None:
        raise BadRequest(
            f"the first line must be 'old N' (N in decimal, no leading zeros), not "
            f"{lines[0][:40]!r}"
        )
    hashes = lines[1:]
    if len(hashes) > MAX_PROOF_LINES:
        raise BadRequest(f"{len(hashes)} consistency proof lines, over {MAX_PROOF_LINES}")
    proof = []
    for number, line in enumerate(hashes, 2):
        try:
            value = base64.b64decode(line, validate=True)
        except binascii.Error:
            value = b""
        if len(value) != HASH_SIZE:
            raise BadRequest(f"line {number} is not a base64 {HASH_SIZE}-byte proof hash")
        proof.append(value)
    return AddCheckpoint(old_size=int(match[1]), proof=tuple(proof), note=note)


def format_add_checkpoint(old_size: int, proof: list[bytes], note: str) -> bytes:
    """The request body a client sends (the inverse of :func:`parse_add_checkpoint`)."""
    lines = [f"old {old_size}", *(base64.b64encode(one).decode() for one in proof)]
    return ("\n".join(lines) + "\n\n" + note).encode()


# The media type of a 409 answer's body: the witness's latest cosigned size.
SIZE_CONTENT_TYPE: Final = "text/x.tlog.size"
# The size line of a 409 answer: a decimal and a newline (bounded like "old N").
_SIZE_BODY: Final = re.compile(r"(0|[1-9][0-9]{0,18})\n")


def format_size(size: int) -> bytes:
    """A 409 answer's body: ``size`` in decimal and a newline."""
    return f"{size}\n".encode()


def parse_size(body: bytes) -> int:
    """The size in a 409 answer's body.

    Error handling: ValueError when the body is not one decimal line.
    """
    match = _SIZE_BODY.fullmatch(body.decode(errors="replace"))
    if match is None:
        raise ValueError(f"a 409 answer's body is a size and a newline, not {body[:40]!r}")
    return int(match[1])
