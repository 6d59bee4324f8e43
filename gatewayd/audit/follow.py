"""``gatewayd audit tail [-f]``: the last entries, then each new one as it is written.

Following survives rotation: the follower holds the active file open and, once the
path names another file (the writer renamed the old one to a closed segment and
made a new one), it first reads what is left of the old file (the writer's last
lines before the rename), then every segment closed after it (several rotations
may fall between two polls), then the new active file from its start. The new
active file is opened *before* the segments are listed, so a rotation during the
catch-up cannot slip between them. Nothing is read twice and nothing is skipped. A
line still being written (no newline yet) waits for its end. Polling, not inotify:
a reviewer's tail needs no more, and it works on any filesystem.
"""

from __future__ import annotations

import collections
import os

from gatewayd.audit.line import MAX_LINE_BYTES, parse_object
from gatewayd.audit.query import Record, read_file
from gatewayd.audit.segments import list_segments

# typing's flag without importing typing: the readers start without it
TYPE_CHECKING = False
if TYPE_CHECKING:
    from collections.abc import Iterator
    from pathlib import PurePath
    from typing import BinaryIO, Final

# How often ``tail -f`` looks for new lines: quick enough to feel live.
POLL_INTERVAL_S: Final = 0.2


def _record(name: str, no: int, content: bytes) -> Record:
    return Record(name, no, content, parse_object(content))


class Follower:
    """Reads the log whose active file is ``path``: :meth:`last` once, then
    :meth:`poll` as often as wanted. Owns one open file; :meth:`close` it."""

    def __init__(self, path: str | PurePath) -> None:
        self.path = os.fspath(path)
        self._name = os.path.basename(self.path)
        self._file: BinaryIO | None = None
        self._ino: tuple[int, int] | None = None
        self._partial = b""
        self._lines = 0
        self._behind: tuple[int, int] | None = None  # renamed away, not caught up yet
        self.rotations = 0  # files followed into after the first (for tests)

    def _open(self) -> bool:
        try:
            file = open(self.path, "rb")  # noqa: SIM115 - held until close()
        except FileNotFoundError:
            return False  # between a rename and the new file (or no log yet)
        st = os.fstat(file.fileno())
        self._file, self._ino = file, (st.st_dev, st.st_ino)
        self._partial, self._lines = b"", 0
        return True

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None

    def last(self, count: int) -> list[Record]:
        """The last ``count`` records of the log (across segments); following starts
        right after them."""
        newest: collections.deque[Record] = collections.deque(maxlen=max(count, 0))
        if self._open():
            newest.extend(self._drain())
        if len(newest) >= count:
            return list(newest)
        older: list[Record] = []
        for _, segment in reversed(list_segments(self.path)):
            try:
                st = os.stat(segment)
            except FileNotFoundError:
                continue
            if (st.st_dev, st.st_ino) == self._ino:
                continue  # our own file, renamed by a rotation since we opened it
            older = [*collections.deque(read_file(segment), maxlen=count), *older]
            if len(older) + len(newest) >= count:
                break
        return ([*older, *newest])[-count:] if count else []

    def _drain(self) -> Iterator[Record]:
        """Complete lines from the current position to the end of the open file."""
        if self._file is None:
            return
        while True:
            chunk = self._file.readline(MAX_LINE_BYTES + 1)
            if not chunk:
                return
            if not chunk.endswith(b"\n") and len(self._partial) + len(chunk) <= MAX_LINE_BYTES:
                self._partial += chunk  # still being written: wait for its newline
                continue
            content = (self._partial + chunk).removesuffix(b"\n")
            self._partial = b""
            self._lines += 1
            yield _record(self._name, self._lines, content)

    def _catch_up(self, old: tuple[int, int]) -> list[Record]:
        """The segments closed after the file ``old`` (now a segment itself), up to the
        file we hold now."""
        out: list[Record] = []
        after = False
        for _, segment in list_segments(self.path):
            try:
                st = os.stat(segment)
            except FileNotFoundError:
                continue
            if (st.st_dev, st.st_ino) == self._ino:
                break  # the file we hold was rotated meanwhile: we read it through our fd
            if after:
                out += read_file(segment)
            after = after or (st.st_dev, st.st_ino) == old
        return out

    def _reopen(self) -> list[Record]:
        """Open the active file again and catch up on what was closed meanwhile."""
        if not self._open():
            return []  # mid-rotation: the new active file is not there yet
        behind, self._behind = self._behind, None
        out = self._catch_up(behind) if behind is not None else []
        return out + list(self._drain())

    def poll(self) -> list[Record]:
        """The records written since the last call (following rotations)."""
        if self._file is None:
            return self._reopen()
        out = list(self._drain())
        try:
            st = os.stat(self.path)
        except FileNotFoundError:
            st = None  # mid-rotation: renamed, the new active file not made yet
        if st is None or (st.st_dev, st.st_ino) != self._ino:
            out += self._drain()  # what the writer added before it renamed the file
            self._behind = self._ino
            self.close()
            self.rotations += 1
            return out + self._reopen()
        elif self._file is not None and st.st_size < self._file.tell():
            # Cut shorter under us (not something gatewayd does): start it again.
            self.close()
            if self._open():
                out += self._drain()
        return out
