"""Segment files: how a rotated log is named on disk, and how to list it in order.

The log a daemon writes to is the *active* file (``audit.jsonl``). When it reaches its
size limit the writer renames it to the next *closed segment*, ``audit.jsonl.000001``,
``audit.jsonl.000002``, ... (numbered in the order they were closed, so the oldest
has the smallest number) and continues the same chain in a new active file. Readers
take the closed segments in number order, then the active file.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Final

# Six digits sort as text too; a log that outgrows a million segments just gets
# longer numbers (the pattern takes any count from six up).
SEGMENT_DIGITS: Final = 6


def segment_path(active: Path, number: int) -> Path:
    """The closed segment ``number`` of the log whose active file is ``active``."""
    if number < 1:
        raise ValueError(f"segment numbers start at 1, not {number}")
    return active.with_name(f"{active.name}.{number:0{SEGMENT_DIGITS}d}")


def _pattern(active: Path) -> re.Pattern[str]:
    return re.compile(re.escape(active.name) + r"\.(\d{" + str(SEGMENT_DIGITS) + r",})")


def segment_number(active: Path, candidate: Path) -> int | None:
    """The number of ``candidate`` if it is a closed segment of ``active``, else None."""
    match = _pattern(active).fullmatch(candidate.name)
    return int(match[1]) if match and candidate.parent == active.parent else None


def list_segments(active: Path) -> list[tuple[int, Path]]:
    """The closed segments beside ``active``, oldest first: ``(number, path)``.

    Error handling: a missing directory is an empty list; other OSErrors pass through.
    """
    pattern = _pattern(active)
    try:
        names = [entry.name for entry in active.parent.iterdir()]
    except FileNotFoundError:
        return []
    found = [(int(m[1]), active.with_name(n)) for n in names if (m := pattern.fullmatch(n))]
    return sorted(found)


def log_files(active: Path) -> list[Path]:
    """Every file of the log in chain order: the closed segments, then the active file
    (if it exists). Empty when there is no log at all."""
    files = [p for _, p in list_segments(active)]
    if active.exists():
        files.append(active)
    return files
