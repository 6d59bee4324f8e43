"""The chain recipe: how entries are sealed one after another, and how a line is read.

:class:`Chain` is the sans-IO writer side: it holds the last sequence number and hash,
and turns ``(kind, fields)`` into the next sealed line. :func:`read_line` is the reader
side: it splits a line, recomputes the hash over the exact bytes, compares in constant
time and decodes the entry. :func:`follows` is the link check between two entries. The
reader's side lives in :mod:`gatewayd.audit.sealed` (the readers import that alone,
without the writer's msgspec and scrubber), and is named here too.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from typing import Any, Final

from gatewayd.audit.entry import EntryKind, build_body, format_time
from gatewayd.audit.entryform import MAX_DEGRADED_CHARS
from gatewayd.audit.events import AuditEvent
from gatewayd.audit.line import seal
from gatewayd.audit.sealed import (
    GENESIS,
    ChainPosition,
    LineDefect,
    LineError,
    SealedEntry,
    follows,
    read_line,
)
from gatewayd.protocol import MAX_ID_CHARS
from gatewayd.secrets import Scrubber

__all__ = [
    "GENESIS",
    "NO_SECRETS",
    "WITHHELD_REASON",
    "Chain",
    "ChainPosition",
    "LineDefect",
    "LineError",
    "SealedEntry",
    "follows",
    "read_line",
]

NO_SECRETS: Final = Scrubber()
# What an entry says when a secret could not be scrubbed out of its fields.
WITHHELD_REASON: Final = (
    "this entry's fields held a configured secret that could not be scrubbed field by "
    "field, so they are withheld"
)
# Free-text fields with a length limit in the schema: a scrubbed value is cut to fit.
_BOUNDED_TEXT: Final = {
    "runId": MAX_ID_CHARS,
    "toolCallId": MAX_ID_CHARS,
    "tool": MAX_ID_CHARS,
    "degraded": MAX_DEGRADED_CHARS,
}


class Chain:
    """Seals entries in order, each one naming the hash of the one before.

    Sans-IO: it returns the line to write and never writes it. ``clock`` returns
    nanoseconds since the epoch (``time.time_ns`` unless a test fixes it).

    Secrets: the last line of defence. Every encoded body is checked for the values of
    ``scrubber``'s secrets (a substring test per form, ~0.1 µs); a body that holds one is
    rebuilt from its fields with every string scrubbed, so the hash is taken over the
    scrubbed bytes and ``gatewayd audit verify`` passes. Should a secret survive that
    (it spans JSON syntax, or a scrubbed id no longer fits), the entry is written with
    its fields withheld instead: never with the secret, never not at all.
    """

    def __init__(
        self,
        after: ChainPosition = GENESIS,
        clock: Callable[[], int] = time.time_ns,
        scrubber: Scrubber = NO_SECRETS,
    ) -> None:
        self._seq = after.seq
        self._hash = after.hash
        self._hash_before = after.hash  # the hash before the last append's
        self._clock = clock
        self._scrubber = scrubber
        # The time up to the second of the last entry, as format_time writes it: the
        # entries of one second share it, and only their microseconds are formatted.
        self._second = -1
        self._second_text = ""

    @property
    def position(self) -> ChainPosition:
        return ChainPosition(self._seq, self._hash)

    @property
    def seq(self) -> int:
        """The last entry's seq (0 when empty): :attr:`position`'s, without making one."""
        return self._seq

    @property
    def position_before_last(self) -> ChainPosition:
        """Where the chain was before its last append (kept so that a caller need not
        ask for :attr:`position` before every append in case it has to rewind)."""
        return ChainPosition(self._seq - 1, self._hash_before)

    def rewind(self, position: ChainPosition) -> None:
        """Go back to ``position``, forgetting the entries sealed after it.

        Only for lines that were never handed to anyone: the writer seals an entry,
        finds it would overflow the active segment, and seals a ``segment_open`` event
        in its place first. ``position`` must be an earlier position of this chain.
        """
        if position.seq > self._seq:
            raise ValueError(f"cannot rewind from seq {self._seq} forward to {position.seq}")
        self._seq = position.seq
        self._hash = self._hash_before = position.hash

    def append(
        self, kind: str, fields: Mapping[str, Any], *, checked: bool = True
    ) -> tuple[int, str, bytes]:
        """Seal the next entry; returns ``(seq, hash, line)``. ``checked=False``: fields
        gatewayd built itself from typed values (see ``build_body``).

        Raises ValueError for a bad field (see ``build_body``); the chain is then unchanged.
        """
        seq = self._seq + 1
        micros = self._clock() // 1000
        second = micros // 1_000_000
        if second != self._second:
            self._second, self._second_text = second, format_time(second * 1_000_000_000)[:-7]
        # format_time's form ("...:SS.ffffffZ"), the microseconds padded to six digits.
        when = self._second_text + str(micros % 1_000_000 + 1_000_000)[1:] + "Z"
        body = build_body(seq, when, kind, fields, self._hash, checked=checked)
        if self._scrubber.found_in(body):
            body = self._scrubbed_body(seq, when, kind, fields)
        line, digest = seal(body)
        self._seq = seq
        self._hash_before = self._hash
        self._hash = digest
        return seq, digest, line

    def _scrubbed_body(self, seq: int, when: str, kind: str, fields: Mapping[str, Any]) -> bytes:
        scrubbed: dict[str, Any] = self._scrubber.value(dict(fields))
        for name, limit in _BOUNDED_TEXT.items():
            value = scrubbed.get(name)
            if isinstance(value, str) and len(value) > limit:
                scrubbed[name] = value[:limit]  # a replacement longer than the secret
        try:
            body = build_body(seq, when, kind, scrubbed, self._hash)
        except ValueError:
            body = None
        if body is None or self._scrubber.found_in(body):
            withheld: dict[str, Any] = {"detail": {"withheld": WITHHELD_REASON}}
            if kind == EntryKind.EVENT:
                withheld["event"] = AuditEvent.ENTRY_WITHHELD
            body = build_body(seq, when, kind, withheld, self._hash)
        return body
