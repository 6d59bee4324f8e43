"""What a reviewer checks offline: a log against a signed checkpoint, and proof bundles.

- :func:`log_leaves` reads the log's entries as the tree's leaves (every segment, seq
  order), as they are on disk now: a rewritten entry is a different leaf.
- :func:`verify_log_against` checks that the log's first ``size`` entries are exactly
  the ones a signed checkpoint committed to, and when they are not, names the first
  entry that differs (from the node store, when the signed root proves the store still
  holds the original leaves; else between the two nearest signed checkpoints of the
  history).
- An *inclusion bundle* (:func:`inclusion_bundle`) holds one entry's line, the signed
  checkpoint and the inclusion proof: enough to prove that this call was logged, to
  someone who must not see the rest of the log. A *consistency bundle* holds two signed
  checkpoints and the proof that the later extends the earlier.
  :func:`verify_bundle` checks either, with the log's verifier key, and nothing else.

Bundles are JSON objects; hashes are base64 (as in checkpoints and C2SP's APIs).
"""

from __future__ import annotations

import base64
import binascii
import json
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Final

from gatewayd.audit.checkpoint import Checkpoint, CheckpointError, parse_checkpoint
from gatewayd.audit.checkpointer import read_history
from gatewayd.audit.line import LineFormatError, body_hash, hashes_equal, unseal
from gatewayd.audit.merkle import (
    EMPTY_ROOT,
    HASH_SIZE,
    MAX_PROOF_HASHES,
    Frontier,
    ProofError,
    consistency_proof,
    inclusion_proof,
    leaf_hash,
    leaves_source,
    root_from_hashes,
    verify_consistency,
    verify_inclusion,
)
from gatewayd.audit.note import NoteError, NoteVerifier, open_note
from gatewayd.audit.query import read_log
from gatewayd.audit.treestore import TreeError, TreeStore, open_tree

INCLUSION_FORMAT: Final = "gatewayd-audit-inclusion/v1"
CONSISTENCY_FORMAT: Final = "gatewayd-audit-consistency/v1"
# A bundle holds one entry (at most 64 KiB), two notes and two proofs: 1 MiB is ample
# and bounds what a forged bundle makes us read.
MAX_BUNDLE_BYTES: Final = 1 << 20


class BundleError(ValueError):
    """A bundle that is malformed or does not prove what it claims; the message says
    which check failed."""


# -- the log's leaves -----------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Leaf:
    """One entry as a leaf: its seq, where it is, and its leaf hash."""

    seq: int
    segment: str
    line: int
    hash: bytes


@dataclass(slots=True)
class LogLeaves:
    """The log's entries in seq order from seq 1, and where that order broke (a gap,
    a log that does not start at seq 1), if it did."""

    leaves: list[Leaf] = field(default_factory=list)
    broken: str | None = None
    # The seq of the first leaf: 1, or (``partial=True``) where a log whose oldest
    # segments were deleted now starts.
    first_seq: int = 1


def _seq_of(raw: bytes) -> int | None:
    if not raw.startswith(b'{"seq":'):
        return None
    end = raw.find(b",", 7)
    digits = raw[7:end]
    return int(digits) if end > 7 and digits.isdigit() and len(digits) < 20 else None


def _sealed(raw: bytes) -> bool:
    try:
        body, claimed = unseal(raw)
    except LineFormatError:
        return False
    return hashes_equal(body_hash(body), claimed)


def log_leaves(log_path: Path, *, partial: bool = False) -> LogLeaves:
    """Every entry of the log as a leaf, seq 1 on (``partial``: from the log's first
    entry, whatever its seq, for a log whose oldest segments were deleted).

    The line that holds the next seq is the leaf, as it is on disk (an altered line is
    a different leaf). One exception: a line whose bytes do not match its own hash,
    followed by an intact line of the same seq, is a torn write the daemon recovered
    (the log keeps those bytes, but they were never an entry). A line whose seq is not
    the next one ends the walk (``broken`` says where): the tree needs every entry in
    order.
    """
    result = LogLeaves()
    expected = 1
    pending: tuple[str, int, bytes] | None = None  # a damaged line of seq `expected`

    def take(segment: str, line: int, raw: bytes) -> None:
        nonlocal expected
        result.leaves.append(Leaf(expected, segment, line, leaf_hash(raw)))
        expected += 1

    for record in read_log(log_path):
        seq = _seq_of(record.raw)
        if seq is None:
            continue  # torn bytes or a blank line: never an entry
        if pending is not None and not (seq == expected and _sealed(record.raw)):
            take(*pending)
        pending = None
        if partial and not result.leaves and pending is None and expected == 1:
            expected = result.first_seq = seq
        if seq != expected:
            if seq < expected:
                continue  # a torn copy or a repeat: the leaf already taken stands
            what = "the log starts" if expected == 1 else f"seq {expected - 1} is followed"
            result.broken = (
                f"{what} at seq {seq} ({record.segment} line {record.line}): "
                f"seq {expected}..{seq - 1} are not in the log"
            )
            return result
        if _sealed(record.raw):
            take(record.segment, record.line, record.raw)
        else:
            pending = (record.segment, record.line, record.raw)
    if pending is not None:
        take(*pending)
    return result


# -- a log against a checkpoint -------------------------------------------------------


@dataclass(frozen=True, slots=True)
class CheckpointVerdict:
    """The outcome of :func:`verify_log_against`: ``ok``, and the lines to print."""

    ok: bool
    lines: tuple[str, ...]
    first_diverging_seq: int | None = None


def open_checkpoint(note: str, verifiers: Sequence[NoteVerifier]) -> Checkpoint:
    """The checkpoint of a signed note, once a known key's signature is verified.

    Error handling: NoteError (bad or missing signature), CheckpointError (not a
    checkpoint).
    """
    text, _ = open_note(note, verifiers)
    return parse_checkpoint(text)


def _root(leaves: Sequence[Leaf], size: int) -> bytes:
    frontier = Frontier()
    for leaf in leaves[:size]:
        frontier.append(leaf.hash)
    return frontier.root()


def _where(leaf: Leaf) -> str:
    return f"seq {leaf.seq} ({leaf.segment} line {leaf.line})"


def authenticated_leaves(
    log_path: Path, checkpoint: Checkpoint, first_seq: int = 1
) -> list[bytes] | None:
    """The node store's leaves of seq ``first_seq`` to the checkpoint's size, when the
    signed root proves the store holds the leaves the checkpoint covered; else None.

    The root is recomputed from the stored *leaves*, not read from the store's upper
    levels: whoever rewrites the log can also rewrite the leaf file and leave the upper
    nodes (whose root the checkpoint signed) as they were."""
    try:
        store = open_tree(log_path, writable=False)
    except (OSError, TreeError):
        return None
    try:
        if store.size < checkpoint.size:
            return None
        original = store.leaves(0, checkpoint.size) if checkpoint.size else []
    except (OSError, TreeError, ValueError):
        return None
    finally:
        store.close()
    if not hashes_equal(root_from_hashes(original).hex(), checkpoint.root.hex()):
        return None
    return original[first_seq - 1 :]


def _first_difference(original: Sequence[bytes], leaves: Sequence[Leaf]) -> int | None:
    for index, old in enumerate(original):
        if index >= len(leaves) or leaves[index].hash != old:
            return index
    return None


def _diverging_from_store(
    log_path: Path, checkpoint: Checkpoint, leaves: Sequence[Leaf]
) -> int | None:
    """The index of the first leaf that differs from the node store's, when the signed
    root proves the store holds the leaves the checkpoint covered; else None."""
    original = authenticated_leaves(log_path, checkpoint)
    return None if original is None else _first_difference(original, leaves)


def _verify_partial(
    log_path: Path, checkpoint: Checkpoint, read: LogLeaves, head: str
) -> CheckpointVerdict:
    """A log whose oldest segments were deleted: its entries from its first seq on are
    checked against the node store's leaves, which the signed root authenticates."""
    first = read.first_seq
    gone = f"the log starts at seq {first} (the entries before it are gone: segments deleted?)"
    original = authenticated_leaves(log_path, checkpoint, first)
    if original is None:
        return CheckpointVerdict(
            False,
            (
                f"FAILED: {gone}, and the node store ({log_path.name}.tree) does not hold "
                f"the tree {head} signed, so the log cannot be checked against it",
            ),
        )
    index = _first_difference(original, read.leaves)
    if index is None:
        covered = max(checkpoint.size - first + 1, 0)
        return CheckpointVerdict(
            True,
            (
                f"OK (partial): {gone}; its {covered} entries up to seq {checkpoint.size} are "
                f"the ones {head} signed (the node store, which the signed root "
                "authenticates, holds the deleted ones' hashes)",
            ),
        )
    seq = first + index
    where = (
        _where(read.leaves[index])
        if index < len(read.leaves)
        else f"seq {seq}: the log ends at seq {first + len(read.leaves) - 1}"
    )
    return CheckpointVerdict(
        False,
        (
            f"FAILED: the log does not match {head}",
            f"  {gone}",
            f"  first diverging entry: {where}: it is not the entry the checkpoint covered",
        ),
        seq,
    )


def _bounds_from_history(
    log_path: Path,
    checkpoint: Checkpoint,
    leaves: Sequence[Leaf],
    verifiers: Sequence[NoteVerifier],
) -> tuple[int, int]:
    """The largest signed checkpoint of the history the log still matches, and the
    smallest it does not (``checkpoint``'s size at most): the first diverging entry
    lies between them."""
    good, bad = 0, checkpoint.size
    for size, note in read_history(log_path):
        if size > len(leaves) or size > bad or size <= good:
            continue
        try:
            signed = open_checkpoint(note, verifiers)
        except (NoteError, CheckpointError):
            continue
        if signed.origin != checkpoint.origin or signed.size != size:
            continue
        if _root(leaves, size) == signed.root:
            good = size
        else:
            bad = size
    return good, bad


def verify_log_against(
    log_path: Path, note: str, verifiers: Sequence[NoteVerifier]
) -> CheckpointVerdict:
    """Check the log against a signed checkpoint: its signature, then that the log's
    first ``size`` entries have the checkpoint's root.

    Error handling: none raised for a bad log or checkpoint (the verdict says what is
    wrong); OSError from reading the log passes through.
    """
    try:
        checkpoint = open_checkpoint(note, verifiers)
    except (NoteError, CheckpointError) as exc:
        return CheckpointVerdict(False, (f"FAILED: the checkpoint does not verify: {exc}",))
    read = log_leaves(log_path, partial=True)
    leaves = read.leaves
    head = f"checkpoint {checkpoint.origin} size {checkpoint.size}"
    if read.first_seq > 1:
        return _verify_partial(log_path, checkpoint, read, head)
    if len(leaves) >= checkpoint.size and _root(leaves, checkpoint.size) == checkpoint.root:
        more = len(leaves) - checkpoint.size
        return CheckpointVerdict(
            True,
            (
                f"OK: the log's first {checkpoint.size} entries are the ones {head} signed "
                f"(root {base64.b64encode(checkpoint.root).decode()}); {more} entries "
                "since",
            ),
        )
    lines = [f"FAILED: the log does not match {head}"]
    if read.broken is not None:
        lines.append(f"  the log's entries are not whole: {read.broken}")
    index = _diverging_from_store(log_path, checkpoint, leaves)
    if index is not None:
        seq = index + 1
        if index < len(leaves):
            lines.append(
                f"  first diverging entry: {_where(leaves[index])}: it is not the entry the "
                "checkpoint covered (the node store, which the signed root authenticates, "
                "holds the original's hash): the history was rewritten from there"
            )
        else:
            lines.append(
                f"  first diverging entry: seq {seq}: the log ends at seq {len(leaves)}, "
                f"but the checkpoint covered {checkpoint.size} entries: entries were cut off"
            )
        return CheckpointVerdict(False, tuple(lines), seq)
    if len(leaves) < checkpoint.size:
        lines.append(
            f"  the log holds {len(leaves)} entries, the checkpoint covered "
            f"{checkpoint.size}: entries were cut off or a segment removed"
        )
    good, bad = _bounds_from_history(log_path, checkpoint, leaves, verifiers)
    if good:
        lines.append(
            f"  the log still matches the signed checkpoint of size {good}: the first "
            f"diverging entry is between seq {good + 1} and seq {bad} (the node store no "
            "longer holds the original leaves, so it cannot be named exactly)"
        )
    else:
        lines.append(
            f"  no signed checkpoint of the history matches the log: the first diverging "
            f"entry is at or before seq {bad}"
        )
    return CheckpointVerdict(False, tuple(lines), None)


# -- proofs from the log ----------------------------------------------------------------


class TreeReader:
    """The tree of a log for building proofs: the node store when it holds what is
    asked, else the tree rebuilt in memory from the log (a log whose daemon never kept
    a store, or a store another process is still writing)."""

    def __init__(self, log_path: Path) -> None:
        self._path = log_path
        self._store: TreeStore | None = None
        self._memory: list[bytes] | None = None
        try:
            self._store = open_tree(log_path, writable=False)
        except (OSError, TreeError):
            self._store = None

    def close(self) -> None:
        if self._store is not None:
            self._store.close()

    def _in_memory(self) -> list[bytes]:
        if self._memory is None:
            self._memory = [leaf.hash for leaf in log_leaves(self._path).leaves]
        return self._memory

    def _source(self, size: int) -> tuple[Any, int]:
        if self._store is not None and self._store.size >= size:
            return self._store, size
        hashes = self._in_memory()
        if len(hashes) < size:
            raise ValueError(f"the log holds {len(hashes)} entries, not {size}")
        return hashes, size

    def root_at(self, size: int) -> bytes:
        source, _ = self._source(size)
        if isinstance(source, TreeStore):
            return source.root_at(size)
        return leaves_source(source)(0, size) if size else EMPTY_ROOT

    def leaf(self, index: int) -> bytes:
        source, _ = self._source(index + 1)
        if isinstance(source, TreeStore):
            return source.leaf(index)
        return bytes(source[index])

    def inclusion_proof(self, index: int, size: int) -> list[bytes]:
        source, _ = self._source(size)
        if isinstance(source, TreeStore):
            return source.inclusion_proof(index, size)
        return inclusion_proof(index, size, leaves_source(source))

    def consistency_proof(self, old_size: int, new_size: int) -> list[bytes]:
        source, _ = self._source(new_size)
        if isinstance(source, TreeStore):
            return source.consistency_proof(old_size, new_size)
        return consistency_proof(old_size, new_size, leaves_source(source))


def entry_line(log_path: Path, seq: int) -> bytes:
    """The line of the log's entry ``seq`` (as a leaf: the line the tree took).

    Error handling: ValueError when the log has no entry of that seq.
    """
    for record in read_log(log_path, since_seq=seq):
        if _seq_of(record.raw) == seq and _sealed(record.raw):
            return record.raw
    raise ValueError(f"the log has no entry of seq {seq}")


def _b64(hashes: Sequence[bytes]) -> list[str]:
    return [base64.b64encode(h).decode() for h in hashes]


def inclusion_bundle(
    log_path: Path, seq: int, note: str, verifiers: Sequence[NoteVerifier]
) -> dict[str, Any]:
    """The inclusion bundle of entry ``seq`` against the signed checkpoint ``note``.

    The proof is checked before it is returned, so a node store that no longer matches
    the checkpoint is caught here, not by the one who receives the bundle.

    Error handling: ValueError (NoteError, CheckpointError, ProofError among them)
    saying what is wrong: a checkpoint that does not verify, a seq it does not cover,
    an entry that is not the one the checkpoint committed to.
    """
    checkpoint = open_checkpoint(note, verifiers)
    if not 1 <= seq <= checkpoint.size:
        raise ValueError(
            f"seq {seq} is not covered by the checkpoint (size {checkpoint.size}: seq 1 to "
            f"{checkpoint.size}); make a newer checkpoint (gatewayd audit checkpoint)"
        )
    line = entry_line(log_path, seq)
    reader = TreeReader(log_path)
    try:
        proof = reader.inclusion_proof(seq - 1, checkpoint.size)
    finally:
        reader.close()
    try:
        verify_inclusion(seq - 1, checkpoint.size, leaf_hash(line), proof, checkpoint.root)
    except ProofError as exc:
        raise ProofError(
            f"entry seq {seq} as the log holds it now is not the one the checkpoint "
            f"committed to: {exc}"
        ) from None
    return {
        "format": INCLUSION_FORMAT,
        "seq": seq,
        "index": seq - 1,
        "entry": line.decode("utf-8", "surrogateescape"),
        "checkpoint": note,
        "proof": _b64(proof),
    }


def consistency_bundle(
    log_path: Path, old_note: str, new_note: str, verifiers: Sequence[NoteVerifier]
) -> dict[str, Any]:
    """The consistency bundle between two signed checkpoints of this log.

    Error handling: ValueError saying what is wrong (a checkpoint that does not verify,
    sizes in the wrong order, a log that no longer extends the old checkpoint).
    """
    old = open_checkpoint(old_note, verifiers)
    new = open_checkpoint(new_note, verifiers)
    if old.origin != new.origin:
        raise ValueError(f"the checkpoints are of two logs: {old.origin} and {new.origin}")
    reader = TreeReader(log_path)
    try:
        proof = reader.consistency_proof(old.size, new.size)
    finally:
        reader.close()
    verify_consistency(old.size, new.size, old.root, new.root, proof)
    return {
        "format": CONSISTENCY_FORMAT,
        "old": old_note,
        "new": new_note,
        "proof": _b64(proof),
    }


# -- checking a bundle ----------------------------------------------------------------------


def _hashes(value: object) -> list[bytes]:
    if not isinstance(value, list) or len(value) > MAX_PROOF_HASHES:
        raise BundleError(f"'proof' must be a list of at most {MAX_PROOF_HASHES} base64 hashes")
    hashes: list[bytes] = []
    for number, item in enumerate(value):
        try:
            one = base64.b64decode(item, validate=True) if isinstance(item, str) else b""
        except binascii.Error:
            one = b""
        if len(one) != HASH_SIZE:
            raise BundleError(f"proof hash {number} is not a base64 {HASH_SIZE}-byte hash")
        hashes.append(one)
    return hashes


def _text(bundle: dict[str, Any], key: str) -> str:
    value = bundle.get(key)
    if not isinstance(value, str):
        raise BundleError(f"the bundle has no {key!r} text")
    return value


def load_bundle(data: bytes) -> dict[str, Any]:
    """A bundle file's JSON object.

    Error handling: BundleError for an oversize file or one that is not a JSON object.
    """
    if len(data) > MAX_BUNDLE_BYTES:
        raise BundleError(f"the bundle is {len(data)} bytes, more than {MAX_BUNDLE_BYTES}")
    try:
        bundle = json.loads(data)
    except ValueError as exc:
        raise BundleError(f"the bundle is not JSON: {exc}") from None
    if not isinstance(bundle, dict):
        raise BundleError("the bundle is not a JSON object")
    return bundle


def verify_bundle(bundle: dict[str, Any], verifiers: Sequence[NoteVerifier]) -> list[str]:
    """Check an inclusion or consistency bundle with the log's key alone; returns what
    it proves, as lines to print.

    Error handling: BundleError, NoteError, CheckpointError or ProofError (all
    ValueError) saying which check failed.
    """
    kind = bundle.get("format")
    if kind == INCLUSION_FORMAT:
        checkpoint = open_checkpoint(_text(bundle, "checkpoint"), verifiers)
        entry = _text(bundle, "entry")
        raw = entry.encode("utf-8", "surrogateescape")
        seq = _seq_of(raw)
        index = bundle.get("index")
        if seq is None or index != seq - 1:
            raise BundleError(
                f"the entry's seq ({seq}) and the bundle's index ({index}) do not agree"
            )
        if not _sealed(raw):
            raise BundleError(f"entry seq {seq} does not match its own hash: it was altered")
        verify_inclusion(
            seq - 1, checkpoint.size, leaf_hash(raw), _hashes(bundle.get("proof")), checkpoint.root
        )
        return [
            f"OK: entry seq {seq} is in the log {checkpoint.origin} as its checkpoint of "
            f"size {checkpoint.size} signed it",
            entry,
        ]
    if kind == CONSISTENCY_FORMAT:
        old = open_checkpoint(_text(bundle, "old"), verifiers)
        new = open_checkpoint(_text(bundle, "new"), verifiers)
        if old.origin != new.origin:
            raise BundleError(f"the checkpoints are of two logs: {old.origin} and {new.origin}")
        verify_consistency(old.size, new.size, old.root, new.root, _hashes(bundle.get("proof")))
        return [
            f"OK: the log {new.origin} at size {new.size} extends its checkpoint of size "
            f"{old.size}: nothing before seq {old.size + 1} was changed"
        ]
    raise BundleError(
        f"not a proof bundle: 'format' is {kind!r}, not {INCLUSION_FORMAT!r} or "
        f"{CONSISTENCY_FORMAT!r}"
    )
