"""Fuzzing a live `gatewayd serve` with random and mutated frames.

10,000+ cases over real connections. Invariant (as h11 states its own): garbage
either decodes into a request or is answered with a protocol error frame, never
anything else — and the daemon stays up and still answers a well-formed request
correctly afterwards.
"""

from __future__ import annotations

import json
import socket
import struct
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from gatewayd.protocol import ErrorCode
from tests.conftest import OPEN_POLICY, write_policy
from tests.hypothesis_counts import examples
from tests.livedaemon import LiveDaemon, start_daemon

HEADER = struct.Struct(">I")
CODES = {c.value for c in ErrorCode}
FUZZ_CASES = 10_000


@pytest.fixture(scope="module")
def live(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[LiveDaemon, dict[str, Any]]]:
    import shutil
    import tempfile

    base = Path(tempfile.mkdtemp(prefix="cg-fz-", dir="/tmp"))
    ws = base / "ws"
    (ws / "docs").mkdir(parents=True)
    (ws / "notes.md").write_text("hello\n")
    policy = write_policy(base, OPEN_POLICY)
    daemon = start_daemon(base / "state")
    try:
        run = daemon.create_run(ws, policy)
        yield daemon, run
    finally:
        daemon.stop()
        shutil.rmtree(base, ignore_errors=True)


def exchange(sock_path: str, payload: bytes) -> list[dict[str, Any]]:
    """Send payload, half-close, read every response frame until the server closes."""
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.settimeout(20)
    s.connect(sock_path)
    try:
        try:
            s.sendall(payload)
            s.shutdown(socket.SHUT_WR)
        except (BrokenPipeError, ConnectionResetError):
            pass  # the server may close first (too_large); we still read what it sent
        buf = b""
        while True:
            try:
                data = s.recv(65536)
            except ConnectionResetError:
                break
            if not data:
                break
            buf += data
    finally:
        s.close()
    out = []
    while buf:
        assert len(buf) >= 4, f"torn frame from server: {buf!r}"
        (n,) = HEADER.unpack_from(buf)
        assert len(buf) >= 4 + n, "server sent a truncated frame"
        out.append(json.loads(buf[4 : 4 + n]))
        buf = buf[4 + n :]
    return out


def expected_answers(payload: bytes, max_frame: int = 1 << 20) -> int:
    """How many response frames the server owes for ``payload``: one per complete
    frame, and one too_large error (after which it closes) for an oversize header."""
    count, pos = 0, 0
    while len(payload) - pos >= 4:
        (n,) = HEADER.unpack_from(payload, pos)
        if n > max_frame:
            return count + 1
        if len(payload) - pos - 4 < n:
            break
        count += 1
        pos += 4 + n
    return count


def good(run: dict[str, Any], tcid: str = "ok1") -> dict[str, Any]:
    return {"v": 1, "runId": run["runId"], "toolCallId": tcid, "tool": "time.now", "args": {}}


json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=30),
    lambda inner: (
        st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4)
    ),
    max_leaves=12,
)


@st.composite
def payloads(draw: st.DrawFn, run_id: str) -> bytes:
    kind = draw(st.sampled_from(["random", "mutated", "fields", "lengths", "deep"]))
    valid = json.dumps(
        {"v": 1, "runId": run_id, "toolCallId": "f1", "tool": "time.now", "args": {}}
    ).encode()
    if kind == "random":
        return draw(st.binary(max_size=300))
    if kind == "deep":  # nesting deep enough to exhaust a recursive decoder
        depth = draw(st.integers(500, 20_000))
        opener, closer = draw(st.sampled_from([(b"[", b"]"), (b'{"a":', b"}")]))
        body = (
            b'{"v":1,"runId":"' + run_id.encode() + b'","toolCallId":"d1","tool":"time.now",'
            b'"args":{"x":' + opener * depth + b"1" + closer * depth + b"}}"
        )
        return HEADER.pack(len(body)) + body
    if kind == "mutated":
        data = bytearray(HEADER.pack(len(valid)) + valid)
        for _ in range(draw(st.integers(1, 6))):
            op = draw(st.sampled_from(["flip", "cut", "insert"]))
            if not data:
                break
            i = draw(st.integers(0, len(data) - 1))
            if op == "flip":
                data[i] ^= 1 << draw(st.integers(0, 7))
            elif op == "cut":
                del data[i:]
            else:
                data[i:i] = draw(st.binary(min_size=1, max_size=8))
        return bytes(data)
    if kind == "fields":
        obj = {
            "v": draw(st.one_of(st.just(1), json_values)),
            "runId": draw(st.one_of(st.just(run_id), json_values)),
            "toolCallId": draw(st.one_of(st.just("f1"), json_values)),
            "tool": draw(
                st.one_of(st.sampled_from(["time.now", "fs.read", "tools.list"]), json_values)
            ),
            "args": draw(st.one_of(st.just({}), json_values)),
        }
        for key in draw(st.lists(st.sampled_from(sorted(obj)), max_size=2)):
            obj.pop(key, None)
        body = json.dumps(obj).encode()
        return HEADER.pack(len(body)) + body
    body = draw(st.binary(max_size=64))
    length = draw(
        st.sampled_from([0, 1, 3, len(body), len(body) + 1, 1 << 20, (1 << 20) + 1, 2**32 - 1])
    )
    return HEADER.pack(length) + body


@pytest.mark.fuzz
def test_random_and_mutated_frames_never_crash_the_daemon(
    live: tuple[LiveDaemon, dict[str, Any]],
) -> None:
    daemon, run = live
    sock = run["socket"]

    @settings(
        max_examples=examples(FUZZ_CASES),
        deadline=None,
        database=None,
        suppress_health_check=list(HealthCheck),
    )
    @given(payloads(run["runId"]))
    def one_case(payload: bytes) -> None:
        responses = exchange(sock, payload)
        assert len(responses) == expected_answers(payload), "a frame went unanswered"
        for resp in responses:
            assert set(resp) <= {"v", "toolCallId", "ok", "value", "errorCode", "safeMessage"}
            assert resp["v"] == 1 and isinstance(resp["ok"], bool)
            if not resp["ok"]:
                assert resp["errorCode"] in CODES and resp["safeMessage"]

    one_case()
    assert daemon.alive(), "gatewayd died during fuzzing"
    [resp] = exchange(sock, HEADER.pack(len(b := json.dumps(good(run)).encode())) + b)
    assert resp["ok"] is True and resp["toolCallId"] == "ok1" and "iso" in resp["value"]
