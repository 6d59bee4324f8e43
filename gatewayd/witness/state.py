"""The witness's durable state: per log, the latest checkpoint it cosigned.

Layout of the state directory (mode 0700)::

    lock                      flock'd by the one witness using this directory
    logs/<sha256(origin)>     the latest cosigned checkpoint of that log (JSON)
    evidence/<...>.txt        refused checkpoints that the log's key did sign

A record is replaced crash-safely: written to a temporary file in ``logs/``, fsync'd,
renamed over the old one, then the directory fsync'd; a ``kill -9`` at any point leaves
the old record or the new one, never a torn one (a leftover temporary file is removed at
the next open). The rename happens before the witness answers, so a cosignature it gave
is always covered by its record (the spec: "The witness MUST persist the new checkpoint
before responding").

A record that cannot be read refuses the start (fail closed): a witness that forgot a
log would cosign a rewritten history of it.

Resource handling: :meth:`WitnessState.open` takes the lock (a second witness on the same
directory is refused); :meth:`WitnessState.close` releases it.
"""

from __future__ import annotations

import base64
import contextlib
import fcntl
import hashlib
import json
import os
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final

from gatewayd.audit.checkpoint import CheckpointError, parse_checkpoint
from gatewayd.audit.merkle import HASH_SIZE
from gatewayd.audit.note import NoteError, parse_note

LOCK_NAME: Final = "lock"
LOGS_DIR: Final = "logs"
EVIDENCE_DIR: Final = "evidence"
TMP_PREFIX: Final = ".tmp-"
# A record is a checkpoint with a few signatures; anything far bigger is not ours.
MAX_RECORD_BYTES: Final = 1 << 20
# Evidence of a misbehaving log is kept, but a log (whose key signs every such
# checkpoint) must not be able to fill the witness's disk: past this many files,
# further evidence is only logged.
MAX_EVIDENCE_FILES: Final = 1000
RECORD_VERSION: Final = 1


class WitnessStateError(Exception):
    """The state directory cannot be used: locked by another witness, unreadable, or
    holding a record that is not one (the message names the file and what to do)."""


def origin_hash(origin: str) -> str:
    """The lowercase hex SHA-256 of a log's origin (the spec's monitoring path)."""
    return hashlib.sha256(origin.encode()).hexdigest()


@dataclass(frozen=True, slots=True, kw_only=True)
class LogRecord:
    """The latest checkpoint this witness cosigned for one log."""

    origin: str
    size: int
    root: bytes
    # The checkpoint note with the log's signature(s) and this witness's cosignature.
    note: str

    def to_json(self) -> bytes:
        return json.dumps(
            {
                "version": RECORD_VERSION,
                "origin": self.origin,
                "size": self.size,
                "root": base64.b64encode(self.root).decode(),
                "note": self.note,
            },
            sort_keys=True,
        ).encode()

    @classmethod
    def from_json(cls, data: bytes, where: Path) -> LogRecord:
        """Parse a record, checking it against the checkpoint it holds.

        Error handling: WitnessStateError naming ``where``.
        """
        try:
            raw: Any = json.loads(data)
            if not isinstance(raw, dict) or raw.get("version") != RECORD_VERSION:
                raise ValueError(f"not a version {RECORD_VERSION} record")
            origin, size, root_text, note = raw["origin"], raw["size"], raw["root"], raw["note"]
            if not isinstance(origin, str) or not isinstance(note, str):
                raise ValueError("origin and note must be text")  # noqa: TRY004 - one error type for a bad record
            if not isinstance(size, int) or isinstance(size, bool) or size < 0:
                raise ValueError("size must be a whole number")
            root = base64.b64decode(str(root_text), validate=True)
            if len(root) != HASH_SIZE:
                raise ValueError(f"root must be a {HASH_SIZE}-byte hash")
            checkpoint = parse_checkpoint(parse_note(note)[0])
            if (checkpoint.origin, checkpoint.size, checkpoint.root) != (origin, size, root):
                raise ValueError("the origin, size or root differs from its checkpoint's")
        except (ValueError, KeyError, TypeError, CheckpointError, NoteError) as exc:
            raise WitnessStateError(
                f"{where}: not a witness record ({exc}); refusing to start rather than "
                "forget a log's history: restore it from a backup, or remove it only if "
                "this witness must start that log afresh"
            ) from None
        return cls(origin=origin, size=size, root=root, note=note)


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _write_atomically(directory: Path, name: str, data: bytes) -> None:
    """Write ``directory/name`` so a crash leaves the old file or the new one."""
    fd, tmp = tempfile.mkstemp(prefix=TMP_PREFIX, dir=directory)
    try:
        with os.fdopen(fd, "wb") as out:
            out.write(data)
            out.flush()
            os.fsync(out.fileno())
        os.replace(tmp, directory / name)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    _fsync_dir(directory)


class WitnessState:
    """The records of every log this witness has cosigned, on disk and in memory.

    Not thread-safe by itself: :class:`~gatewayd.witness.witness.Witness` serialises
    the check of a request and the write of its record under one lock.
    """

    def __init__(self, directory: Path, lock_fd: int, records: dict[str, LogRecord]) -> None:
        self.directory = directory
        self._lock_fd: int | None = lock_fd
        self._records = records
        self._evidence_count = sum(1 for _ in (directory / EVIDENCE_DIR).iterdir())

    @classmethod
    def open(cls, directory: Path) -> WitnessState:
        """Open (creating, mode 0700) the state directory and read every record.

        Error handling: WitnessStateError when another witness holds the directory, it
        cannot be made or read, or a record is not one.
        """
        try:
            directory.mkdir(mode=0o700, parents=True, exist_ok=True)
            for sub in (LOGS_DIR, EVIDENCE_DIR):
                (directory / sub).mkdir(mode=0o700, exist_ok=True)
            lock_fd = os.open(directory / LOCK_NAME, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        except OSError as exc:
            raise WitnessStateError(f"cannot use state directory {directory}: {exc}") from None
        try:
            fcntl.flock(lock_fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            os.close(lock_fd)
            raise WitnessStateError(
                f"state directory {directory} is in use by another witness (its lock is "
                "held); one witness per state directory"
            ) from None
        try:
            records = cls._read_records(directory / LOGS_DIR)
            return cls(directory, lock_fd, records)
        except BaseException:
            os.close(lock_fd)
            raise

    @staticmethod
    def _read_records(logs: Path) -> dict[str, LogRecord]:
        records: dict[str, LogRecord] = {}
        for path in sorted(logs.iterdir()):
            if path.name.startswith(TMP_PREFIX):
                path.unlink()  # a write a crash interrupted: its old record still stands
                continue
            try:
                with path.open("rb") as file:
                    data = file.read(MAX_RECORD_BYTES + 1)
            except OSError as exc:
                raise WitnessStateError(f"cannot read witness record {path}: {exc}") from None
            if len(data) > MAX_RECORD_BYTES:
                raise WitnessStateError(f"{path}: over {MAX_RECORD_BYTES} bytes, not a record")
            record = LogRecord.from_json(data, path)
            if path.name != origin_hash(record.origin):
                raise WitnessStateError(
                    f"{path}: holds the record of origin {record.origin!r}, whose file is "
                    f"{origin_hash(record.origin)}; a record was moved or copied by hand"
                )
            records[record.origin] = record
        return records

    def latest(self, origin: str) -> LogRecord | None:
        """The latest record of ``origin`` (None: never cosigned)."""
        return self._records.get(origin)

    def by_hash(self, hex_hash: str) -> LogRecord | None:
        """The record of the origin whose SHA-256 is ``hex_hash``."""
        return next((r for o, r in self._records.items() if origin_hash(o) == hex_hash), None)

    def record(self, record: LogRecord) -> None:
        """Make ``record`` the latest of its log, durably, before returning.

        Error handling: OSError from the write; the old record stands then.
        """
        _write_atomically(self.directory / LOGS_DIR, origin_hash(record.origin), record.to_json())
        self._records[record.origin] = record

    def keep_evidence(self, origin: str, reason: str, request: bytes) -> Path | None:
        """Keep a refused request whose checkpoint the log's key signed (proof that the
        log misbehaved); None when the cap is reached."""
        if self._evidence_count >= MAX_EVIDENCE_FILES:
            return None
        name = f"{origin_hash(origin)[:16]}-{time.time_ns()}.txt"
        directory = self.directory / EVIDENCE_DIR
        _write_atomically(directory, name, f"# {reason}\n".encode() + request)
        self._evidence_count += 1
        return directory / name

    def close(self) -> None:
        if self._lock_fd is not None:
            os.close(self._lock_fd)  # releases the flock
            self._lock_fd = None
