"""Reading a file that someone else wrote: a policy, gatewayd's configuration, a calls
file to replay, a run spec. A regular file of bounded size, or a clear refusal.

``open()`` of a FIFO blocks until a writer comes (``gatewayd policy check`` on one hung
for good), and ``/dev/zero`` or a directory never make sense as a document. So the file
is opened non-blocking, must be a regular file by ``fstat`` of the descriptor actually
opened (not by a check of the path that a rename could outrun), and is read only up to
its cap.
"""

from __future__ import annotations

import os
import stat

# typing's flag without importing typing: client commands start without it
TYPE_CHECKING = False
if TYPE_CHECKING:
    from typing import Final

_OPEN_FLAGS: Final = os.O_RDONLY | os.O_NONBLOCK | os.O_NOCTTY | os.O_CLOEXEC
_READ_CHUNK: Final = 1 << 20


class InputFileError(Exception):
    """The file cannot be used; ``str(exc)`` says why (naming it by ``what``).

    ``errno``: the OS error when opening or reading failed (``ENOENT``: there is no
    such file), else None. ``too_large``: it holds more than the cap.
    """

    def __init__(self, message: str, *, errno: int | None = None, too_large: bool = False):
        super().__init__(message)
        self.errno = errno
        self.too_large = too_large


def read_input_file(path: str | os.PathLike[str], *, max_bytes: int, what: str) -> bytes:
    """The bytes of the regular file at ``path``, at most ``max_bytes`` of them.

    ``what`` names the file in messages ("the policy file").

    Error handling: :class:`InputFileError` when it cannot be opened, is not a regular
    file (a FIFO, a device, a socket, a directory) or holds more than ``max_bytes``.
    """
    try:
        fd = os.open(path, _OPEN_FLAGS)
    except OSError as exc:
        raise InputFileError(f"cannot read {what}: {exc.strerror}", errno=exc.errno) from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise InputFileError(f"{what} must be a regular file, not {_kind(st.st_mode)}")
        if st.st_size > max_bytes:
            raise InputFileError(f"{what} is larger than {max_bytes} bytes", too_large=True)
        chunks: list[bytes] = []
        total = 0
        while total <= max_bytes:
            chunk = os.read(fd, min(_READ_CHUNK, max_bytes + 1 - total))
            if not chunk:
                break
            chunks.append(chunk)
            total += len(chunk)
    except OSError as exc:
        raise InputFileError(f"cannot read {what}: {exc.strerror}", errno=exc.errno) from None
    finally:
        os.close(fd)
    if total > max_bytes:  # it grew while we read
        raise InputFileError(f"{what} is larger than {max_bytes} bytes", too_large=True)
    return b"".join(chunks)


def _kind(mode: int) -> str:
    if stat.S_ISDIR(mode):
        return "a directory"
    if stat.S_ISFIFO(mode):
        return "a FIFO"
    if stat.S_ISCHR(mode) or stat.S_ISBLK(mode):
        return "a device"
    if stat.S_ISSOCK(mode):
        return "a socket"
    return "a special file"
