"""Load generator for the benchmarks: a separate process, standard library only, so
the client never competes with the server for the same interpreter.

    load.py SOCKET RUN_ID MODE latency N [TOOL]        N sequential calls on one
                                                       connection; prints the latencies
                                                       (seconds) as JSON
    load.py SOCKET RUN_ID MODE load CONNS SECS [TOOL]  CONNS connections, one call in
                                                       flight on each, for SECS; prints
                                                       {"calls", "seconds"}

MODE is `gateway` (responses are checked to be ok) or `echo`. TOOL is `time.now` (the
default) or `fs.write` (a one-byte file, one of 16 names, relative to /workspace).
"""

from __future__ import annotations

import json
import selectors
import socket
import struct
import sys
import time

HEADER = struct.Struct(">I")


# fs.write spreads its calls over this many files, so concurrent calls seldom write the
# same file while every call still replaces an existing one.
WRITE_FILES = 16


def request(run_id: str, i: int, tool: str = "time.now") -> bytes:
    args = {"path": f"bench-{i % WRITE_FILES}.txt", "content": "x"} if tool == "fs.write" else {}
    body = json.dumps(
        {"v": 1, "runId": run_id, "toolCallId": f"b{i}", "tool": tool, "args": args},
        separators=(",", ":"),
    ).encode()
    return HEADER.pack(len(body)) + body


def check(mode: str, frame: bytes) -> None:
    if mode == "gateway":
        msg = json.loads(frame[4:])
        if not msg.get("ok"):
            raise SystemExit(f"call failed: {msg!r}")


def take_frames(buf: bytearray) -> list[bytes]:
    out = []
    while len(buf) >= 4:
        (n,) = HEADER.unpack_from(buf)
        if len(buf) < 4 + n:
            break
        out.append(bytes(buf[: 4 + n]))
        del buf[: 4 + n]
    return out


def latency(path: str, run_id: str, mode: str, n: int, tool: str) -> None:
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.connect(path)
    lat = []
    buf = bytearray()
    for i in range(n):
        data = request(run_id, i, tool)
        t = time.perf_counter()
        s.sendall(data)
        frames: list[bytes] = []
        while not frames:
            chunk = s.recv(65536)
            if not chunk:
                raise SystemExit("server closed the connection")
            buf += chunk
            frames = take_frames(buf)
        lat.append(time.perf_counter() - t)
        check(mode, frames[0])
    print(json.dumps(lat))


def load(path: str, run_id: str, mode: str, conns: int, seconds: float, tool: str) -> None:
    sel = selectors.DefaultSelector()
    bufs: dict[socket.socket, bytearray] = {}
    for _ in range(conns):
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        s.connect(path)
        bufs[s] = bytearray()
    i = 0
    for s in bufs:
        s.sendall(request(run_id, i, tool))
        i += 1
        s.setblocking(False)
        sel.register(s, selectors.EVENT_READ)
    done = 0
    start = time.perf_counter()
    end = start + seconds
    while time.perf_counter() < end:
        for key, _ in sel.select(timeout=0.5):
            ready = key.fileobj
            assert isinstance(ready, socket.socket)
            s = ready
            chunk = s.recv(65536)
            if not chunk:
                raise SystemExit("server closed a connection")
            buf = bufs[s]
            buf += chunk
            for frame in take_frames(buf):
                check(mode, frame)
                done += 1
                s.setblocking(True)
                s.sendall(request(run_id, i, tool))
                s.setblocking(False)
                i += 1
    print(json.dumps({"calls": done, "seconds": time.perf_counter() - start}))


def main() -> None:
    path, run_id, mode, what = sys.argv[1:5]
    if what == "latency":
        tool = sys.argv[6] if len(sys.argv) > 6 else "time.now"
        latency(path, run_id, mode, int(sys.argv[5]), tool)
    else:
        tool = sys.argv[7] if len(sys.argv) > 7 else "time.now"
        load(path, run_id, mode, int(sys.argv[5]), float(sys.argv[6]), tool)


if __name__ == "__main__":
    main()
