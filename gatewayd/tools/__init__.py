"""Host tool runners, one module per family; :func:`builtin_tools` is the set gatewayd ships."""

from __future__ import annotations

from typing import Any

from gatewayd.tools.clock import TIME_NOW
from gatewayd.tools.exec import SANDBOX_EXEC
from gatewayd.tools.fs import FS_EDIT, FS_LIST, FS_READ, FS_STAT, FS_WRITE
from gatewayd.tools.http import HTTP_FETCH
from gatewayd.tools.model import MODEL_CHAT
from gatewayd.tools.registry import ToolSpec


def builtin_tools() -> dict[str, ToolSpec[Any]]:
    """The built-in host tools by name: time.now, the fs.* file tools, model.chat,
    http.fetch, sandbox.exec."""
    specs: tuple[ToolSpec[Any], ...] = (
        TIME_NOW,
        FS_READ,
        FS_WRITE,
        FS_EDIT,
        FS_LIST,
        FS_STAT,
        MODEL_CHAT,
        HTTP_FETCH,
        SANDBOX_EXEC,
    )
    return {spec.name: spec for spec in specs}
