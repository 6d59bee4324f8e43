"""The commit's ``applied`` marker, shared by the overlay and agentfs backends.

A commit writes its journal, applies it, then writes ``commit.applied`` (durably) before
it removes the journal and then the delta. For the session store (``keep_marker``) the
marker stays until the store has recorded the session committed and removes its
directory; a backend used on its own removes it last, leaving its state directory empty.
So recovery knows exactly what a crash left, whatever anyone did to the base since:

- journal, no marker: the apply may be part-way: replay the journal;
- marker (with or without the journal): everything was applied: drop the journal and
  the delta, never apply again (the operator may have edited the base since);
- neither, delta still there: the commit never began applying (the journal is written
  before the first write into the base): the session is as it was.
"""

from __future__ import annotations

import contextlib
from pathlib import Path
from typing import Final

from gatewayd.files import fsync_dir, write_atomically

APPLIED_NAME: Final = "commit.applied"


def mark_applied(state_dir: Path) -> None:
    """Record, durably, that the journal in ``state_dir`` is wholly applied."""
    write_atomically(Path(state_dir) / APPLIED_NAME, b"applied\n", 0o600)


def is_applied(state_dir: Path) -> bool:
    return (Path(state_dir) / APPLIED_NAME).is_file()


def clear_marker(state_dir: Path) -> None:
    """Remove the marker (durably): the commit's state directory is done with."""
    with contextlib.suppress(FileNotFoundError):
        (Path(state_dir) / APPLIED_NAME).unlink()
        fsync_dir(Path(state_dir), follow_symlinks=False)


def drop_journal(state_dir: Path, name: str) -> None:
    """Remove the applied journal ``name`` (durably: the marker says it is done)."""
    with contextlib.suppress(FileNotFoundError):
        (Path(state_dir) / name).unlink()
    fsync_dir(Path(state_dir), follow_symlinks=False)
