"""A client of the control socket for the commands that talk to a running
`gatewayd serve` (`gatewayd exec`, `gatewayd rules`, `gatewayd apps rules`): one JSON
request over HTTP/1.1 on the unix socket, standard library only."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any


def control_request(
    path: Path, method: str, target: str, body: object | None = None
) -> tuple[int, dict[str, Any]]:
    """One JSON request to the control socket at ``path``; (status, decoded body)."""
    import http.client
    import socket

    class UnixConnection(http.client.HTTPConnection):
        def connect(self) -> None:
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            sock.connect(os.fspath(path))
            self.sock = sock

    conn = UnixConnection("gatewayd")
    try:
        data = None if body is None else json.dumps(body).encode()
        headers = {"content-type": "application/json"} if data is not None else {}
        conn.request(method, target, body=data, headers=headers)
        response = conn.getresponse()
        raw = response.read()
    finally:
        conn.close()
    try:
        decoded = json.loads(raw)
    except ValueError:
        decoded = {"ok": False, "message": raw.decode(errors="replace")}
    return response.status, decoded if isinstance(decoded, dict) else {"ok": False}
