"""``gatewayd audit verify --witness VKEY ... --quorum K``: that at least K of the named
witnesses cosigned a checkpoint of this log, and that the log matches every checkpoint
they cosigned.

The cosigned checkpoints are those kept beside the log (``<log>.witnessed/``, one per
witness: :mod:`gatewayd.audit.witnessing`) and any given with ``--checkpoint``. Each
must carry the log's signature (``--key``); each witness's cosignature on it must verify
(a cosignature by a named witness that does not verify fails the check: it was altered);
and the log's first ``size`` entries must have the checkpoint's root. A witness counts
once, whichever of its checkpoints it is; cosignatures by keys not named are ignored.

What it proves: k independent witnesses each saw, and checked the consistency of, a
history of which the log now on disk is an extension. A host root that rewrote the log
and re-signed checkpoints cannot make the witnesses' cosignatures match the rewrite.
"""

from __future__ import annotations

import base64
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from gatewayd.audit.checkpoint import Checkpoint, CheckpointError, parse_checkpoint
from gatewayd.audit.cosignature import CosignatureVerifier, open_witnessed
from gatewayd.audit.merkle import Frontier
from gatewayd.audit.note import NoteError, NoteVerifier
from gatewayd.audit.proofs import Leaf


@dataclass(frozen=True, slots=True)
class QuorumVerdict:
    """``ok`` when the quorum is met and no cosigned checkpoint contradicts the log."""

    ok: bool
    lines: tuple[str, ...]
    # Witness name -> (checkpoint size, cosignature time) of the checkpoint that counted.
    counted: dict[str, tuple[int, int]]


def _roots(leaves: Sequence[Leaf], sizes: set[int]) -> dict[int, bytes]:
    """The tree's root at each of ``sizes`` (those the log reaches), in one pass."""
    roots: dict[int, bytes] = {}
    frontier = Frontier()
    if 0 in sizes:
        roots[0] = frontier.root()
    for leaf in leaves[: max(sizes, default=0)]:
        frontier.append(leaf.hash)
        if frontier.size in sizes:
            roots[frontier.size] = frontier.root()
    return roots


def _when(timestamp: int) -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(timestamp))


#: The node store's leaves of seq ``first_seq`` up to a checkpoint's size, when the
#: signed root authenticates them (:func:`gatewayd.audit.proofs.authenticated_leaves`).
StoredLeaves = Callable[[Checkpoint, int], "list[bytes] | None"]


def _matches_partial(
    leaves: Sequence[Leaf], checkpoint: Checkpoint, first_seq: int, stored: StoredLeaves | None
) -> bool:
    """A log whose oldest segments were deleted matches a checkpoint when its entries
    from ``first_seq`` on are the store's authenticated leaves up to the checkpoint."""
    original = None if stored is None else stored(checkpoint, first_seq)
    if original is None or len(leaves) < len(original):
        return False
    return all(leaf.hash == old for leaf, old in zip(leaves, original, strict=False))


def check_quorum(
    leaves: Sequence[Leaf],
    notes: Sequence[tuple[str, str]],
    log_keys: Sequence[NoteVerifier],
    witnesses: Sequence[CosignatureVerifier],
    quorum: int,
    *,
    first_seq: int = 1,
    stored: StoredLeaves | None = None,
) -> QuorumVerdict:
    """Check the cosigned checkpoints ``notes`` (``(where from, note)``) against the
    log's ``leaves`` (:func:`gatewayd.audit.proofs.log_leaves`), which start at seq
    ``first_seq``: past 1 (retention deleted the oldest segments), each checkpoint is
    matched through the node store's leaves that its signed root authenticates
    (``stored``), as ``audit verify --checkpoint`` does.

    Error handling: none raised for a bad note or log: the verdict's lines say what is
    wrong; ValueError for a ``quorum`` outside 1..len(witnesses) (the caller's mistake).
    """
    if not 1 <= quorum <= len(witnesses):
        raise ValueError(f"--quorum {quorum} must be between 1 and the {len(witnesses)} witnesses")
    lines: list[str] = []
    failed = False
    opened = []
    for source, note in notes:
        try:
            witnessed = open_witnessed(note, log_keys, witnesses)
            checkpoint = parse_checkpoint(witnessed.text)
        except (NoteError, CheckpointError) as exc:
            # A cosignature of a named witness that fails lands here too: never skipped.
            lines.append(f"FAILED: {source}: {exc}")
            failed = True
            continue
        if witnessed.cosigned:
            opened.append((source, checkpoint, witnessed.cosigned))
    partial = first_seq > 1
    roots = {} if partial else _roots(leaves, {checkpoint.size for _, checkpoint, _ in opened})
    counted: dict[str, tuple[int, int]] = {}
    for source, checkpoint, cosigned in opened:
        names = ", ".join(sorted(cosigned))
        root = roots.get(checkpoint.size)
        if partial:
            matches = _matches_partial(leaves, checkpoint, first_seq, stored)
            why = (
                f"the log starts at seq {first_seq}, and its entries are not the ones the "
                "checkpoint covered, or the node store does not hold the deleted ones"
            )
        else:
            matches = root == checkpoint.root
            why = (
                f"the log holds {len(leaves)} entries"
                if root is None
                else f"its first {checkpoint.size} entries have another root"
            )
        if not matches:
            failed = True
            lines.append(
                f"FAILED: {source}: the log does not match the checkpoint of size "
                f"{checkpoint.size} (root {base64.b64encode(checkpoint.root).decode()}) that "
                f"{names} cosigned: {why}; the history was rewritten or cut after they saw it"
            )
            continue
        for name, timestamp in cosigned.items():
            best = counted.get(name)
            if best is None or checkpoint.size > best[0]:
                counted[name] = (checkpoint.size, timestamp)
    for name, (size, timestamp) in sorted(counted.items()):
        lines.append(
            f"witness {name}: cosigned the log's first {size} entries at {_when(timestamp)}"
        )
    missing = sorted({w.name for w in witnesses} - set(counted))
    if missing:
        lines.append(f"no valid cosignature matching the log from: {', '.join(missing)}")
    met = len(counted) >= quorum
    lines.append(
        f"{'OK' if met and not failed else 'FAILED'}: {len(counted)} of {len(witnesses)} "
        f"witnesses cosigned a checkpoint the log matches (quorum {quorum})"
    )
    return QuorumVerdict(ok=met and not failed, lines=tuple(lines), counted=counted)
