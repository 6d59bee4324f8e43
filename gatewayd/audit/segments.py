"""Segment files: how a rotated log is named on disk, and how to list it in order.

The log a daemon writes to is the *active* file (``audit.jsonl``). When it reaches its
size limit the writer renames it to the next *closed segment*, ``audit.jsonl.000001``,
``audit.jsonl.000002``, ... (numbered in the order they were closed, so the oldest
has the smallest number) and continues the same chain in a new active file. Readers
take the closed segments in number order, then the active file.

Every function takes the active file's path as a string or a ``pathlib.Path`` and
answers in the same kind: the readers (`gatewayd audit show|verify`) name their files
with strings, and start without importing pathlib (with the urllib.parse and ipaddress
it brings, a tenth of their start).
"""

from __future__ import annotations

import os
import re

# typing's flag without importing typing: the readers start without it
TYPE_CHECKING = False
if TYPE_CHECKING:
    from pathlib import Path, PurePath
    from typing import Final, TypeVar

    # A path as the caller gave it: the answers are of the same kind.
    P = TypeVar("P", str, Path)

# Six digits sort as text too; a log that outgrows a million segments just gets
# longer numbers (the pattern takes any count from six up).
SEGMENT_DIGITS: Final = 6


def _sibling(active: P, name: str) -> P:
    """The file ``name`` in the directory of ``active``, of the kind ``active`` is."""
    if isinstance(active, str):
        return os.path.join(os.path.dirname(active), name)
    return active.with_name(name)


def segment_path(active: P, number: int) -> P:
    """The closed segment ``number`` of the log whose active file is ``active``."""
    if number < 1:
        raise ValueError(f"segment numbers start at 1, not {number}")
    return _sibling(active, f"{os.path.basename(active)}.{number:0{SEGMENT_DIGITS}d}")


def _pattern(active: str | PurePath) -> re.Pattern[str]:
    name = os.path.basename(active)
    return re.compile(re.escape(name) + r"\.(\d{" + str(SEGMENT_DIGITS) + r",})")


def segment_number(active: str | PurePath, candidate: str | PurePath) -> int | None:
    """The number of ``candidate`` if it is a closed segment of ``active``, else None."""
    match = _pattern(active).fullmatch(os.path.basename(candidate))
    same_directory = os.path.dirname(active) == os.path.dirname(candidate)
    return int(match[1]) if match and same_directory else None


def list_segments(active: P) -> list[tuple[int, P]]:
    """The closed segments beside ``active``, oldest first: ``(number, path)``.

    Error handling: a missing directory is an empty list; other OSErrors pass through.
    """
    pattern = _pattern(active)
    try:
        names = os.listdir(os.path.dirname(active) or ".")
    except FileNotFoundError:
        return []
    found = [(int(m[1]), n) for n in names if (m := pattern.fullmatch(n))]
    return [(number, _sibling(active, name)) for number, name in sorted(found)]


def log_files(active: P) -> list[P]:
    """Every file of the log in chain order: the closed segments, then the active file
    (if it exists). Empty when there is no log at all."""
    files = [p for _, p in list_segments(active)]
    if os.path.exists(active):
        files.append(active)
    return files
