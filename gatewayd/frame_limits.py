"""How large a frame on a run's socket may be: the bounds an operator sets it within,
and how long an identifier in one may be.

Its own module, free of msgspec, so the command line can show and check the bounds
without importing the wire protocol (every `gatewayd` command builds the whole parser),
and the policy can bound its names by the wire's own limit.
"""

from __future__ import annotations

# typing's flag without importing typing: client commands start without it
TYPE_CHECKING = False
if TYPE_CHECKING:
    from typing import Final

# Large enough for a file page or a model answer, small enough that one connection
# cannot make the daemon buffer arbitrary amounts of memory before it can say no.
DEFAULT_MAX_FRAME_BYTES: Final = 1 << 20
# The range an operator may set it in: a frame must hold a request header, and more than
# 64 MiB per frame is not a tool call but a way to make the daemon buffer memory.
MIN_FRAME_BYTES: Final = 64
MAX_FRAME_BYTES: Final = 64 << 20
# Identifiers are echoed into audit lines and error messages: keep them short so a
# hostile caller cannot smuggle megabytes there (gatewayd.protocol checks them).
MAX_ID_CHARS: Final = 128
