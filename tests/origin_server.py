"""A plain HTTP origin on 127.0.0.1 for the tests whose sandboxed commands reach the
network through gatewayd's egress proxy: what reached it shows what the proxy let by."""

from __future__ import annotations

import contextlib
import http.server
import threading
from collections.abc import Iterator
from typing import Any

# How often the serving thread looks for shutdown (seconds): a test ends without waiting.
POLL_INTERVAL_S = 0.01


class QuietHandler(http.server.BaseHTTPRequestHandler):
    """A handler that keeps its request log off the test's output."""

    def log_message(self, format: str, *args: Any) -> None:
        pass


@contextlib.contextmanager
def serving(handler: type[http.server.BaseHTTPRequestHandler]) -> Iterator[int]:
    """``handler`` answering on 127.0.0.1 (threads of its own) until the block ends;
    yields the port."""
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    server.daemon_threads = True
    thread = threading.Thread(target=server.serve_forever, args=(POLL_INTERVAL_S,), daemon=True)
    thread.start()
    try:
        yield int(server.server_address[1])
    finally:
        server.shutdown()
        server.server_close()
