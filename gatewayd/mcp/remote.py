"""What an MCP server gives, as both halves of gatewayd's MCP runner kind read it: one
tool of its ``tools/list`` and one ``tools/call`` answer, as plain frozen values (no SDK
type crosses into the gateway's tools, pins or audit)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True, slots=True, kw_only=True)
class RemoteTool:
    """One entry of a server's tools/list, as the server gave it."""

    name: str
    description: str  # "" when absent
    input_schema: dict[str, Any]
    title: str | None = None


@dataclass(frozen=True, slots=True, kw_only=True)
class RemoteResult:
    """One tools/call answer."""

    content: list[dict[str, Any]]  # MCP content blocks as JSON
    structured: dict[str, Any] | None  # structuredContent
    is_error: bool
