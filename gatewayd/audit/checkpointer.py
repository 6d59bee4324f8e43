"""Signed checkpoints of the audit log's tree: when they are made, and where they go.

A checkpoint (:mod:`gatewayd.audit.checkpoint`) of the tree's size and root is signed
with the log's key (a signed note, :mod:`gatewayd.audit.note`) and written beside the
log:

- ``<log>.checkpoint``: the latest signed checkpoint, replaced atomically;
- ``<log>.checkpoints``: every checkpoint signed, one JSON line each
  (``{"size": N, "note": "<signed note>"}``), appended and fsync'd: the history that
  ``audit prove --consistency`` and a reviewer go back to.

When (:meth:`Checkpointer.run`): at start; within ``CHECKPOINT_DELAY_S`` after new
entries; at once after a ``run_ended`` entry is durable; and at stop, after
``audit_close`` (an ``AuditLog.after_close`` hook). Nothing new: nothing signed.

The log must never sign a checkpoint inconsistent with one it signed before (C2SP
tlog-checkpoint). Before signing, the tree is checked against the latest checkpoint
its key signed (a consistency proof from the node store, verified): a log that was
rewritten or cut since is refused (:class:`CheckpointRefused`), the daemon says so in
its log, and no checkpoint is signed until an operator looks; calls go on.

The key: a signed-note signer key (``gatewayd audit keygen``) in a file named by
``audit_checkpoint_key`` or in the systemd credential ``audit-checkpoint-key``. It
must not live inside the audit directory (:func:`load_checkpoint_key`): whoever can
rewrite the log must not also find the key beside it.

Resource handling: signing and writing run in a worker thread (``trio.to_thread``),
one at a time (a lock), never on the trio thread.
"""

from __future__ import annotations

import fcntl
import json
import os
import stat
import threading
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Final

import trio

from gatewayd.audit.checkpoint import Checkpoint, CheckpointError, parse_checkpoint
from gatewayd.audit.merkle import ProofError, verify_consistency
from gatewayd.audit.note import NoteError, Signer, open_note, parse_note, sign_note
from gatewayd.audit.treestore import TreeError, TreeStore
from gatewayd.audit.writer import AuditLog, AuditWriteError
from gatewayd.files import fsync_dir, write_all
from gatewayd.secrets import CREDENTIALS_DIRECTORY_ENV

# The promise: a checkpoint within one second after new entries. The loop
# looks this often, and signing takes about a millisecond, so 0.5 s keeps it well
# inside the second even on a busy host.
CHECKPOINT_DELAY_S: Final = 0.5
# How long a run's end waits for the tree to take its run_ended entry (the flusher
# grows the tree just after the entry is durable): far more than one batch needs.
TREE_CATCH_UP_S: Final = 2.0
TREE_POLL_S: Final = 0.002
# The systemd credential that holds the key (LoadCredential=audit-checkpoint-key:...).
CREDENTIAL_NAME: Final = "audit-checkpoint-key"
# A signer key is under 200 bytes; the cap keeps a wrong path from being read whole.
MAX_KEY_FILE_BYTES: Final = 4096
FILE_MODE: Final = 0o600
# How much of the history's end the daemon reads at start to find the latest checkpoint
# its key signed (besides <log>.checkpoint): a few hundred records of ~300 bytes, so a
# latest file deleted or swapped for an older one is noticed, without reading a
# history that grows by a record a second for ever.
HISTORY_TAIL_BYTES: Final = 128 * 1024


class CheckpointKeyError(Exception):
    """The checkpoint key cannot be used; the message says why and what to do (never
    the key)."""


class CheckpointRefused(Exception):
    """The tree is not consistent with the latest checkpoint this key signed: signing
    would fork the log's history. The message says what differs."""


def checkpoint_path(log_path: Path) -> Path:
    """The latest signed checkpoint of the log whose active file is ``log_path``."""
    return log_path.with_name(log_path.name + ".checkpoint")


def history_path(log_path: Path) -> Path:
    """Every checkpoint signed for that log, one JSON line each."""
    return log_path.with_name(log_path.name + ".checkpoints")


# -- the key ---------------------------------------------------------------------------


def _inside(path: Path, directory: Path) -> bool:
    return path == directory or path.is_relative_to(directory)


def _inside_by_inode(path: Path, directory: Path) -> bool:
    """Whether one of ``path``'s parents *is* ``directory`` (same device and inode):
    catches what comparing names cannot, the audit directory reached through a bind
    mount (or any other name the kernel gives the same directory)."""
    try:
        target = os.stat(directory)
    except OSError:
        return False  # no audit directory yet: nothing can be inside it
    for parent in path.parents:
        try:
            info = os.stat(parent)
        except OSError:
            continue
        if (info.st_dev, info.st_ino) == (target.st_dev, target.st_ino):
            return True
    return False


def _refuse_inside(key_path: Path, source: str, audit_dir: Path) -> CheckpointKeyError:
    return CheckpointKeyError(
        f"the checkpoint key {key_path} ({source}) is inside the audit directory "
        f"{audit_dir}: whoever can rewrite the log would find the key beside it; "
        "keep it elsewhere (e.g. /etc/gatewayd/audit-checkpoint.key, mode 0600, or a "
        f"systemd credential LoadCredential={CREDENTIAL_NAME}:/path)"
    )


def load_checkpoint_key(
    key_path: Path | None, audit_path: Path, environ: Mapping[str, str] | None = None
) -> Signer | None:
    """The checkpoint signer: from ``key_path``, else the systemd credential
    ``audit-checkpoint-key``; None when neither is configured (no checkpoints).

    Error handling: CheckpointKeyError when the key file lies inside the audit log's
    directory (as given or through a symbolic link), can be read or written by group
    or others, is not a regular file, is too big, or is not a signer key.
    """
    env = os.environ if environ is None else environ
    source = "audit_checkpoint_key"
    if key_path is None:
        directory = env.get(CREDENTIALS_DIRECTORY_ENV, "")
        if not directory or not (Path(directory) / CREDENTIAL_NAME).exists():
            return None
        key_path, source = Path(directory) / CREDENTIAL_NAME, f"the credential {CREDENTIAL_NAME}"
    audit_dir = audit_path.parent
    resolved_dir = audit_dir.resolve()
    for candidate in (key_path.absolute(), key_path.resolve()):
        if _inside(candidate, audit_dir.absolute()) or _inside(candidate, resolved_dir):
            raise _refuse_inside(key_path, source, audit_dir)
    try:
        fd = os.open(key_path, os.O_RDONLY | os.O_CLOEXEC | os.O_NONBLOCK)
    except OSError as exc:
        raise CheckpointKeyError(
            f"cannot open the checkpoint key {key_path} ({source}): {exc.strerror}"
        ) from None
    try:
        # The file actually opened (a link swapped since the check above is seen
        # here), its parents compared with the audit directory by inode.
        opened = Path(os.readlink(f"/proc/self/fd/{fd}"))
        if _inside_by_inode(opened, audit_dir) or _inside_by_inode(key_path.absolute(), audit_dir):
            raise _refuse_inside(key_path, source, audit_dir)
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            raise CheckpointKeyError(f"the checkpoint key {key_path} is not a regular file")
        if info.st_mode & 0o077:
            raise CheckpointKeyError(
                f"the checkpoint key {key_path} can be read or written by group or others "
                f"(mode {stat.S_IMODE(info.st_mode):04o}); chmod 600 it"
            )
        raw = os.read(fd, MAX_KEY_FILE_BYTES + 1)
    finally:
        os.close(fd)
    if len(raw) > MAX_KEY_FILE_BYTES:
        raise CheckpointKeyError(
            f"the checkpoint key {key_path} is over {MAX_KEY_FILE_BYTES} bytes"
        )
    try:
        return Signer.from_string(raw.decode("utf-8"))
    except (UnicodeDecodeError, NoteError) as exc:
        why = str(exc) if isinstance(exc, NoteError) else "not UTF-8 text"
        raise CheckpointKeyError(
            f"the checkpoint key {key_path} is not a signer key made by `gatewayd audit "
            f"keygen` ({why})"
        ) from None


# -- reading and writing checkpoints ------------------------------------------------------


@dataclass(frozen=True, slots=True)
class SignedCheckpoint:
    """A checkpoint and its signed note."""

    note: str
    checkpoint: Checkpoint


def _signed_by(note: str, signer: Signer) -> SignedCheckpoint | None:
    try:
        text, _ = open_note(note, [signer.verifier])
        return SignedCheckpoint(note, parse_checkpoint(text))
    except (NoteError, CheckpointError):
        return None


def _latest_in_history(log_path: Path, signer: Signer) -> SignedCheckpoint | None:
    """The largest checkpoint ``signer``'s key signed among the history's last records
    (its tail only: the history grows for ever, and the daemon reads this at start)."""
    try:
        with history_path(log_path).open("rb") as file:
            end = file.seek(0, os.SEEK_END)
            file.seek(max(0, end - HISTORY_TAIL_BYTES))
            tail = file.read()
    except FileNotFoundError:
        return None
    best: SignedCheckpoint | None = None
    for raw in tail.splitlines()[1 if end > HISTORY_TAIL_BYTES else 0 :]:
        try:
            record = json.loads(raw)
        except ValueError:
            continue
        note = record.get("note") if isinstance(record, dict) else None
        signed = _signed_by(note, signer) if isinstance(note, str) else None
        if signed is not None and (best is None or signed.checkpoint.size > best.checkpoint.size):
            best = signed
    return best


def read_latest(log_path: Path, signer: Signer) -> SignedCheckpoint | None:
    """The latest checkpoint that ``signer``'s key signed, or None when there is none
    (no file, or one signed by another key: a rotated key starts afresh).

    The larger of ``<log>.checkpoint`` and the history's latest records: the latest
    file deleted, or replaced by an older checkpoint of the same key, must not let the
    daemon sign a history rewritten after that older one.

    Error handling: CheckpointRefused for a file that is not a checkpoint at all.
    """
    from_history = _latest_in_history(log_path, signer)
    try:
        note = checkpoint_path(log_path).read_text(encoding="utf-8")
    except FileNotFoundError:
        return from_history
    try:
        text, _ = open_note(note, [signer.verifier])
    except NoteError:
        return from_history
    try:
        checkpoint = parse_checkpoint(text)
    except CheckpointError as exc:
        raise CheckpointRefused(f"{checkpoint_path(log_path)} is not a checkpoint: {exc}") from None
    if from_history is not None and from_history.checkpoint.size > checkpoint.size:
        return from_history
    return SignedCheckpoint(note, checkpoint)


def read_history(log_path: Path) -> list[tuple[int, str]]:
    """Every ``(size, signed note)`` of the history file, in the order written; lines
    that are not records (a torn last line) are left out. Nothing here is verified."""
    records: list[tuple[int, str]] = []
    try:
        with history_path(log_path).open("rb") as file:
            for raw in file:
                try:
                    record = json.loads(raw)
                except ValueError:
                    continue
                if (
                    isinstance(record, dict)
                    and isinstance(record.get("size"), int)
                    and isinstance(record.get("note"), str)
                ):
                    records.append((record["size"], record["note"]))
    except FileNotFoundError:
        pass
    return records


def _latest_size(log_path: Path) -> int | None:
    """The size the latest checkpoint file names (unverified: only to order writers)."""
    try:
        text, _ = parse_note(checkpoint_path(log_path).read_text(encoding="utf-8"))
        return parse_checkpoint(text).size
    except (OSError, ValueError):
        return None


def write_checkpoint(log_path: Path, note: str, size: int, *, fsync: bool = True) -> None:
    """Append ``note`` to the history, then make it the latest (atomically) unless a
    newer one is there already.

    Two writers (the daemon and ``gatewayd audit checkpoint``) take turns on the
    history file's flock, so the latest only ever moves forward.
    """
    line = json.dumps({"size": size, "note": note}, separators=(",", ":")).encode() + b"\n"
    fd = os.open(
        history_path(log_path),
        os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_CLOEXEC | os.O_NOFOLLOW,
        FILE_MODE,
    )
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        write_all(fd, line)
        if fsync:
            os.fsync(fd)
        current = _latest_size(log_path)
        if current is None or size > current:
            _replace_latest(log_path, note, fsync=fsync)
    finally:
        os.close(fd)


def _replace_latest(log_path: Path, note: str, *, fsync: bool) -> None:
    latest = checkpoint_path(log_path)
    temporary = latest.with_name(latest.name + ".tmp")
    fd = os.open(
        temporary,
        os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC | os.O_NOFOLLOW,
        FILE_MODE,
    )
    try:
        write_all(fd, note.encode())
        if fsync:
            os.fsync(fd)
    finally:
        os.close(fd)
    os.replace(temporary, latest)
    if fsync:
        fsync_dir(latest.parent)


# -- the checkpointer --------------------------------------------------------------------

CheckpointHook = Callable[[str, Checkpoint], None]


class Checkpointer:
    """Signs the tree's checkpoints of one open log; see the module docstring."""

    def __init__(
        self,
        log: AuditLog,
        signer: Signer,
        *,
        fsync: bool = True,
        delay_s: float = CHECKPOINT_DELAY_S,
    ) -> None:
        self._log = log
        self._path = log.path
        self._signer = signer
        self._fsync = fsync
        self._delay_s = delay_s
        self._lock = threading.Lock()
        # Why signing stopped (the tree diverged from the latest checkpoint), or None.
        self.refused: str | None = None
        try:
            self.latest = read_latest(log.path, signer)
        except CheckpointRefused as exc:
            self.latest, self.refused = None, str(exc)
        # Told (on the trio thread) of every checkpoint once it is durable: the
        # witnesses' client. Must not block.
        self.on_checkpoint: list[CheckpointHook] = []
        self._run_ended_seq = 0
        self._wake = trio.Event()
        self._report: Callable[[str], None] = lambda _message: None
        log.on_run_ended = self._run_ended
        log.after_close.append(self._final)

    @property
    def origin(self) -> str:
        return self._signer.name

    @property
    def tree(self) -> TreeStore | None:
        return self._log.tree

    def consistency_proof(self, old_size: int, new_size: int) -> list[bytes]:
        """A consistency proof between two sizes of this log's tree (blocking: reads the
        node store)."""
        tree = self._log.tree
        if tree is None:
            raise ValueError(f"the Merkle tree is off: {self._log.tree_failure}")
        return tree.consistency_proof(old_size, new_size)

    def _run_ended(self, seq: int) -> None:
        self._run_ended_seq = max(self._run_ended_seq, seq)
        self._wake.set()

    def checkpoint_now(self) -> SignedCheckpoint | None:
        """Sign a checkpoint of the tree as it is, if it grew since the latest (blocking:
        run it in a worker thread). Returns it, or None when there was nothing new.

        Error handling: CheckpointRefused when the tree is not consistent with the
        latest checkpoint this key signed (``refused`` keeps the reason); OSError from
        writing passes through.
        """
        tree = self._log.tree
        if tree is None:
            return None
        with self._lock:
            if self.refused is not None:
                raise CheckpointRefused(self.refused)
            size, root = tree.head()
            latest = self.latest.checkpoint if self.latest is not None else None
            if latest is not None:
                if size == latest.size and root == latest.root:
                    return None
                self._check_consistent(tree, latest, size, root)
            if self._fsync:
                tree.sync()  # the nodes a proof of this checkpoint will read
            checkpoint = Checkpoint(self._signer.name, size, root)
            note = sign_note(checkpoint.body(), [self._signer])
            write_checkpoint(self._path, note, size, fsync=self._fsync)
            self.latest = SignedCheckpoint(note, checkpoint)
            return self.latest

    def _check_consistent(
        self, tree: TreeStore, latest: Checkpoint, size: int, root: bytes
    ) -> None:
        why: str | None = None
        if size < latest.size:
            why = (
                f"the log holds {size} entries, but checkpoint {latest.size} was signed: "
                "entries were cut off"
            )
        else:
            try:
                proof = tree.consistency_proof(latest.size, size)
                verify_consistency(latest.size, size, latest.root, root, proof)
            except (ProofError, ValueError) as exc:
                why = f"the log is not an extension of checkpoint {latest.size}: {exc}"
        if why is not None:
            self.refused = (
                f"refusing to sign a checkpoint of {self._path}: {why}; the history was "
                "rewritten (run `gatewayd audit verify --checkpoint "
                f"{checkpoint_path(self._path)} --key VKEY {self._path}`)"
            )
            raise CheckpointRefused(self.refused)

    def _final(self) -> None:
        """At close (worker thread, after audit_close is durable): the last checkpoint."""
        try:
            self.checkpoint_now()
        except CheckpointRefused:
            pass  # reported when it first happened; stopping goes on
        except (OSError, TreeError) as exc:
            self._report(f"writing the last checkpoint of {self._path} failed: {exc}")

    async def checkpoint(self) -> SignedCheckpoint | None:
        """``checkpoint_now`` in a worker thread, then the hooks (on the trio thread)."""
        signed = await trio.to_thread.run_sync(self.checkpoint_now)
        if signed is not None:
            for hook in self.on_checkpoint:
                try:
                    hook(signed.note, signed.checkpoint)
                except Exception as exc:  # a hook's bug must not stop the checkpoints
                    self._report(f"a checkpoint hook failed: {exc!r}")
        return signed

    async def _tree_reaches(self, seq: int) -> None:
        """Wait (bounded) until the tree holds the entry ``seq`` (durable first)."""
        await self._log.durable(seq)
        with trio.move_on_after(TREE_CATCH_UP_S):
            while (tree := self._log.tree) is not None and tree.size < seq:
                await trio.sleep(TREE_POLL_S)

    async def run(
        self,
        report: Callable[[str], None],
        *,
        task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED,
    ) -> None:
        """Checkpoint at start, then within ``delay_s`` of new entries and at each run's
        end, until cancelled. ``report(message)`` is told of a refusal or a failed write
        (once per distinct message): the daemon logs it. Calls never wait for this."""
        last_report: str | None = None
        self._report = report

        async def attempt() -> None:
            nonlocal last_report
            try:
                await self.checkpoint()
            except (CheckpointRefused, OSError, TreeError) as exc:
                # TreeError: the flusher switched a failing tree off under us.
                message = (
                    str(exc)
                    if isinstance(exc, CheckpointRefused)
                    else f"writing a checkpoint of {self._path} failed: {exc}"
                )
                if message != last_report:
                    report(message)
                    last_report = message

        await self._tree_reaches(self._log.durable_seq)
        await attempt()
        task_status.started()
        while True:
            with trio.move_on_after(self._delay_s):
                await self._wake.wait()
            self._wake = trio.Event()
            if self._run_ended_seq:
                seq, self._run_ended_seq = self._run_ended_seq, 0
                try:
                    await self._tree_reaches(seq)
                except AuditWriteError:  # the log failed: nothing more will be written
                    return
            await attempt()
