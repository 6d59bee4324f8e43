"""``gatewayd audit verify``: check the whole chain and say where it first breaks.

Reads the log line by line (it may be large) and checks, for every line: that it is
a sealed entry gatewayd could have written, that its bytes match its hash, that its
seq is one more than the last and that its ``prev`` is the last entry's hash. The
first line that fails is reported with its number and what a reviewer should
conclude; checking stops there, because nothing after a break can be trusted to the
chain. A break followed by a matching ``torn_tail_recovered`` event is the trace of a
crash the daemon recovered from at restart: a warning, not a failure. Finally the
head file, if any, must not claim an entry beyond the end of the log.

A rotated log is verified as one chain: the closed segments in number order, then
the active file (``segments.log_files``). At a segment boundary the first entry must
follow the last entry of the segment before it. When it does not and its seq jumps
ahead, a segment is missing: that is reported, naming the segment (from the numbers
or from the ``segment_open`` event), and checking goes on from there so every later
gap is reported too. When the oldest remaining file starts with a ``segment_open``
event past seq 1, the segments before it are gone (retention): the report is
*partial* (``partial_from``), and the chain is verified from that entry on.
"""

from __future__ import annotations

import enum
import errno
import hashlib
import os
import re

from gatewayd.audit.head import HeadFormatError, HeadRecord, head_file, read_head
from gatewayd.audit.line import MAX_LINE_BYTES, hashes_equal
from gatewayd.audit.plainrecord import PlainRecord
from gatewayd.audit.sealed import (
    GENESIS,
    ChainPosition,
    LineDefect,
    LineError,
    SealedEntry,
    follows,
    read_line,
)
from gatewayd.audit.segments import log_files, segment_number, segment_path

# typing's flag without importing typing: `gatewayd audit verify` starts without it
TYPE_CHECKING = False
if TYPE_CHECKING:
    from collections.abc import Callable, Iterator
    from pathlib import PurePath
    from typing import BinaryIO, Final

# A recovered torn region is at most one flush batch; look no further for its event.
_MAX_RECOVERY_SCAN_BYTES: Final = 16 * 1024 * 1024
# Compiled at its first use (by re's cache): only a broken chain is searched for seqs.
_SEQ_PATTERN: Final = rb'\{"seq":(\d{1,20}),'


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
    PARTIAL = "partial"  # the oldest segments are gone: verified from a later entry on
    NO_ACTIVE = "no_active"  # warning: only closed segments (an interrupted rotation)


class Problem(PlainRecord):
    """One finding: the 1-based line it is about (0 = the file as a whole), and the
    file's name when the log has more than one segment. (The records of this module
    are plain classes: `gatewayd audit verify` makes each at its start, and a
    NamedTuple or a dataclass costs ten times as much to make.)"""

    __slots__ = ("kind", "line", "message", "segment")

    def __init__(self, line: int, kind: ProblemKind, message: str, segment: str = "") -> None:
        self.line = line
        self.kind = kind
        self.message = message
        self.segment = segment

    def in_segment(self, segment: str) -> Problem:
        """The same finding, naming the file it is in."""
        return Problem(self.line, self.kind, self.message, segment)


class VerifyReport:
    """The outcome of :func:`verify_file`. ``ok`` is True only without problems."""

    __slots__ = (
        "entries",
        "last_hash",
        "last_seq",
        "ok",
        "partial_from",
        "problems",
        "segments",
        "warnings",
    )

    def __init__(
        self,
        ok: bool,
        entries: int,  # entries verified (up to the first problem)
        problems: tuple[Problem, ...],
        warnings: tuple[Problem, ...],
        last_seq: int,
        last_hash: str,
        segments: int = 1,  # files read (closed segments and the active file)
        # The seq the remaining log starts at when its oldest segments are gone (else None).
        partial_from: int | None = None,
    ) -> None:
        self.ok = ok
        self.entries = entries
        self.problems = problems
        self.warnings = warnings
        self.last_seq = last_seq
        self.last_hash = last_hash
        self.segments = segments
        self.partial_from = partial_from

    def render(self) -> str:
        """What ``gatewayd audit verify`` prints."""
        files = f" in {self.segments} segments" if self.segments > 1 else ""
        if self.ok and self.partial_from is not None:
            lines = [
                f"PARTIAL: the log starts at seq {self.partial_from} (the segments before "
                f"it are gone); from there {self.entries} entries{files}, chain intact, "
                f"last hash {self.last_hash} (seq {self.last_seq})"
            ]
        elif self.ok:
            lines = [
                f"OK: {self.entries} entries{files}, chain intact, last hash "
                f"{self.last_hash} (seq {self.last_seq})"
            ]
        else:
            lines = [
                f"FAILED: the audit log does not verify; {self.entries} entries{files} "
                "verified intact (up to the first break, or between missing segments)"
            ]
            lines += [_render_one("problem", p) for p in self.problems]
        lines += [_render_one("warning", w) for w in self.warnings]
        return "\n".join(lines)


def _render_one(label: str, finding: Problem) -> str:
    where = f"line {finding.line}" if finding.line else "file"
    if finding.segment:
        where = f"{finding.segment} {where}" if finding.line else finding.segment
    return f"  {label} ({finding.kind}, {where}): {finding.message}"


class _Line:
    __slots__ = ("no", "raw", "start")

    def __init__(self, no: int, start: int, raw: bytes) -> None:
        self.no = no
        self.start = start
        self.raw = raw  # with its newline, if it has one

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
    match = re.match(_SEQ_PATTERN, content)
    return int(match[1]) if match else None


class _Recovery:
    __slots__ = ("event", "event_line", "mismatch")

    def __init__(
        self,
        event: SealedEntry | None,  # the matching recovery event, or None
        event_line: _Line | None,
        mismatch: Problem | None,  # an event naming this line whose facts do not match
    ) -> None:
        self.event = event
        self.event_line = event_line
        self.mismatch = mismatch


def _try_recovery(reader: _LineReader, first: _Line, position: ChainPosition) -> _Recovery:
    """Look for the ``torn_tail_recovered`` event that accounts for a break at ``first``.

    The region is every line from ``first`` up to that event; the event must follow
    the last good entry and record the region's line, line count, size and sha256
    (without the region's final newline, which the writer may have added).
    """
    # Here: building the event registry costs a reader's start about 2 ms, and only a
    # break in the chain needs it.
    from gatewayd.audit.events import AuditEvent

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


class _Walk:
    """The state of one pass over the log."""

    __slots__ = (
        "entries",
        "first_file",
        "gaps",
        "head",
        "lines",
        "partial_from",
        "position",
        "previous",
        "problem",
    )

    def __init__(self, head: HeadRecord | None) -> None:
        self.head = head
        self.position: ChainPosition = GENESIS
        self.entries = 0
        self.lines = 0
        self.previous: _Line | None = None
        self.problem: Problem | None = None
        self.first_file = True  # the file being read is the oldest one there is
        self.gaps: list[Problem] = []  # missing segments (boundaries)
        self.partial_from: int | None = None

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


def _walk(
    reader: _LineReader,
    state: _Walk,
    warnings: list[Problem],
    describe_gap: Callable[[SealedEntry, int], str],
) -> _Walk:
    """Walk one file, continuing ``state`` (the chain so far, from earlier segments)."""
    state.previous = None
    while state.problem is None and (line := reader.next()) is not None:
        state.lines = line.no
        sealed = _sealed_or_none(line.content) if line.complete else None
        if sealed is not None and follows(state.position, sealed):
            state.accept(line, sealed)
            continue
        if line.no == 1 and sealed is not None and sealed.entry.seq > state.position.seq + 1:
            expected = state.position.seq + 1
            if not state.first_file:
                # A segment boundary that jumps ahead: a whole segment is gone. Say
                # which, then go on from here to find every other gap.
                state.gaps.append(Problem(1, ProblemKind.MISSING, describe_gap(sealed, expected)))
                state.accept(line, sealed)
                continue
            from gatewayd.audit.events import AuditEvent  # here, as in _try_recovery

            if sealed.entry.event == AuditEvent.SEGMENT_OPEN:
                before = (sealed.entry.detail or {}).get("previousSegment")
                state.partial_from = sealed.entry.seq
                warnings.append(
                    Problem(
                        1,
                        ProblemKind.PARTIAL,
                        f"the oldest remaining segment starts at seq {sealed.entry.seq} with "
                        f"a segment_open event: the segments before it (the last of them "
                        f"{before}) are gone, e.g. deleted for retention, so seq 1.."
                        f"{sealed.entry.seq - 1} cannot be checked; verified from seq "
                        f"{sealed.entry.seq} on",
                    )
                )
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


def _gap_describer(active: str, before: str, this: str) -> Callable[[SealedEntry, int], str]:
    """How to name what is missing between the files ``before`` and ``this``."""

    def describe(sealed: SealedEntry, expected: int) -> str:
        seq = sealed.entry.seq
        low = segment_number(active, before) or 0
        high = segment_number(active, this)
        if high is None:  # the active file: its segment_open names the one before it
            named = (sealed.entry.detail or {}).get("previousSegment")
            sibling = os.path.join(os.path.dirname(active), str(named))
            number = segment_number(active, sibling) if named else None
            high = number + 1 if number is not None else low + 1
        names = [os.path.basename(segment_path(active, n)) for n in range(low + 1, high)]
        what = (
            f"segment {names[0]} is missing"
            if len(names) == 1
            else f"segments {names[0]}..{names[-1]} are missing"
            if names
            else "entries are missing at the start of this segment"
        )
        return (
            f"{what}: {os.path.basename(before)} ends at seq {expected - 1} and "
            f"{os.path.basename(this)} starts at "
            f"seq {seq}, so seq {expected}..{seq - 1} ({seq - expected} entries) are not "
            "in the log; verified on from there"
        )

    return describe


def verify_file(log: str | PurePath) -> VerifyReport:
    """Verify the audit log whose active file is ``log``: its closed segments in
    order, then ``log`` itself, and its head file, if any.

    Error handling: FileNotFoundError when there is neither the file nor a segment of
    it; other OSErrors from reading pass through; everything wrong *inside* the files
    is a problem in the report.
    """
    path = os.fspath(log)
    files = log_files(path)
    if not files:
        raise FileNotFoundError(errno.ENOENT, "no audit log", str(path))
    problems: list[Problem] = []
    warnings: list[Problem] = []
    head: HeadRecord | None = None
    try:
        head = read_head(path)
    except HeadFormatError as exc:
        problems.append(
            Problem(0, ProblemKind.HEAD, f"the head file {head_file(path)} is damaged: {exc}")
        )
    many = len(files) > 1
    if files[-1] != path:
        warnings.append(
            Problem(
                0,
                ProblemKind.NO_ACTIVE,
                f"there is no active file {os.path.basename(path)}, only closed segments: a "
                "rotation was "
                "interrupted (gatewayd makes it when it next opens the log), or it was removed",
            )
        )
    state = _Walk(head)
    for index, file in enumerate(files):
        state.first_file = index == 0
        before = files[index - 1] if index else file
        seen = len(warnings), len(state.gaps)
        with open(file, "rb") as reader:
            _walk(_LineReader(reader), state, warnings, _gap_describer(path, before, file))
        if many:
            named = os.path.basename(file)
            warnings[seen[0] :] = [w.in_segment(named) for w in warnings[seen[0] :]]
            state.gaps[seen[1] :] = [g.in_segment(named) for g in state.gaps[seen[1] :]]
            if state.problem is not None:
                state.problem = state.problem.in_segment(named)
        if state.problem is not None:
            break
    problems.extend(state.gaps)
    if state.problem is not None:
        problems.append(state.problem)
    # After a torn last line the chain before it still stands, so the head still counts.
    if state.problem is None or state.problem.kind is ProblemKind.TORN:
        findings = _head_findings(path, head, state, warnings, damaged=bool(problems))
        last_file = os.path.basename(files[-1])
        problems.extend(f.in_segment(last_file) if many else f for f in findings)
    return VerifyReport(
        ok=not problems,
        entries=state.entries,
        problems=tuple(problems),
        warnings=tuple(warnings),
        last_seq=state.position.seq,
        last_hash=state.position.hash,
        segments=len(files),
        partial_from=state.partial_from,
    )


def _head_findings(
    path: str, head: HeadRecord | None, state: _Walk, warnings: list[Problem], *, damaged: bool
) -> list[Problem]:
    last = state.position.seq
    if head is None and not damaged:
        warnings.append(
            Problem(
                0,
                ProblemKind.NO_HEAD,
                f"no head file ({os.path.basename(head_file(path))}): entries cut off the end "
                "of the log "
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
