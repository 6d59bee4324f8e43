"""A remote MCP server for tests: the official SDK's server over streamable HTTP on
127.0.0.1:PORT (argv[1]), path /mcp, with one tool, ``echo``. Runs with the dev
virtualenv's python (it needs the SDK)."""

from __future__ import annotations

import sys

from mcp.server.mcpserver import MCPServer

server = MCPServer("remote-echo", log_level="WARNING")


@server.tool()
def echo(text: str) -> str:
    """Echo the text back."""
    return text


if __name__ == "__main__":
    server.run("streamable-http", host="127.0.0.1", port=int(sys.argv[1]))
