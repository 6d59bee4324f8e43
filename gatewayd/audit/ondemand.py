"""A checkpoint made on demand (``gatewayd audit checkpoint``), from the log alone.

It works whether or not a daemon is writing the log: the tree is rebuilt from the
log's entries (the durable ones only: up to the head file's seq), checked against
the latest checkpoint the key signed (a log never signs two inconsistent
checkpoints), then signed and written beside the log as the daemon's checkpointer
writes them (the history file's flock keeps the two apart). A checkpoint of a size
is the same text whoever makes it, and Ed25519 signatures are deterministic, so the
daemon and this command sign the same note for the same size.
"""

from __future__ import annotations

from pathlib import Path

from gatewayd.audit.checkpoint import Checkpoint
from gatewayd.audit.checkpointer import (
    CheckpointRefused,
    SignedCheckpoint,
    read_latest,
    write_checkpoint,
)
from gatewayd.audit.head import read_head
from gatewayd.audit.merkle import (
    Frontier,
    ProofError,
    consistency_proof,
    leaves_source,
    verify_consistency,
)
from gatewayd.audit.note import Signer, sign_note
from gatewayd.audit.proofs import log_leaves


def checkpoint_log(log_path: Path, signer: Signer, *, fsync: bool = True) -> SignedCheckpoint:
    """Sign and write a checkpoint of the log's durable entries; returns it.

    Error handling: CheckpointRefused when the log is not an extension of the latest
    checkpoint this key signed, or its entries are not whole (a gap); OSError from
    reading or writing passes through.
    """
    read = log_leaves(log_path)
    if read.broken is not None:
        raise CheckpointRefused(f"refusing to sign {log_path}: {read.broken}")
    hashes = [leaf.hash for leaf in read.leaves]
    head = read_head(log_path)
    if head is not None and head.seq < len(hashes):
        hashes = hashes[: head.seq]  # written, maybe not durable yet: not signed
    frontier = Frontier()
    for one in hashes:
        frontier.append(one)
    size, root = frontier.size, frontier.root()
    latest = read_latest(log_path, signer)
    if latest is not None:
        old = latest.checkpoint
        if size < old.size:
            raise CheckpointRefused(
                f"refusing to sign {log_path}: it holds {size} entries, but a checkpoint of "
                f"{old.size} was signed: entries were cut off"
            )
        try:
            proof = consistency_proof(old.size, size, leaves_source(hashes))
            verify_consistency(old.size, size, old.root, root, proof)
        except ProofError as exc:
            raise CheckpointRefused(
                f"refusing to sign {log_path}: it is not an extension of the checkpoint of "
                f"size {old.size} signed before: {exc}"
            ) from None
        if size == old.size:
            return latest
    checkpoint = Checkpoint(signer.name, size, root)
    note = sign_note(checkpoint.body(), [signer])
    write_checkpoint(log_path, note, size, fsync=fsync)
    return SignedCheckpoint(note, checkpoint)
