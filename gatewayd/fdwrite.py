"""Writing a whole buffer to a descriptor (``os.write`` may write less than it is given).

A module of its own, importing nothing but ``os`` and ``errno``: `gatewayd exec` prints
its command's output with it, and :mod:`gatewayd.files` (which re-exports it) loads
ctypes and pathlib, a tenth of a client command's start.
"""

from __future__ import annotations

import errno
import os


def write_all(fd: int, data: bytes) -> None:
    """Write all of ``data`` to ``fd``, however many writes it takes.

    Error handling: OSError as the system reports it (part of ``data`` may be written);
    ``EIO`` if a write makes no progress, which would otherwise loop for ever.
    """
    view = memoryview(data)
    while view:
        written = os.write(fd, view)
        if written <= 0:
            raise OSError(errno.EIO, "write made no progress")
        view = view[written:]
