"""The witness's decision on one ``add-checkpoint`` request, in C2SP tlog-witness's order.

1. the body parses (else 400);
2. the checkpoint's origin is a log this witness is configured for (else 404);
3. a trusted key of that log signed it, and no trusted key's signature fails (else 403);
4. old size <= checkpoint size (else 400);
5. old size == the size of the latest checkpoint cosigned for the log, 0 if none (else
   409, the body that size: the client retries from it);
6. a size-0 checkpoint has the empty tree's root (else 422);
7. same size as the record: the same root (else 409, the spec's "the root hashes are
   also identical", with a text body, not a size: resending cannot help);
8. from old size 0 the proof is empty; otherwise it is a consistency proof from the
   *witness's own recorded root* to the new one (else 422).

Then the new record is written durably and only then the cosignature returned. Steps 5
to "written" run under one lock, so two requests can never roll the record back (the
spec's race). A 422 (or a same-size 409) with a validly signed checkpoint is proof the
log rewrote its history: it is logged as an error and kept as evidence
(``state.keep_evidence``).

Error handling: every refusal is an :class:`Answer` with its status and a message that
says what failed; an OSError writing the record is a 500 and the record is unchanged.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Final

import structlog

from gatewayd.audit.checkpoint import Checkpoint, CheckpointError, parse_checkpoint
from gatewayd.audit.cosignature import Cosigner
from gatewayd.audit.merkle import EMPTY_ROOT, ProofError, verify_consistency
from gatewayd.audit.note import NoteError, NoteVerifier, open_note, parse_note
from gatewayd.audit.witness_wire import (
    SIZE_CONTENT_TYPE,
    AddCheckpoint,
    BadRequest,
    format_size,
    parse_add_checkpoint,
)
from gatewayd.witness.state import LogRecord, WitnessState

log = structlog.get_logger("gatewayd.witness")

TEXT: Final = "text/plain; charset=utf-8"


@dataclass(frozen=True, slots=True)
class Answer:
    """An HTTP answer: status, media type, body."""

    status: int
    content_type: str
    body: bytes

    @classmethod
    def text(cls, status: int, message: str) -> Answer:
        return cls(status, TEXT, message.encode() + b"\n")


class _Refused(Exception):
    def __init__(self, answer: Answer, *, evidence: bool = False) -> None:
        super().__init__(answer.body.decode(errors="replace").strip())
        self.answer = answer
        self.evidence = evidence


def _refuse(status: int, message: str, *, evidence: bool = False) -> _Refused:
    return _Refused(Answer.text(status, message), evidence=evidence)


class Witness:
    """Cosigns checkpoints of the ``logs`` it is configured for (origin -> the log's
    trusted keys) with ``cosigner``, recording each in ``state``. Thread-safe."""

    def __init__(
        self,
        *,
        cosigner: Cosigner,
        logs: Mapping[str, Sequence[NoteVerifier]],
        state: WitnessState,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.cosigner = cosigner
        self.logs = dict(logs)
        self.state = state
        self._clock = clock
        self._lock = threading.Lock()

    def add_checkpoint(self, body: bytes) -> Answer:
        """Answer one add-checkpoint request body."""
        origin = None
        try:
            request = parse_add_checkpoint(body)
            checkpoint, note = self._signed_checkpoint(request)
            origin = checkpoint.origin
            with self._lock:
                answer = self._cosign(request, checkpoint, note)
        except BadRequest as exc:
            return Answer.text(400, f"bad request: {exc}")
        except _Refused as refused:
            fields = {"origin": origin, "status": refused.answer.status, "reason": str(refused)}
            if refused.evidence and origin is not None:
                try:
                    with self._lock:
                        kept = self.state.keep_evidence(origin, str(refused), body)
                except OSError as exc:  # the refusal stands; the evidence is in the log line
                    kept, fields["evidenceError"] = None, str(exc)
                log.error(
                    "witness_refused_inconsistent",
                    evidence=str(kept),
                    request=body.decode(errors="replace") if kept is None else None,
                    **fields,
                )
            else:
                log.warning("witness_refused", **fields)
            return refused.answer
        except OSError as exc:
            log.error("witness_state_write_failed", origin=origin, error=str(exc))
            return Answer.text(500, "the witness could not record the checkpoint; retry")
        return answer

    def _signed_checkpoint(self, request: AddCheckpoint) -> tuple[Checkpoint, str]:
        """Steps 2 and 3: the checkpoint, opened with its log's keys; returns it and the
        note to record (its text and the log's verified signatures only: lines of
        unknown keys are not this witness's to repeat)."""
        try:
            text, signatures = parse_note(request.note)
            checkpoint = parse_checkpoint(text)
        except (NoteError, CheckpointError) as exc:
            raise BadRequest(f"the checkpoint is malformed: {exc}") from None
        keys = self.logs.get(checkpoint.origin)
        if keys is None:
            raise _refuse(
                404, f"unknown log {checkpoint.origin!r}: this witness does not follow it"
            )
        try:
            open_note(request.note, keys)
        except NoteError as exc:
            raise _refuse(403, f"the checkpoint's signature does not verify: {exc}") from None
        trusted = {(key.name, key.key_id) for key in keys}
        lines = [s.line() for s in signatures if (s.name, s.key_id) in trusted]
        return checkpoint, text + "\n" + "".join(dict.fromkeys(lines))

    def _cosign(self, request: AddCheckpoint, checkpoint: Checkpoint, note: str) -> Answer:
        """Steps 4 to 7, the durable record, then the cosignature (under the lock)."""
        old, size = request.old_size, checkpoint.size
        if old > size:
            raise _refuse(400, f"old size {old} is larger than the checkpoint's size {size}")
        latest = self.state.latest(checkpoint.origin)
        known = latest.size if latest is not None else 0
        if old != known:
            return Answer(409, SIZE_CONTENT_TYPE, format_size(known))
        if size == 0 and checkpoint.root != EMPTY_ROOT:
            raise _refuse(422, "a checkpoint of size 0 must have the empty tree's root")
        if latest is not None and size == old and checkpoint.root != latest.root:
            # C2SP tlog-witness: 409 when the sizes match and the roots do not. Not the
            # size body of a stale old size (a client would resend and loop): a text
            # saying what differs.
            raise _refuse(
                409,
                f"checkpoint of size {size} has a different root than the checkpoint of "
                f"the same size this witness cosigned (different roots): the history was "
                "rewritten",
                evidence=True,
            )
        if old == 0 and request.proof:
            raise _refuse(422, "from old size 0 the consistency proof must be empty")
        if latest is not None:
            try:
                verify_consistency(old, size, latest.root, checkpoint.root, list(request.proof))
            except ProofError as exc:
                raise _refuse(
                    422,
                    f"checkpoint of size {size} is not consistent with the checkpoint of "
                    f"size {old} this witness cosigned: {exc}",
                    evidence=True,
                ) from None
        timestamp = int(self._clock())
        # The text as the log signed it (parse_checkpoint accepts only canonical
        # lines, so it is also checkpoint.body()).
        cosignature = self.cosigner.cosign(note.rpartition("\n\n")[0] + "\n", timestamp)
        self.state.record(
            LogRecord(
                origin=checkpoint.origin, size=size, root=checkpoint.root, note=note + cosignature
            )
        )
        log.info("witness_cosigned", origin=checkpoint.origin, size=size, old=old)
        return Answer(200, TEXT, cosignature.encode())

    def checkpoint(self, hex_hash: str) -> Answer:
        """``GET <origin hash>/checkpoint``: the latest cosigned checkpoint of that log."""
        with self._lock:
            record = self.state.by_hash(hex_hash)
        if record is None:
            return Answer.text(404, "this witness has cosigned no checkpoint of that log")
        return Answer(200, TEXT, record.note.encode())
