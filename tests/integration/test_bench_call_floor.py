"""bench/call_floor.py, the call path's floor that bench/gateway_rtt.py measures beside
gatewayd: it answers every framed request once, ok, with the request's id, and only
after that call's two entries are in its log as a valid hash chain (so the floor pays
what gatewayd's durable audit pays, and no less). Figures are not asserted."""

from __future__ import annotations

import json
import socket
import struct
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from gatewayd.audit.chain import GENESIS, follows, read_line
from tests.conftest import ROOT

HEADER = struct.Struct(">I")
START_TIMEOUT_S = 20.0


@pytest.fixture(scope="module")
def floor(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Path, Path]]:
    base = tmp_path_factory.mktemp("floor")
    path, audit = base / "floor.sock", base / "audit.jsonl"
    proc = subprocess.Popen([sys.executable, str(ROOT / "bench" / "call_floor.py"), path, audit])
    try:
        sys.path.insert(0, str(ROOT / "bench"))
        from harness import wait_for

        wait_for(path, START_TIMEOUT_S)
        yield path, audit
    finally:
        proc.kill()
        proc.wait()


def frame(call_id: str) -> bytes:
    body = json.dumps(
        {"v": 1, "runId": "x", "toolCallId": call_id, "tool": "time.now", "args": {}}
    ).encode()
    return HEADER.pack(len(body)) + body


def answers(sock: socket.socket, count: int) -> list[dict[str, object]]:
    buf = b""
    out: list[dict[str, object]] = []
    while len(out) < count:
        data = sock.recv(65536)
        assert data, "the floor closed the connection before answering"
        buf += data
        while len(buf) >= HEADER.size and len(buf) >= HEADER.size + HEADER.unpack_from(buf)[0]:
            size = HEADER.unpack_from(buf)[0]
            out.append(json.loads(buf[HEADER.size : HEADER.size + size]))
            buf = buf[HEADER.size + size :]
    return out


def test_every_call_is_answered_once_after_its_two_entries_are_chained(
    floor: tuple[Path, Path],
) -> None:
    path, audit = floor
    with socket.socket(socket.AF_UNIX) as one, socket.socket(socket.AF_UNIX) as two:
        one.connect(str(path))
        two.connect(str(path))
        one.sendall(b"".join(frame(f"a{i}") for i in range(5)))  # pipelined, one read
        two.sendall(frame("b0"))
        got = answers(one, 5) + answers(two, 1)
        # Each answer leaves after its flush: by then the log holds its entries.
        lines = audit.read_bytes().splitlines()
    assert [a["toolCallId"] for a in got] == [f"a{i}" for i in range(5)] + ["b0"]
    assert all(a["ok"] is True and isinstance(a["value"], dict) for a in got)
    assert len(lines) >= 12
    position = GENESIS
    for line in lines:
        sealed = read_line(line)
        assert follows(position, sealed)
        position = sealed.position
    kinds = [read_line(line).entry.kind for line in lines]
    assert kinds[:12] == ["call", "result"] * 6
