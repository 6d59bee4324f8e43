"""Checkpoints (C2SP tlog-checkpoint): the note text that commits to a tree head.

::

    <origin>
    <tree size, decimal, no leading zeros>
    <root hash, base64>
    [extension lines]

signed as a note (:mod:`gatewayd.audit.note`) by the log's key, whose name is the
origin. A checkpoint carries no time: two checkpoints of the same size and origin
are the same text.
"""

from __future__ import annotations

import base64
import binascii
import re
from dataclasses import dataclass
from typing import Final

from gatewayd.audit.merkle import HASH_SIZE

# The size line: decimal without leading zeros ("0" for an empty tree).
_SIZE = re.compile(r"0|[1-9][0-9]*")
# Sizes beyond 2**63 cannot be a real log; bounds the integer we parse.
MAX_TREE_SIZE: Final = (1 << 63) - 1


class CheckpointError(ValueError):
    """The text is not a checkpoint; the message says which line is wrong."""


@dataclass(frozen=True, slots=True)
class Checkpoint:
    """A tree head: the log's origin, its size and root hash, and extension lines."""

    origin: str
    size: int
    root: bytes
    extensions: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if not self.origin or "\n" in self.origin:
            raise CheckpointError("the origin must be one non-empty line")
        if not 0 <= self.size <= MAX_TREE_SIZE:
            raise CheckpointError(f"tree size {self.size} is out of range")
        if len(self.root) != HASH_SIZE:
            raise CheckpointError(f"the root hash must be {HASH_SIZE} bytes, not {len(self.root)}")
        for line in self.extensions:
            if not line or "\n" in line:
                raise CheckpointError("an extension line must be one non-empty line")

    def body(self) -> str:
        """The note text: origin, size, base64 root, extensions, each line ending in a
        newline."""
        lines = [self.origin, str(self.size), base64.b64encode(self.root).decode()]
        return "\n".join([*lines, *self.extensions]) + "\n"


def parse_checkpoint(text: str) -> Checkpoint:
    """Parse a checkpoint's note text (not a signed note: open it first).

    Error handling: CheckpointError naming the line that is wrong.
    """
    if not text.endswith("\n"):
        raise CheckpointError("a checkpoint's text ends in a newline")
    lines = text[:-1].split("\n")
    if len(lines) < 3:
        raise CheckpointError(
            f"a checkpoint has at least 3 lines (origin, size, root hash), this has {len(lines)}"
        )
    origin, size_text, root_text, *extensions = lines
    if not origin:
        raise CheckpointError("line 1 (the origin) is empty")
    if not _SIZE.fullmatch(size_text) or len(size_text) > 19:
        raise CheckpointError(f"line 2 (the tree size) is not a decimal number: {size_text!r}")
    try:
        root = base64.b64decode(root_text, validate=True)
    except binascii.Error:
        raise CheckpointError("line 3 (the root hash) is not base64") from None
    if len(root) != HASH_SIZE or base64.b64encode(root).decode() != root_text:
        raise CheckpointError(f"line 3 (the root hash) is not a base64 {HASH_SIZE}-byte hash")
    if any(not line for line in extensions):
        raise CheckpointError("an extension line is empty")
    return Checkpoint(origin, int(size_text), root, tuple(extensions))
