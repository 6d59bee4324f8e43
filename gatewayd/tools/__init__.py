"""Host tool runners, one module per family; :func:`builtin_tools` is the set gatewayd ships."""

from __future__ import annotations

from gatewayd.tools.clock import TIME_NOW
from gatewayd.tools.exec import SANDBOX_EXEC
from gatewayd.tools.fs.listing import FS_LIST, FS_STAT
from gatewayd.tools.fs.read import FS_READ
from gatewayd.tools.fs.write import FS_EDIT, FS_WRITE
from gatewayd.tools.http import HTTP_FETCH
from gatewayd.tools.model import MODEL_CHAT
from gatewayd.tools.query import SANDBOX_QUERY
from gatewayd.tools.registry import ToolRegistry
from gatewayd.tools.usage import SANDBOX_USAGE


def builtin_tools() -> ToolRegistry:
    """A registry of the built-in host tools: time.now, the fs.* file tools, model.chat,
    http.fetch, sandbox.exec, sandbox.query and sandbox.usage (a new one per call: a
    daemon or a test adds its own)."""
    return ToolRegistry(
        (
            TIME_NOW,
            FS_READ,
            FS_WRITE,
            FS_EDIT,
            FS_LIST,
            FS_STAT,
            MODEL_CHAT,
            HTTP_FETCH,
            SANDBOX_EXEC,
            SANDBOX_QUERY,
            SANDBOX_USAGE,
        )
    )
