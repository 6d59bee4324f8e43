"""The head file ``<log>.head``: where the log's durable end was, kept beside the log.

After each flush the writer overwrites one fixed-size ASCII record at offset 0 with
the last durable entry's seq and hash, the byte offset just past it and the number
of lines up to there. Cutting trailing entries off the log then leaves the head
pointing past the end, which both ``open_audit_log`` and ``verify_file`` notice. The
record carries a CRC32 so a damaged head is told apart from a truncated log.

What it does not protect against: someone who can rewrite the log can rewrite the
head too. Anchor the head's hash somewhere they cannot reach (see docs/audit.md).
"""

from __future__ import annotations

import os
import re
import zlib

from gatewayd.audit.line import is_hash_hex
from gatewayd.audit.plainrecord import FrozenRecord

# typing's flag without importing typing: the readers start without it
TYPE_CHECKING = False
if TYPE_CHECKING:
    from pathlib import Path
    from typing import Final

HEAD_SUFFIX: Final = ".head"
_MAGIC: Final = "gatewayd-audit-head v1"
_FORMAT: Final = _MAGIC + " seq={:020d} lines={:020d} end={:020d} hash={} crc32={:08x}\n"
_RE: Final = re.compile(
    re.escape(_MAGIC)
    + r" seq=(\d{20}) lines=(\d{20}) end=(\d{20}) hash=([0-9a-f]{64}) crc32=([0-9a-f]{8})\n"
)


class HeadFormatError(ValueError):
    """The head file exists but does not hold a valid head record."""


class HeadRecord(FrozenRecord):
    """The last durable entry: its ``seq`` and ``hash``, the file offset ``end`` just
    past its newline, and ``lines``, the number of lines up to ``end``. Immutable,
    compared as the four values. (A plain class: the readers start without msgspec,
    and a frozen dataclass costs about 0.7 ms to make.)"""

    __slots__ = ("end", "hash", "lines", "seq")

    seq: int
    hash: str
    end: int
    lines: int

    def __init__(self, seq: int, hash: str, end: int, lines: int) -> None:
        if min(seq, end, lines) < 0 or not is_hash_hex(hash):
            raise ValueError("a head record needs non-negative counts and a 64-hex hash")
        object.__setattr__(self, "seq", seq)
        object.__setattr__(self, "hash", hash)
        object.__setattr__(self, "end", end)
        object.__setattr__(self, "lines", lines)


def head_path(log_path: Path) -> Path:
    """Where the head file of ``log_path`` lives."""
    return log_path.with_name(log_path.name + HEAD_SUFFIX)


def head_file(log_path: str | os.PathLike[str]) -> str:
    """:func:`head_path` as a string, for the readers, whose paths are strings."""
    return os.fspath(log_path) + HEAD_SUFFIX


def _crc(text: str) -> int:
    return zlib.crc32(text.encode("ascii"))


def encode_head(head: HeadRecord) -> bytes:
    """The fixed-size record (same length for every head, so one pwrite replaces it)."""
    unsigned = _FORMAT.format(head.seq, head.lines, head.end, head.hash, 0)
    prefix = unsigned[: unsigned.rindex(" crc32=")]
    return _FORMAT.format(head.seq, head.lines, head.end, head.hash, _crc(prefix)).encode()


HEAD_RECORD_BYTES: Final = len(encode_head(HeadRecord(0, "0" * 64, 0, 0)))


def decode_head(data: bytes) -> HeadRecord:
    """Parse a head record; raises HeadFormatError if it is damaged."""
    try:
        text = data.decode("ascii")
    except UnicodeDecodeError:
        raise HeadFormatError("it is not ASCII") from None
    match = _RE.fullmatch(text)
    if match is None:
        raise HeadFormatError(f"it is not a {HEAD_RECORD_BYTES}-byte '{_MAGIC}' record")
    if _crc(text[: text.rindex(" crc32=")]) != int(match[5], 16):
        raise HeadFormatError("its CRC32 does not match (a damaged write)")
    return HeadRecord(seq=int(match[1]), hash=match[4], end=int(match[3]), lines=int(match[2]))


def read_head(log_path: str | os.PathLike[str]) -> HeadRecord | None:
    """The head record beside ``log_path``, or None when there is no head file.

    Error handling: HeadFormatError when the file exists but is damaged; OSError
    from reading passes through.
    """
    try:
        with open(head_file(log_path), "rb") as file:
            data = file.read()
    except FileNotFoundError:
        return None
    return decode_head(data)
