"""``gatewayd audit verify``: check the whole chain and say where it first breaks.

Reads the log line by line (it may be large) and checks, for every line: that it is
a sealed entry gatewayd could have written, that its bytes match its hash, that its
seq is one more than the last and that its ``prev`` is the last entry's hash. The
first line that fails is reported with its number and what a reviewer should
conclude; checking stops there, because nothing after a break can be trusted to the
chain. A break followed by a matching ``torn_tail_recovered`` event is the trace of a
crash the daemon recovered from at restart: a warning, not a failure. Finally the
head file, if any, must not claim an entry beyond the end of the log.
"""

from __future__ import annotations

import enum
import hashlib
import re
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO, Final, NamedTuple

from gatewayd.audit.chain import (
    GENESIS,
    ChainPosition,
    LineDefect,
    LineError,
    SealedEntry,
    follows,
    read_line,
)
from gatewayd.audit.entry import MAX_LINE_BYTES, AuditEvent
from gatewayd.audit.head import HeadFormatError, HeadRecord, head_path, read_head
from gatewayd.audit.line import hashes_equal

# A recovered torn region is at most one flush batch; look no further for its event.
_MAX_RECOVERY_SCAN_BYTES: Final = 16 * 1024 * 1024
_SEQ_RE: Final = re.compile(rb'\{"seq":(\d{1,20}),')


class ProblemKind(enum.StrEnum):
    TORN = "torn"  # the last line was cut short (a crash while writing it)
    BROKEN = "broken"  # a line that is not a sealed entry at all
    TAMPERED = "tampered"  # a line whose bytes no longer match its hash
    MISSING = "missing"  # entries absent between two lines (seq gap or prev mismatch)
    REORDERED = "reordered"  # entries out of order
    DUPLICATED = "duplicated"  # a line repeated
    TRUNCATED = "truncated"  # entries cut off the end (the head file says more existed)
    HEAD = "head"  # the head file is damaged
    RECOVERED = "recovered"  # warning: a torn write recovered at restart
    NO_HEAD = "no_head"  # warning: truncation of the tail cannot be detected
    EMPTY = "empty"  # warning: no entries at all


class Problem(NamedTuple):
    """One finding: the 1-based line it is about (0 = the file as a whole)."""

    line: int
    kind: ProblemKind
    message: str


@dataclass(frozen=True, slots=True)
class VerifyReport:
    """The outcome of :func:`verify_file`. ``ok`` is True only without problems."""

    ok: bool
    entries: int  # entries verified (up to the first problem)
    problems: tuple[Problem, ...]
    warnings: tuple[Problem, ...]
    last_seq: int
    last_hash: str

    def render(self) -> str:
        """What ``gatewayd audit verify`` prints."""
        if self.ok:
            lines = [
                f"OK: {self.entries} entries, chain intact, last hash {self.last_hash} "
                f"(seq {self.last_seq})"
            ]
        else:
            lines = [
                f"FAILED: the audit log does not verify; {self.entries} entries were intact "
                "before the first problem"
            ]
            lines += [_render_one("problem", p) for p in self.problems]
        lines += [_render_one("warning", w) for w in self.warnings]
        return "\n".join(lines)


def _render_one(label: str, finding: Problem) -> str:
    where = f"line {finding.line}" if finding.line else "file"
    return f"  {label} ({finding.kind}, {where}): {finding.message}"


@dataclass(frozen=True, slots=True)
class _Line:
    no: int
    start: int
    raw: bytes  # with its newline, if it has one

    @property
    def complete(self) -> bool:
        return self.raw.endswith(b"\n")

    @property
    def content(self) -> bytes:
        return self.raw[:-1] if self.complete else self.raw


class _LineReader:
    """Lines of a binary file with their numbers and offsets; can go back to one."""

    def __init__(self, file: BinaryIO) -> None:
        self._file = file
        self._no = 0
        self._offset = 0

    def next(self) -> _Line | None:
        raw = self._file.readline(MAX_LINE_BYTES + 1)
        if not raw:
            return None
        self._no += 1
        line = _Line(self._no, self._offset, raw)
        self._offset += len(raw)
        return line

    def rewind_to_after(self, line: _Line) -> None:
        self._no = line.no
        self._offset = line.start + len(line.raw)
        self._file.seek(self._offset)

    def __iter__(self) -> Iterator[_Line]:
        while (line := self.next()) is not None:
            yield line


def _seq_of(content: bytes) -> int | None:
    match = _SEQ_RE.match(content)
    return int(match[1]) if match else None


@dataclass(frozen=True, slots=True)
class _Recovery:
    event: SealedEntry | None  # the matching recovery event, or None
    event_line: _Line | None
    mismatch: Problem | None  # an event naming this line whose facts do not match


def _try_recovery(reader: _LineReader, first: _Line, position: ChainPosition) -> _Recovery:
    """Look for the ``torn_tail_recovered`` event that accounts for a break at ``first``.

    The region is every line from ``first`` up to that event; the event must follow
    the last good entry and record the region's line, line count, size and sha256
    (without the region's final newline, which the writer may have added).
    """
    hasher = hashlib.sha256()
    size, count = 0, 0
    line: _Line | None = first
    while line is not None and line.complete and size <= _MAX_RECOVERY_SCAN_BYTES:
        if count:
            sealed = _sealed_or_none(line.content)
            if (
                sealed is not None
                and sealed.entry.event == AuditEvent.TORN_TAIL_RECOVERED
                and follows(position, sealed)
            ):
                detail = sealed.entry.detail or {}
                facts = {"line": first.no, "lines": count, "bytes": size}
                if all(detail.get(k) == v for k, v in facts.items()) and hashes_equal(
                    str(detail.get("sha256", "")), hasher.hexdigest()
                ):
                    return _Recovery(sealed, line, None)
                return _Recovery(
                    None,
                    None,
                    Problem(
                        line.no,
                        ProblemKind.TAMPERED,
                        f"line {line.no} records a torn write recovered at line {first.no}, "
                        "but the bytes there no longer match what it recorded (size or "
                        "sha256): the damaged region was altered after the restart",
                    ),
                )
            hasher.update(b"\n")
            size += 1
        hasher.update(line.content)
        size += len(line.content)
        count += 1
        line = reader.next()
    return _Recovery(None, None, None)


def _sealed_or_none(content: bytes) -> SealedEntry | None:
    try:
        return read_line(content)
    except LineError:
        return None


def _classify(
    reader: _LineReader, line: _Line, previous: _Line | None, position: ChainPosition
) -> Problem:
    """What is wrong at ``line``, the first line that does not continue the chain."""
    n = line.no
    if not line.complete:
        if len(line.raw) > MAX_LINE_BYTES:
            return Problem(
                n,
                ProblemKind.BROKEN,
                f"line {n} is longer than the {MAX_LINE_BYTES}-byte maximum of an entry: "
                "it was not written by gatewayd",
            )
        return Problem(
            n,
            ProblemKind.TORN,
            f"line {n} is torn: the daemon probably crashed while writing it ({len(line.raw)} "
            f"bytes, no newline). The chain up to seq {position.seq} is intact; restarting "
            "gatewayd records the torn bytes and continues the chain",
        )
    try:
        sealed = read_line(line.content)
    except LineError as exc:
        if exc.defect is LineDefect.TAMPERED:
            seq = _seq_of(line.content)
            which = f"line {n}" + (f" (seq {seq})" if seq is not None else "")
            return Problem(
                n,
                ProblemKind.TAMPERED,
                f"{which} was altered after it was written: {exc}",
            )
        return Problem(
            n,
            ProblemKind.BROKEN,
            f"line {n} is not a valid audit entry ({exc}): it was damaged or edited",
        )
    seq, expected = sealed.entry.seq, position.seq + 1
    if seq == expected:
        return Problem(
            n,
            ProblemKind.MISSING,
            f"line {n} (seq {seq}) does not follow the entry before it: its prev is not that "
            "entry's hash, so an entry was removed or replaced there",
        )
    if seq > expected:
        reader.rewind_to_after(line)
        for later in reader:
            if _seq_of(later.content) == expected:
                return Problem(
                    n,
                    ProblemKind.REORDERED,
                    f"line {n} holds seq {seq} where seq {expected} was expected, and seq "
                    f"{expected} is at line {later.no}: entries were moved",
                )
        missing = f"seq {expected}" if seq == expected + 1 else f"seq {expected}..{seq - 1}"
        return Problem(
            n,
            ProblemKind.MISSING,
            f"line {n} holds seq {seq} where seq {expected} was expected: {missing} "
            f"({seq - expected} entries) were removed",
        )
    if previous is not None and previous.raw == line.raw:
        return Problem(
            n, ProblemKind.DUPLICATED, f"line {n} repeats line {previous.no} (seq {seq})"
        )
    return Problem(
        n,
        ProblemKind.REORDERED,
        f"line {n} holds seq {seq}, but the chain had already reached seq {position.seq}: "
        "an earlier entry was copied or moved here",
    )


@dataclass(slots=True)
class _Walk:
    """The state of one pass over the log."""

    head: HeadRecord | None
    position: ChainPosition = GENESIS
    entries: int = 0
    lines: int = 0
    previous: _Line | None = None
    problem: Problem | None = None

    def accept(self, line: _Line, sealed: SealedEntry) -> None:
        head = self.head
        if (
            head is not None
            and sealed.entry.seq == head.seq
            and not hashes_equal(sealed.hash, head.hash)
        ):
            self.problem = Problem(
                line.no,
                ProblemKind.TAMPERED,
                f"the head file recorded hash {head.hash} for seq {head.seq}, but the "
                f"log's entry has hash {sealed.hash}: the log was rewritten from there on",
            )
            return
        self.position, self.entries, self.previous = sealed.position, self.entries + 1, line


def _walk(reader: _LineReader, head: HeadRecord | None, warnings: list[Problem]) -> _Walk:
    state = _Walk(head)
    while state.problem is None and (line := reader.next()) is not None:
        state.lines = line.no
        sealed = _sealed_or_none(line.content) if line.complete else None
        if sealed is not None and follows(state.position, sealed):
            state.accept(line, sealed)
            continue
        recovery = _try_recovery(reader, line, state.position)
        if recovery.event is None or recovery.event_line is None:
            reader.rewind_to_after(line)
            state.problem = recovery.mismatch or _classify(
                reader, line, state.previous, state.position
            )
            break
        region = (recovery.event.entry.detail or {}).get("lines", 1)
        warnings.append(
            Problem(
                line.no,
                ProblemKind.RECOVERED,
                f"{region} line(s) from line {line.no} are a torn write the daemon recovered "
                "from at restart (it probably crashed while writing); their size and sha256 "
                "are recorded in the next entry and the chain continues intact",
            )
        )
        state.lines = recovery.event_line.no
        state.accept(recovery.event_line, recovery.event)
    return state


def verify_file(path: Path) -> VerifyReport:
    """Verify the audit log at ``path`` (and its head file, if any).

    Error handling: OSError when the log cannot be read (e.g. FileNotFoundError)
    passes through; everything wrong *inside* the files is a problem in the report.
    """
    problems: list[Problem] = []
    warnings: list[Problem] = []
    head: HeadRecord | None = None
    try:
        head = read_head(path)
    except HeadFormatError as exc:
        problems.append(
            Problem(0, ProblemKind.HEAD, f"the head file {head_path(path)} is damaged: {exc}")
        )
    with path.open("rb") as file:
        state = _walk(_LineReader(file), head, warnings)
    if state.problem is not None:
        problems.append(state.problem)
    # After a torn last line the chain before it still stands, so the head still counts.
    if state.problem is None or state.problem.kind is ProblemKind.TORN:
        problems.extend(_head_findings(path, head, state, warnings, damaged=bool(problems)))
    return VerifyReport(
        ok=not problems,
        entries=state.entries,
        problems=tuple(problems),
        warnings=tuple(warnings),
        last_seq=state.position.seq,
        last_hash=state.position.hash,
    )


def _head_findings(
    path: Path, head: HeadRecord | None, state: _Walk, warnings: list[Problem], *, damaged: bool
) -> list[Problem]:
    last = state.position.seq
    if head is None and not damaged:
        warnings.append(
            Problem(
                0,
                ProblemKind.NO_HEAD,
                f"no head file ({head_path(path).name}): entries cut off the end of the log "
                "could not be detected",
            )
        )
    if last == 0 and not damaged:
        warnings.append(Problem(0, ProblemKind.EMPTY, "the log holds no entries"))
    if head is not None and head.seq > last:
        return [
            Problem(
                state.lines + 1,
                ProblemKind.TRUNCATED,
                f"the log ends at seq {last}, but its head file says seq {head.seq} was "
                f"written: {head.seq - last} entries were cut off the end",
            )
        ]
    return []
