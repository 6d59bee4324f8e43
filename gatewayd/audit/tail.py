"""Finding where an existing log ends, from a window of its last bytes. Pure: no I/O.

``open_audit_log`` reads only the tail of the file (the log may be large) and asks
these functions where the chain ends and what, if anything, follows it: a *torn*
region left by a crash in the middle of a write (a partial line, or lines that do not
continue the chain), which the writer then terminates and records, never drops.
"""

from __future__ import annotations

from dataclasses import dataclass

from gatewayd.audit.chain import GENESIS, ChainPosition, LineError, SealedEntry, follows, read_line
from gatewayd.audit.head import HeadRecord
from gatewayd.audit.line import hashes_equal


class TailError(ValueError):
    """The tail contradicts the head file: the log was truncated or rewritten."""


@dataclass(frozen=True, slots=True)
class TailWindow:
    """The last bytes of the file: ``data`` starts at file offset ``start``."""

    data: bytes
    start: int

    @property
    def size(self) -> int:
        """The file size (the window always reaches the end of the file)."""
        return self.start + len(self.data)

    def lines_from(self, offset: int) -> list[tuple[int, bytes]]:
        """Complete lines (``(start offset, bytes without newline)``) from ``offset`` on."""
        out: list[tuple[int, bytes]] = []
        pos = offset - self.start
        while True:
            nl = self.data.find(b"\n", pos)
            if nl < 0:
                return out
            out.append((self.start + pos, self.data[pos:nl]))
            pos = nl + 1


@dataclass(frozen=True, slots=True)
class ChainEnd:
    """Where the chain ends: its last entry, the offset just past it, and what follows."""

    position: ChainPosition
    end: int
    walked: int  # entries walked past the anchor
    torn: bytes  # bytes after ``end`` that do not continue the chain (b"" when clean)


def _sealed_or_none(line: bytes) -> SealedEntry | None:
    try:
        return read_line(line)
    except LineError:
        return None


def walk(window: TailWindow, offset: int, position: ChainPosition) -> ChainEnd:
    """Follow the chain from ``position`` (which ends at ``offset``) through the window.

    Stops at the first line that is damaged or does not continue the chain; it and
    everything after it are the torn region.
    """
    end, walked = offset, 0
    for start, line in window.lines_from(offset):
        sealed = _sealed_or_none(line)
        if sealed is None or not follows(position, sealed):
            break
        position, end, walked = sealed.position, start + len(line) + 1, walked + 1
    return ChainEnd(position, end, walked, window.data[end - window.start :])


def anchor_at_head(window: TailWindow, head: HeadRecord) -> ChainPosition:
    """The entry the head file names, checked against the bytes that end at ``head.end``.

    Raises TailError when the log is shorter than the head says, or the entry there
    is not the one the head recorded.
    """
    if head.seq == 0:
        if head.end != 0 or not hashes_equal(head.hash, GENESIS.hash):
            raise TailError("its head file is inconsistent (seq 0 with data)")
        return GENESIS
    if head.end == 0:
        # Just rotated: the last durable entry is the last one of the closed segment,
        # and this file continues the chain from it.
        return ChainPosition(head.seq, head.hash)
    if window.size < head.end:
        raise TailError(
            f"the log is {window.size} bytes, but its head file says entry seq {head.seq} "
            f"was durable up to byte {head.end}: entries were cut off the end"
        )
    last = head.end - 1 - window.start
    if last < 0 or window.data[last : last + 1] != b"\n":
        raise TailError(
            f"no line ends at byte {head.end}, where the head file says seq {head.seq} ends"
        )
    begin = window.data.rfind(b"\n", 0, last) + 1
    if begin == 0 and window.start > 0:
        raise TailError(f"the line ending at byte {head.end} is longer than any entry")
    sealed = _sealed_or_none(window.data[begin:last])
    if sealed is None or sealed.entry.seq != head.seq or not hashes_equal(sealed.hash, head.hash):
        raise TailError(
            f"the entry ending at byte {head.end} is not seq {head.seq} with the hash the "
            "head file recorded: the log was rewritten or truncated and appended to"
        )
    return sealed.position


def last_valid(window: TailWindow) -> tuple[SealedEntry, int] | None:
    """The last line in the window that is a sealed entry, and the offset just past it.

    Used when there is no head file. The first line of a window that does not start
    at the beginning of the file may be partial and is not considered.
    """
    lines = window.lines_from(window.start)
    if window.start > 0:
        lines = lines[1:]
    for start, line in reversed(lines):
        sealed = _sealed_or_none(line)
        if sealed is not None:
            return sealed, start + len(line) + 1
    return None
