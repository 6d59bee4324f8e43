"""gatewayd's witness client: each signed checkpoint goes to every configured witness
(C2SP tlog-witness ``add-checkpoint``) with the consistency proof from that witness's
last size; each cosignature that verifies is stored beside the log.

Stored: ``<log>.witnessed/<witness name, %-quoted>.note``, per witness the latest
checkpoint it cosigned: the checkpoint, the log's signature and that witness's
cosignature, one signed note (replaced atomically). ``gatewayd audit verify --witness
VKEY --quorum K`` reads them (:func:`read_witnessed`).

Never blocks a call: the checkpointer hands each checkpoint over on the trio thread
(:meth:`WitnessClient.on_checkpoint` only stores it and wakes a task); each witness has
a task of its own that sends the latest checkpoint (one in flight per witness; a newer
one replaces a waiting one) over HTTP in a worker thread with a timeout. A witness that
is down, slow or refusing delays nothing but its own cosignature.

A refusal (a 4xx other than the routine 409 resync, a cosignature that does not verify,
a witness that has seen a larger tree than this log has) is logged and audited
(``witness_refused``); a witness that cannot be reached is logged. Either is audited
only when the witness's state changes (ok -> refusing, one refusal -> another), and
``witness_recovered`` when a refusing witness cosigns again: an audit entry makes a new checkpoint,
which a refusing witness would refuse again, so one entry per refusal would never stop.

Resource handling: one ``httpx.Client`` per witness (keep-alive, as the spec asks),
closed when :meth:`WitnessClient.run` ends.
"""

from __future__ import annotations

import contextlib
import enum
import os
import tempfile
import urllib.parse
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Final

import httpx
import structlog
import trio

from gatewayd.audit.checkpoint import Checkpoint, CheckpointError, parse_checkpoint
from gatewayd.audit.cosignature import CosignatureVerifier
from gatewayd.audit.entry import EntryKind
from gatewayd.audit.events import AuditEvent
from gatewayd.audit.note import NoteError, parse_note
from gatewayd.audit.witness_wire import format_add_checkpoint, parse_size
from gatewayd.audit.writer import AuditLog

log = structlog.get_logger("gatewayd.witnessing")

# Connect and read bounds of one request: a witness checks a signature and a proof and
# fsyncs one file; 10 s is ample, and bounds how long a hung witness holds its task.
HTTP_TIMEOUT_S: Final = 10.0
# After a witness could not be reached (or answered 5xx), wait this long before sending
# it the latest checkpoint again, doubling up to the cap: an idle log makes no new
# checkpoint, so without a retry its last one would never be cosigned.
RETRY_FIRST_S: Final = 1.0
RETRY_MAX_S: Final = 60.0
# A witness's answer is a few signature lines; a bigger one is not an answer.
MAX_ANSWER_BYTES: Final = 64 * 1024
WITNESSED_SUFFIX: Final = ".witnessed"
NOTE_SUFFIX: Final = ".note"
# The detail an audit entry keeps of a witness's message.
MAX_AUDITED_MESSAGE_CHARS: Final = 300


def witnessed_dir(log_path: Path) -> Path:
    """Where the witnesses' cosigned checkpoints of the log ``log_path`` are kept."""
    return log_path.with_name(log_path.name + WITNESSED_SUFFIX)


def witnessed_path(log_path: Path, witness_name: str) -> Path:
    """The file of one witness's latest cosigned checkpoint of ``log_path``."""
    return witnessed_dir(log_path) / (urllib.parse.quote(witness_name, safe="") + NOTE_SUFFIX)


def read_witnessed(log_path: Path) -> list[tuple[Path, str]]:
    """Every stored cosigned checkpoint beside ``log_path``: ``(file, note text)``, in
    name order (unreadable files are skipped: verification counts what verifies)."""
    found: list[tuple[Path, str]] = []
    directory = witnessed_dir(log_path)
    if not directory.is_dir():
        return found
    for path in sorted(directory.glob("*" + NOTE_SUFFIX)):
        with contextlib.suppress(OSError, UnicodeDecodeError):
            found.append((path, path.read_text()))
    return found


def _write_atomically(path: Path, text: str) -> None:
    path.parent.mkdir(mode=0o700, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=".tmp-", dir=path.parent)
    try:
        with os.fdopen(fd, "w") as out:
            out.write(text)
            out.flush()
            os.fsync(out.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


@dataclass(frozen=True, slots=True)
class WitnessEndpoint:
    """One configured witness: its name, its submission URL prefix, its key."""

    name: str
    url: str
    verifier: CosignatureVerifier


class Health(enum.Enum):
    UNKNOWN = "unknown"
    OK = "ok"
    REFUSING = "refusing"
    UNREACHABLE = "unreachable"


@dataclass
class _Follower:
    """One witness's task state."""

    endpoint: WitnessEndpoint
    wake: trio.Event = field(default_factory=trio.Event)
    pending: tuple[str, Checkpoint] | None = None
    # The size of the latest checkpoint of ours the witness cosigned (None: unknown;
    # the first request says 0 and the witness's 409 tells the truth).
    known_size: int | None = None
    health: Health = Health.UNKNOWN
    # What is wrong ("reason:status"), None when ok: a change of it is logged (audited
    # for a refusal), a repeat is not.
    problem: str | None = None


class _Refusal(Exception):
    def __init__(self, reason: str, message: str, status: int | None = None) -> None:
        super().__init__(message)
        self.reason = reason
        self.status = status


class _Unreachable(Exception):
    pass


class WitnessClient:
    """Sends the log's checkpoints (of the log ``log_path``) to ``witnesses``.

    ``prove(old, new)`` returns the consistency proof between two sizes of the log (the
    checkpointer's node store; called in a worker thread). ``audit``: where refusals
    are audited (None: only logged, e.g. in tests).
    """

    def __init__(
        self,
        witnesses: Sequence[WitnessEndpoint],
        *,
        log_path: Path,
        prove: Callable[[int, int], list[bytes]],
        audit: AuditLog | None = None,
        timeout_s: float = HTTP_TIMEOUT_S,
    ) -> None:
        self.log_path = log_path
        self._prove = prove
        self._audit = audit
        self._timeout_s = timeout_s
        self._followers = [_Follower(endpoint) for endpoint in witnesses]
        for follower in self._followers:
            follower.known_size = _stored_size(witnessed_path(log_path, follower.endpoint.name))

    def health(self) -> dict[str, str]:
        """Each witness's state: ok, refusing, unreachable or unknown."""
        return {f.endpoint.name: f.health.value for f in self._followers}

    def on_checkpoint(self, note: str, checkpoint: Checkpoint) -> None:
        """The checkpointer's hook (trio thread): queue ``note`` for every witness.
        Returns at once; a checkpoint still waiting for a witness is replaced."""
        for follower in self._followers:
            follower.pending = (note, checkpoint)
            follower.wake.set()

    async def run(self) -> None:
        """Follow every witness until cancelled."""
        async with trio.open_nursery() as nursery:
            for follower in self._followers:
                nursery.start_soon(self._follow, follower)

    async def _follow(self, follower: _Follower) -> None:
        http = httpx.Client(timeout=self._timeout_s, follow_redirects=False)
        retry_s = RETRY_FIRST_S
        try:
            while True:
                await follower.wake.wait()
                follower.wake = trio.Event()
                if follower.pending is None:
                    continue
                note, checkpoint = follower.pending
                follower.pending = None
                try:
                    await self._submit(follower, http, note, checkpoint)
                except _Refusal as exc:
                    self._set_health(follower, Health.REFUSING, exc.reason, str(exc), exc.status)
                except Exception as exc:
                    # Unreachable, or trouble of our own (the tree switched off, a full
                    # disk, a bug): this witness's task goes on and retries; the daemon
                    # and the calls never see it.
                    if not isinstance(exc, _Unreachable):
                        log.exception("witness_client_failed", witness=follower.endpoint.name)
                    reason = "unreachable" if isinstance(exc, _Unreachable) else "client_failed"
                    self._set_health(follower, Health.UNREACHABLE, reason, str(exc))
                    if follower.pending is None:  # nothing newer: retry this one later
                        follower.pending = (note, checkpoint)
                    await trio.sleep(retry_s)
                    retry_s = min(retry_s * 2, RETRY_MAX_S)
                    follower.wake.set()
                    continue
                else:
                    self._set_health(follower, Health.OK, "cosigned", None)
                retry_s = RETRY_FIRST_S
        finally:
            http.close()

    async def _submit(
        self, follower: _Follower, http: httpx.Client, note: str, checkpoint: Checkpoint
    ) -> None:
        """Send ``note`` to one witness, resyncing once on a 409; store the cosignature.

        Error handling: _Refusal (audited), _Unreachable (retried).
        """
        name, size = follower.endpoint.name, checkpoint.size
        for _attempt in range(2):
            old = follower.known_size or 0
            if old > size:
                old = 0  # a stale hint (the file beside the log): ask the witness its size
            proof = (
                [] if old in (0, size) else await trio.to_thread.run_sync(self._prove, old, size)
            )
            body = format_add_checkpoint(old, proof, note)
            status, answer = await trio.to_thread.run_sync(
                self._post, http, follower.endpoint.url, body, abandon_on_cancel=True
            )
            if status == 409:
                try:
                    follower.known_size = parse_size(answer)
                except ValueError:
                    # Not a size: the spec's other 409, a checkpoint of the witness's
                    # own size with another root (a rewritten history).
                    text = answer[:MAX_AUDITED_MESSAGE_CHARS].decode(errors="replace").strip()
                    raise _Refusal(
                        "inconsistent",
                        f"witness {name} refused checkpoint {size} (HTTP 409): {text}",
                        status,
                    ) from None
                if follower.known_size > size:
                    raise _Refusal(
                        "witness_ahead",
                        f"witness {name} has cosigned a tree of size {follower.known_size} of "
                        f"this log, larger than its size now ({size}): the log lost entries, "
                        "or another log signs with its key",
                        status,
                    )
                continue
            if status == 200:
                await self._store(follower, note, checkpoint, answer)
                return
            text = answer[:MAX_AUDITED_MESSAGE_CHARS].decode(errors="replace").strip()
            if status >= 500:
                raise _Unreachable(f"witness {name} answered {status}: {text}")
            raise _Refusal(
                "inconsistent" if status == 422 else "refused",
                f"witness {name} refused checkpoint {size} (HTTP {status}): {text}",
                status,
            )
        raise _Refusal(
            "resync_failed", f"witness {name} answered 409 twice for checkpoint {size}", 409
        )

    def _post(self, http: httpx.Client, url: str, body: bytes) -> tuple[int, bytes]:
        target = url.rstrip("/") + "/add-checkpoint"
        try:
            with http.stream("POST", target, content=body) as response:
                data = b""
                for chunk in response.iter_bytes():
                    data += chunk
                    if len(data) > MAX_ANSWER_BYTES:
                        return 502, f"answer over {MAX_ANSWER_BYTES} bytes".encode()
                return response.status_code, data
        except httpx.HTTPError as exc:
            raise _Unreachable(f"{target}: {type(exc).__name__}: {exc}") from None

    async def _store(
        self, follower: _Follower, note: str, checkpoint: Checkpoint, answer: bytes
    ) -> None:
        """Verify the witness's answer and keep its cosignature with the checkpoint.

        Error handling: _Refusal when no line of the answer is a valid cosignature of
        this witness's key (lines of other keys are ignored, as the spec says).
        """
        endpoint = follower.endpoint
        try:
            text, _ = parse_note(note)
            _, lines = parse_note(text + "\n" + answer.decode())
        except (NoteError, UnicodeDecodeError) as exc:
            raise _Refusal("bad_answer", f"witness {endpoint.name}: {exc}", 200) from None
        mine = [
            line
            for line in lines
            if (line.name, line.key_id) == (endpoint.verifier.name, endpoint.verifier.key_id)
        ]
        valid = [line for line in mine if endpoint.verifier.verify(text.encode(), line.signature)]
        if not valid:
            raise _Refusal(
                "bad_cosignature",
                f"witness {endpoint.name} answered 200 without a valid cosignature by its key "
                f"{endpoint.verifier.to_string()} (lines of it: {len(mine)})",
                200,
            )
        path = witnessed_path(self.log_path, endpoint.name)
        await trio.to_thread.run_sync(_write_atomically, path, note + valid[0].line())
        follower.known_size = checkpoint.size

    def _set_health(
        self,
        follower: _Follower,
        health: Health,
        reason: str,
        message: str | None,
        status: int | None = None,
    ) -> None:
        name = follower.endpoint.name
        # The message names the checkpoint's size: the state is what it says, not it.
        problem = None if health is Health.OK else f"{reason}:{status}"
        changed = (health, problem) != (follower.health, follower.problem)
        before = follower.health
        follower.health, follower.problem = health, problem
        if not changed:
            return
        if health is Health.OK:
            if before is Health.REFUSING:
                log.info("witness_recovered", witness=name)
                self._record(AuditEvent.WITNESS_RECOVERED, name, {"witness": name})
            elif before is Health.UNREACHABLE:
                log.info("witness_reachable", witness=name)
            return
        if health is Health.UNREACHABLE:
            log.warning("witness_unreachable", witness=name, error=message)
            return
        log.error("witness_refused", witness=name, reason=reason, status=status, error=message)
        detail = {"witness": name, "reason": reason, "status": status}
        self._record(AuditEvent.WITNESS_REFUSED, name, detail, message)

    def _record(
        self, event: AuditEvent, name: str, detail: Mapping[str, object], message: str | None = None
    ) -> None:
        if self._audit is None:
            return
        try:
            self._audit.record(
                EntryKind.EVENT,
                event=event,
                detail=detail,
                safeMessage=(message or "")[:MAX_AUDITED_MESSAGE_CHARS] or None,
            )
        except ValueError:
            log.exception("witness_audit_failed", witness=name)


def _stored_size(path: Path) -> int | None:
    """The size of the checkpoint in a stored cosigned note (None: none or unreadable)."""
    try:
        return parse_checkpoint(parse_note(path.read_text())[0]).size
    except (OSError, UnicodeDecodeError, NoteError, CheckpointError):
        return None
