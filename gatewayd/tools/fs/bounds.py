"""What every file tool works within: the files it declares, its path argument, the
size limit of one file (the grant's or the tool's), and a read bounded by it."""

from __future__ import annotations

import os
from typing import Annotated, Final

import msgspec

from gatewayd.errors import PolicyViolation
from gatewayd.policy.capabilities import EVERY_PATH, Capabilities, FileCapability
from gatewayd.policy.paths import MAX_PATH_BYTES, PathGrant, PathMode, ResolvedPath, shown

# fs.read scans the whole file (to count lines and check it is text) with a bounded
# buffer; without a grant limit, this bounds how long one call holds a worker thread.
TOOL_MAX_READ_FILE_BYTES: Final = 64 << 20
# Read size per system call while scanning.
READ_CHUNK_BYTES: Final = 64 << 10

READ_OPEN_FLAGS: Final = os.O_RDONLY | os.O_NONBLOCK | os.O_NOCTTY  # a FIFO must not block

PathArg = Annotated[
    str,
    msgspec.Meta(
        min_length=1,
        max_length=MAX_PATH_BYTES,  # characters here; the policy counts bytes
        description=(
            "File path as seen in the sandbox: absolute (e.g. /workspace/src/app.py) "
            "or relative to /workspace."
        ),
    ),
]

# What the file tools declare: any path, bounded by each run's grants.
READS_FILES: Final = Capabilities(files=(FileCapability(path=EVERY_PATH, mode=PathMode.RO),))
WRITES_FILES: Final = Capabilities(files=(FileCapability(path=EVERY_PATH, mode=PathMode.RW),))


def size_limit(grant: PathGrant, tool_cap: int) -> tuple[int, str]:
    """The byte limit for one file, and who sets it (for the message)."""
    if grant.max_file_bytes is not None and grant.max_file_bytes <= tool_cap:
        return grant.max_file_bytes, f"the limit for files in '{grant.visible_root}'"
    return tool_cap, "the gateway's limit for this tool"


def too_large(visible: str, size: int, limit: int, who: str) -> PolicyViolation:
    return PolicyViolation(f"'{shown(visible)}' is {size} bytes, over {who} of {limit} bytes")


def check_size(target: ResolvedPath, size: int, tool_cap: int) -> None:
    limit, who = size_limit(target.grant, tool_cap)
    if size > limit:
        raise too_large(target.visible, size, limit, who)


def read_up_to(fd: int, limit: int) -> bytes | None:
    """The rest of the file, or ``None`` if it holds more than ``limit`` bytes
    (it may have grown since ``fstat``)."""
    chunks: list[bytes] = []
    total = 0
    while chunk := os.read(fd, READ_CHUNK_BYTES):
        total += len(chunk)
        if total > limit:
            return None
        chunks.append(chunk)
    return b"".join(chunks)
