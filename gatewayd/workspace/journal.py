"""A commit as a journal replayed forward, the steps the overlay and agentfs backends share.

Each backend writes its journal (``commit.journal``: the base and the operations) before
the base is touched, then :func:`apply_journal` applies it and finishes in the one order
crash recovery relies on (:mod:`gatewayd.workspace.commit_marker`): every operation
applied and the base fsync'ed, the applied marker written durably, the journal removed,
the delta removed, and last the marker unless the session store keeps it. What differs
per backend is passed in: how one operation is applied and how the delta is removed (the
overlay's upper directory and tmpfs; AgentFS's view, database and export).
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from pathlib import Path
from typing import Final

from gatewayd.workspace.commit_marker import (
    APPLIED_NAME,
    clear_marker,
    drop_journal,
    is_applied,
    mark_applied,
)
from gatewayd.workspace.session import DIR_FLAGS, WorkspaceError

JOURNAL_NAME: Final = "commit.journal"

# Applies one journal operation ``(op, rel)`` to the base open at ``base_fd`` from the
# delta exported at ``upper``; idempotent, as a replay may apply it again.
ApplyOperation = Callable[[int, Path, str, str], None]
# Removes the session's delta from its state directory (never the applied marker).
RemoveDelta = Callable[[Path], None]


def journal_operations(state_dir: Path, journal: dict[str, object]) -> list[list[str]]:
    """The operations of ``journal``. Error handling: :class:`WorkspaceError` when they
    are not a list (a journal not written by a commit)."""
    ops = journal["ops"]
    if not isinstance(ops, list):
        raise WorkspaceError(f"{state_dir / JOURNAL_NAME} is malformed")
    return ops


def load_journal(state_dir: Path) -> dict[str, object]:
    """The journal a commit left in ``state_dir`` (the caller saw it there)."""
    journal: dict[str, object] = json.loads((Path(state_dir) / JOURNAL_NAME).read_bytes())
    return journal


def apply_journal(
    state_dir: Path,
    base: Path,
    ops: list[list[str]],
    upper: Path,
    *,
    apply: ApplyOperation,
    remove_delta: RemoveDelta,
    keep_marker: bool,
) -> None:
    """Apply ``ops`` from ``upper`` to ``base``, then finish the commit (module doc)."""
    base_fd = os.open(base, DIR_FLAGS)
    try:
        for op, rel in ops:
            apply(base_fd, upper, op, rel)
        os.fsync(base_fd)
    finally:
        os.close(base_fd)
    # Before the journal goes: from here on recovery never applies it again.
    mark_applied(state_dir)
    finish_applied(state_dir, remove_delta=remove_delta, keep_marker=keep_marker)


def finish_applied(state_dir: Path, *, remove_delta: RemoveDelta, keep_marker: bool) -> None:
    """The steps after the applied marker: the journal removed, then the delta, then the
    marker itself unless ``keep_marker`` (the session store removes it with the session).
    Recovery runs them again when a crash cut them short: nothing is applied again."""
    drop_journal(state_dir, JOURNAL_NAME)
    remove_delta(state_dir)
    if not keep_marker:
        clear_marker(state_dir)


def commit_interrupted(state_dir: Path) -> bool:
    """Whether ``state_dir`` holds a commit a crash interrupted: its journal, or the
    applied marker."""
    return is_applied(state_dir) or (Path(state_dir) / JOURNAL_NAME).exists()


def prepare_create(
    base: Path, state_dir: Path, max_delta_bytes: object, recover: Callable[[Path], object]
) -> tuple[Path, Path]:
    """The real paths of ``base`` and ``state_dir`` for a new session, checked: a commit
    a crash interrupted in an existing ``state_dir`` is finished first (``recover``, the
    backend's) and a finished commit's marker dropped: the state directory is reused.

    Error handling: :class:`WorkspaceError` for a ``max_delta_bytes`` that is no limit
    or a ``base`` that is no directory.
    """
    if (problem := check_max_delta_bytes(max_delta_bytes)) is not None:
        raise WorkspaceError(problem)
    base = Path(os.path.realpath(base))
    if not base.is_dir():
        raise WorkspaceError(f"workspace base {base} is not a directory")
    state_dir = Path(os.path.realpath(state_dir))
    if state_dir.is_dir():
        recover(state_dir)
        (state_dir / APPLIED_NAME).unlink(missing_ok=True)
    return base, state_dir


def check_max_delta_bytes(value: object) -> str | None:
    """Why ``value`` is not a delta limit (a positive whole number of bytes, or None for
    no limit); None when it is one. The caller raises its own error with the reason."""
    if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value <= 0):
        return (
            f"max_delta_bytes must be a positive number of bytes or None (no limit), not {value!r}"
        )
    return None
