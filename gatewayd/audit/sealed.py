"""The reader's side of the chain: a sealed line checked and read back
(:func:`read_line`), and the link between two entries (:func:`follows`).

Why its own module: the recipe's writer side (:class:`gatewayd.audit.chain.Chain`)
builds entries with msgspec and scrubs them of secrets, and the readers (`gatewayd audit
verify`, the writer's own look at the log's tail when it opens) need neither: this
module reads lines with the standard library (:mod:`gatewayd.audit.entryform`), so
`gatewayd audit verify` starts without msgspec, typing or the secrets' scrubber.
``chain`` names everything here too.
"""

from __future__ import annotations

import enum

from gatewayd.audit.entryform import Entry, EntryFormatError, decode_body
from gatewayd.audit.line import GENESIS_HASH, LineFormatError, body_hash, hashes_equal, unseal
from gatewayd.audit.plainrecord import FrozenRecord

# typing's flag without importing typing: the readers start without it
TYPE_CHECKING = False
if TYPE_CHECKING:
    from typing import Final


class ChainPosition(FrozenRecord):
    """The last entry of a chain: its seq and hash (seq 0 and GENESIS_HASH when empty).
    Compared and hashed as the pair it is. (A plain class: a NamedTuple or a dataclass
    costs a reader's start ten times as much to make.)"""

    __slots__ = ("hash", "seq")

    seq: int
    hash: str

    def __init__(self, seq: int, hash: str) -> None:
        object.__setattr__(self, "seq", seq)
        object.__setattr__(self, "hash", hash)


GENESIS: Final = ChainPosition(0, GENESIS_HASH)


class SealedEntry:
    """An entry read from a line whose hash matched its bytes."""

    __slots__ = ("entry", "hash")

    def __init__(self, entry: Entry, hash: str) -> None:
        self.entry = entry
        self.hash = hash

    @property
    def position(self) -> ChainPosition:
        return ChainPosition(self.entry.seq, self.hash)

    def __repr__(self) -> str:
        return f"SealedEntry({self.entry!r}, {self.hash!r})"


class LineDefect(enum.StrEnum):
    BROKEN = "broken"  # not a sealed entry at all (torn, edited JSON, wrong shape)
    TAMPERED = "tampered"  # well formed, but the bytes no longer match the hash


class LineError(ValueError):
    """A line that cannot be trusted; ``defect`` says how, ``str()`` says why."""

    def __init__(self, defect: LineDefect, reason: str) -> None:
        super().__init__(reason)
        self.defect = defect


def read_line(line: bytes) -> SealedEntry:
    """Check one line (without its newline) and return its entry and hash.

    Raises :class:`LineError`: BROKEN when the line is not a sealed entry gatewayd
    could have written, TAMPERED when its bytes do not match its hash.
    """
    try:
        body, claimed = unseal(line)
    except LineFormatError as exc:
        raise LineError(LineDefect.BROKEN, str(exc)) from None
    if not hashes_equal(body_hash(body), claimed):
        raise LineError(LineDefect.TAMPERED, "its content does not match its hash")
    try:
        entry = decode_body(body)
    except EntryFormatError as exc:
        raise LineError(LineDefect.BROKEN, str(exc)) from None
    return SealedEntry(entry, claimed)


def follows(after: ChainPosition, sealed: SealedEntry) -> bool:
    """Whether ``sealed`` is the entry right after ``after`` (next seq, prev matches)."""
    return sealed.entry.seq == after.seq + 1 and hashes_equal(sealed.entry.prev, after.hash)
