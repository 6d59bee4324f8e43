"""The ids of the built-in host tools, as :func:`gatewayd.tools.builtin_tools` registers
them, spelt out for `gatewayd policy check`: it warns about a ``tools.allow`` entry that
matches no tool, and loading the tools themselves (the HTTP client, the model client,
the configuration they read) would cost it several times its own work.
tests/unit/test_cli_imports.py checks that the two agree.
"""

from __future__ import annotations

from typing import Final

BUILTIN_TOOL_IDS: Final[tuple[str, ...]] = (
    "time.now",
    "fs.read",
    "fs.write",
    "fs.edit",
    "fs.list",
    "fs.stat",
    "model.chat",
    "http.fetch",
    "sandbox.exec",
    "sandbox.query",
    "sandbox.usage",
)
