"""cogni-tool: the in-sandbox client of gatewayd (standard library only).

``from cogni_tool import Client`` for the library, ``cogni-tool`` for the command line.
The names below are loaded on first use, so ``cogni-tool --help`` or ``--version`` does
not pay for importing sockets and JSON.
"""

from __future__ import annotations

# Keep equal to [project] version in pyproject.toml (a test checks). Not read through
# importlib.metadata: that import alone costs more than the rest of cogni-tool's start.
__version__ = "0.1.0"

TYPE_CHECKING = False
if TYPE_CHECKING:
    from cogni_tool.client import EXIT_CODES as EXIT_CODES
    from cogni_tool.client import CallTimedOut as CallTimedOut
    from cogni_tool.client import Client as Client
    from cogni_tool.client import ClientError as ClientError
    from cogni_tool.client import CogniToolError as CogniToolError
    from cogni_tool.client import ConnectionFailed as ConnectionFailed
    from cogni_tool.client import NotConfigured as NotConfigured
    from cogni_tool.client import ProtocolError as ProtocolError
    from cogni_tool.client import RequestTooLarge as RequestTooLarge
    from cogni_tool.client import ToolError as ToolError

__all__ = [
    "EXIT_CODES",
    "CallTimedOut",
    "Client",
    "ClientError",
    "CogniToolError",
    "ConnectionFailed",
    "NotConfigured",
    "ProtocolError",
    "RequestTooLarge",
    "ToolError",
    "__version__",
]


def __getattr__(name: str) -> object:
    if name in __all__:
        from cogni_tool import client

        return getattr(client, name)
    raise AttributeError(f"module 'cogni_tool' has no attribute {name!r}")
