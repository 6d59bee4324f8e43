"""The pin store: each declared MCP server's approved tools, one file per server.

``<state_dir>/mcp/pins/<server>.json`` (:mod:`gatewayd.mcp.pinset` says what a file
holds and checks it). Files are written atomically (a crash leaves the old pins or the
new ones, never a mix) with mode 0600 in a 0700 directory: only gatewayd's user (root)
approves tools. A file is read whole, capped, and checked before any pin in it is
trusted; a file that fails a check refuses every tool of its server until the operator
pins again (fail closed: never the tools of a file someone edited).

Reads are cached by the file's identity and modification time, so a run's start costs a
``stat`` per server, and a pin written while the daemon runs is seen by the next run.
"""

from __future__ import annotations

import errno
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Final

from gatewayd.files import write_atomically
from gatewayd.inputfile import InputFileError, read_input_file
from gatewayd.mcp.pinset import (
    MAX_DESCRIPTION_CHARS,
    MAX_PINNED_TOOLS,
    MAX_SCHEMA_BYTES,
    PinFileError,
    PinSet,
    check_server_name,
    decode_pin_file,
    encode_pin_file,
)

# A pin file holds at most MAX_PINNED_TOOLS tools, each a bounded description and
# schema and a few short fields; twice that bound leaves room for JSON's escapes.
MAX_PIN_FILE_BYTES: Final = 2 * MAX_PINNED_TOOLS * (4 * MAX_DESCRIPTION_CHARS + MAX_SCHEMA_BYTES)
# Where pins live under the state directory.
PINS_SUBDIR: Final = Path("mcp") / "pins"


@dataclass(frozen=True, slots=True)
class _Cached:
    key: tuple[int, int, int, int]  # device, inode, size, mtime in ns
    pins: PinSet


class PinStore:
    """The pins of one gatewayd's servers, under ``state_dir``."""

    def __init__(self, state_dir: Path) -> None:
        self.directory = state_dir / PINS_SUBDIR
        self._cache: dict[str, _Cached] = {}

    def path(self, server: str) -> Path:
        """The pin file of ``server``. Error handling: PinError for a name that is not
        a server's (never a path outside the pin directory)."""
        return self.directory / f"{check_server_name(server)}.json"

    def load(self, server: str) -> PinSet | None:
        """``server``'s pins; None when it has none (never pinned).

        Error handling: PinFileError when the file cannot be read or fails a check
        (message: which file, what is wrong, how to pin again).
        """
        path = self.path(server)
        try:
            st = os.stat(path, follow_symlinks=False)
        except FileNotFoundError:
            self._cache.pop(server, None)
            return None
        except OSError as exc:
            raise PinFileError(f"the pin file {path} cannot be read: {exc.strerror}") from None
        key = (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns)
        cached = self._cache.get(server)
        if cached is not None and cached.key == key:
            return cached.pins
        try:
            data = read_input_file(path, max_bytes=MAX_PIN_FILE_BYTES, what="the pin file")
        except InputFileError as exc:
            if exc.errno == errno.ENOENT:  # removed between the stat and the open
                return None
            raise PinFileError(f"{exc}; pin the server again: gatewayd mcp pin {server}") from None
        pins = decode_pin_file(data, server=server, where=f"the pin file {path}")
        self._cache[server] = _Cached(key=key, pins=pins)
        return pins

    def save(self, pins: PinSet) -> Path:
        """Write ``pins`` as its server's pin file, atomically and durably.

        Error handling: OSError as the system reports it (the old file stays whole).
        """
        path = self.path(pins.server)
        path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
        write_atomically(path, encode_pin_file(pins), mode=0o600)
        self._cache.pop(pins.server, None)
        return path
