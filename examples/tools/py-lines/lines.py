"""files.lines: how many lines each of the given workspace files has.

A process tool: gatewayd runs ``python3 /tool/lines.py`` in a fresh sandbox per call,
where the workspace's src/ directory is at /workspace/src (read-only: the manifest
declares "src" read; nothing else of the workspace is there) and this folder at /tool
(read-only), with no network and no gateway socket. The protocol is
the wasm tools': ``{"arguments": {...}}`` on stdin, one JSON value on stdout, exit 0; bad
arguments exit 2 with a sentence on stderr. A file that cannot be read is reported in
its entry (``error``), so one missing file does not lose the others' counts.
"""

from __future__ import annotations

import json
import os
import stat
import sys
from typing import Any, NoReturn

WORKSPACE = "/workspace"
# Files per call: a caller's list, not a tree walk.
MAX_PATHS = 100
# Read in blocks this big: any file size costs the same memory.
BLOCK_BYTES = 1 << 16
EXIT_BAD_INPUT = 2


def fail(message: str) -> NoReturn:
    print(f"files.lines: {message}", file=sys.stderr)
    raise SystemExit(EXIT_BAD_INPUT)


def count(rel: str) -> dict[str, Any]:
    if not isinstance(rel, str) or not rel:
        fail('each of "paths" must be a non-empty string')
    parts = [p for p in rel.split("/") if p not in ("", ".")]
    if rel.startswith("/") or ".." in parts:
        fail(f"{rel!r}: paths are relative to the workspace, without '..'")
    path = os.path.join(WORKSPACE, *parts)
    entry: dict[str, Any] = {"path": path}
    try:
        # O_NONBLOCK: a FIFO must not block the call; only a regular file is counted.
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
        with open(fd, "rb") as f:
            if not stat.S_ISREG(os.fstat(fd).st_mode):
                entry["error"] = "not a regular file"
                return entry
            lines, last = 0, b"\n"
            while block := f.read(BLOCK_BYTES):
                lines += block.count(b"\n")
                last = block[-1:]
            # A last line without a newline counts, as an editor shows it.
            entry["lines"] = lines + (last != b"\n")
    except OSError as exc:
        entry["error"] = exc.strerror or type(exc).__name__
    return entry


def main() -> None:
    try:
        document = json.load(sys.stdin)
    except (ValueError, UnicodeDecodeError):
        fail('the input is not one JSON value (expected {"arguments": {...}})')
    args = document.get("arguments") if isinstance(document, dict) else None
    if not isinstance(args, dict):
        fail('the input is not {"arguments": {...}}')
    paths = args.get("paths")
    if not isinstance(paths, list) or not paths or len(paths) > MAX_PATHS:
        fail(f'"paths" must be a list of 1 to {MAX_PATHS} workspace paths')
    files = [count(rel) for rel in paths]
    total = sum(entry.get("lines", 0) for entry in files)
    json.dump({"files": files, "total": total}, sys.stdout)


if __name__ == "__main__":
    main()
