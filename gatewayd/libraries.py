"""The heavy libraries only some tools use, and how a daemon loads them off its event loop.

httpx and httpcore (``http.fetch``, the egress proxy of a run with a network section),
jsonschema with referencing and regex (the input schema of an MCP tool or of a tool
folder's tool), the MCP SDK (a declared MCP server's session) and wasmtime (a tool
folder's wasm tool) each cost tens of milliseconds or
more to import; `gatewayd run` with a policy that reaches none of them, and every client
command, should not pay for them. So the modules that use them import them where they
are used, and a daemon that will need one loads it first with :func:`load_off_loop`: in
a worker thread, before it serves the first call that needs it, so that no call waits
on an import made on the event loop (a serving daemon at its start, `gatewayd run`
before its command starts, for what its run's policy can reach).

Our own code, not a library's: Python's ``importlib.util.LazyLoader`` defers a module's
execution to its first attribute access, which would be on the event loop, at a call's
time, exactly what this avoids.

Thread safety: Python's import system locks each module while it executes, so a second
thread importing one that another thread is executing waits for it to finish; a name
enters ``_loaded`` only once its import has returned.
"""

from __future__ import annotations

import importlib
from collections.abc import Iterable
from typing import Final

import trio

# http.fetch (gatewayd.tools.http, gatewayd.pinned_backend) and the egress proxy
# (gatewayd.egress): the URL parser, the HTTP/1.1 connection, the trio network backend.
HTTP: Final = ("httpx", "httpcore", "httpcore._backends.trio", "h11")
# A schema checked with bounded regular expressions (gatewayd.mcp.schemas).
JSON_SCHEMA: Final = (
    "jsonschema",
    "jsonschema.exceptions",
    "jsonschema.protocols",
    "jsonschema.validators",
    "referencing",
    "referencing.exceptions",
    "regex",
)
# A declared MCP server's session (gatewayd.mcp.servers, at a server's first start):
# gatewayd's client with the MCP SDK it imports (its stdio client is our own, its
# streamable-HTTP one the SDK's), and what the SDK's HTTP transport imports at its first
# connection, under trio: the trio backends of httpcore2 (through its auto backend) and
# of anyio (the SDK's task groups and streams), truststore (its TLS context), and the
# idna codec (trio's getaddrinfo encodes even a numeric host with it, on the loop).
# Recorded from a daemon's first stdio and first remote call; it also needs JSON_SCHEMA.
MCP: Final = (
    "gatewayd.mcp.client",
    "mcp.client.streamable_http",
    "httpcore2",
    "httpcore2._backends.auto",
    "httpcore2._backends.trio",
    "anyio._backends._trio",
    "truststore",
    "encodings.idna",
)
# An app's manifest (APP.md), read by gatewayd.apps.manifest and .sections: at a run's
# start when its workspace has apps, and by the app tools (app_rules, install_app) at a
# call; regex finds the invisible characters it refuses (gatewayd.apps.problems).
MARKDOWN: Final = ("markdown_it", "regex")
# A wasm tool's engine and runner (gatewayd.runners.wasm): wasmtime's core and component
# APIs and its C bindings.
WASM: Final = ("wasmtime", "wasmtime.component", "wasmtime._bindings")

# The names whose import has returned, in any thread of this process.
_loaded: set[str] = set()


def load(modules: Iterable[str]) -> None:
    """Import each of ``modules`` in this thread (those not loaded yet).

    Error handling: ImportError (or whatever a module raises as it executes) as
    ``import`` raises it; the names imported before it stay loaded."""
    for name in modules:
        if name not in _loaded:
            importlib.import_module(name)
            _loaded.add(name)


def loaded(modules: Iterable[str]) -> bool:
    """Whether every one of ``modules`` has been loaded through :func:`load`."""
    return all(name in _loaded for name in modules)


async def load_off_loop(modules: Iterable[str]) -> None:
    """:func:`load` in a worker thread, unless every one of ``modules`` is loaded: the
    event loop never executes a module's import, and waits for one another thread is
    executing only in a worker thread too."""
    names = tuple(modules)
    if not loaded(names):
        await trio.to_thread.run_sync(load, names)
