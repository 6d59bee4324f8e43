"""sandbox.query agrees with the file tools on every path of the path-traversal corpus.

Through a real daemon on real sockets: for each path, ``can_read`` is asked and then
fs.list and fs.read are called, ``can_write`` is asked and then fs.write is called. An
answer "allowed" for a path the tool then refuses (``policy_denied``/``invalid_args``),
or "refused" for a path the tool takes, fails; a refusal must carry the tool's code and
message word for word.

The corpus: every path of the lexical table and the traversal segments of
tests/unit/test_policy_decide.py, every escape of tests/unit/test_beneath.py built on
disk in the workspace (symlinks out, chains, magic links, dangling links), and the
on-disk cases the tools refuse by what a path is (hard links, FIFOs, sockets,
directories, files over the size limit, a suffix dodged through a symlink). Run under
both resolvers (openat2 and the no-symlink walk), and under a policy with nested grants
and suffix rules (where no symlink is followed) as well as a plain one (where openat2
follows symlinks inside the root), on the workspace itself (mode host) and on an
overlay session's merged view (mode overlay, where the grants point).
"""

from __future__ import annotations

import itertools
import os
import socket
from pathlib import Path
from typing import Any

import pytest

from gatewayd.hostpaths.beneath import Resolver, forced_resolver, openat2_available
from gatewayd.runs import Run
from tests.conftest import Gateway, frame, raw_exchange, request
from tests.unit.test_beneath import ESCAPES
from tests.unit.test_policy_decide import SEGMENTS, TABLE

REFUSALS = ("policy_denied", "invalid_args")

NESTED_POLICY = """
version: 1
name: query-nested
tools:
  allow: ["fs.*", "sandbox.query"]
filesystem:
  paths:
    workspace: {{root: ., mode: rw, suffixes: [.md, .txt, .json], max_file_bytes: 100}}
    ref: {{root: ref, mode: ro}}
    docs: {{root: {docs}, mode: ro, mount: /data/docs}}
workspace: {{mode: {mode}}}
limits:
  call_timeout_s: 10
  calls_per_second: 100000
  burst: 100000
  max_concurrent_calls: 64
"""

PLAIN_POLICY = """
version: 1
name: query-plain
tools:
  allow: ["fs.*", "sandbox.query"]
filesystem:
  paths:
    workspace: {{root: ., mode: rw, max_file_bytes: 100}}
    docs: {{root: {docs}, mode: ro, mount: /data/docs}}
workspace: {{mode: {mode}}}
limits:
  call_timeout_s: 10
  calls_per_second: 100000
  burst: 100000
  max_concurrent_calls: 64
"""


def _segment_paths() -> list[str]:
    """Every relative path of up to two traversal segments and every absolute one of
    one (the property tests' strategy, walked exhaustively at this depth)."""
    segments: list[str] = list(SEGMENTS.elements)  # type: ignore[attr-defined]
    paths = []
    for lead, longest in (("", 2), ("/", 1)):
        for count in range(1, longest + 1):
            for combo in itertools.product(segments, repeat=count):
                paths.append(lead + "/".join(combo))
    return paths


def build_tree(ws: Path, outside: Path, docs: Path) -> list[str]:
    """The workspace, the escapes built in it, and the paths that name them."""
    (ws / "sub").mkdir(parents=True)
    (ws / "file.txt").write_text("inside\n")
    (ws / "sub" / "inner.txt").write_text("inner\n")
    (ws / "notes.md").write_text("notes\n")
    (ws / "ref").mkdir()
    (ws / "ref" / "spec.md").write_text("# spec\n")
    (ws / "ref" / "any.bin").write_bytes(b"\x00bin")
    (ws / "d.md").mkdir()
    (ws / "big.md").write_text("x" * 500)
    (ws / "key.pem").write_text("KEY")
    (ws / "notes-link.md").symlink_to("key.pem")  # a suffix dodged through a link
    (ws / "inner-link.txt").symlink_to("sub/inner.txt")
    (ws / "sub-link").symlink_to("sub")
    os.link(ws / "file.txt", ws / "hard.txt")
    os.mkfifo(ws / "pipe.txt")
    sock = socket.socket(socket.AF_UNIX)
    sock.bind(str(ws / "sock.txt"))
    sock.close()
    (ws / "ref-link.md").symlink_to("ref/spec.md")  # into the nested read-only grant
    outside.mkdir()
    (outside / "secret.txt").write_text("OUTSIDE-SECRET")
    docs.mkdir()
    (docs / "guide.pdf").write_bytes(b"%PDF")
    paths = [
        "file.txt",
        "hard.txt",
        "pipe.txt",
        "sock.txt",
        "d.md",
        "d.md/new.md",
        "big.md",
        "key.pem",
        "notes-link.md",
        "inner-link.txt",
        "sub-link",
        "sub-link/inner.txt",
        "ref-link.md",
        "file.txt/below.md",
        "missing/deeper/new.md",
        "sub/new.txt",
        "/data/docs/guide.pdf",
        "/data/docs/missing.md",
    ]
    for build in ESCAPES:
        parts = build(ws, outside)
        paths.append("/workspace/" + "/".join(parts))
        paths.append("/workspace/" + "/".join((*parts, "planted.md")))
    return paths


async def call(run: Run, tool: str, args: dict[str, Any]) -> dict[str, Any]:
    [resp] = await raw_exchange(run.socket_path, frame(request(run, tool, args)))
    return resp


async def calls(run: Run, asked: list[tuple[str, dict[str, Any]]]) -> list[dict[str, Any]]:
    """The answers to ``asked``, sent at once on one connection (calls that change
    nothing may run in any order), in the order asked."""
    payload = b"".join(
        frame(request(run, tool, args, tcid=f"c{index}"))
        for index, (tool, args) in enumerate(asked)
    )
    answers = await raw_exchange(run.socket_path, payload, expect=len(asked))
    by_id = {answer["toolCallId"]: answer for answer in answers}
    return [by_id[f"c{index}"] for index in range(len(asked))]


def refused(resp: dict[str, Any]) -> bool:
    return not resp["ok"] and resp["errorCode"] in REFUSALS


async def check_reads(run: Run, paths: list[str]) -> None:
    asked = []
    for path in paths:
        asked += [
            ("sandbox.query", {"op": "can_read", "path": path}),
            ("fs.list", {"path": path}),
            ("fs.read", {"path": path}),
        ]
    answers = await calls(run, asked)
    for index, path in enumerate(paths):
        query, listed, read = answers[3 * index : 3 * index + 3]
        check_read(path, query, listed, read)


def check_read(
    path: str, query: dict[str, Any], listed: dict[str, Any], read: dict[str, Any]
) -> None:
    if not query["ok"]:  # the path itself is malformed: every tool refuses it alike
        assert query["errorCode"] == "invalid_args", (path, query)
        assert read["errorCode"] == listed["errorCode"] == "invalid_args", (path, read)
        return
    answer = query["value"]
    if listed["ok"]:
        assert answer["allowed"] and answer["type"] == "dir", (path, answer, listed)
        return
    assert answer["allowed"] is not refused(read), (path, answer, read)
    if refused(read):
        assert (answer["errorCode"], answer["reason"]) == (
            read["errorCode"],
            read["safeMessage"],
        ), path


async def check_write(run: Run, path: str) -> None:
    query = await call(run, "sandbox.query", {"op": "can_write", "path": path})
    written = await call(run, "fs.write", {"path": path, "content": "x"})
    if not query["ok"]:
        assert query["errorCode"] == written["errorCode"] == "invalid_args", (path, written)
        return
    answer = query["value"]
    assert answer["allowed"] is not refused(written), (path, answer, written)
    if refused(written):
        assert (answer["errorCode"], answer["reason"]) == (
            written["errorCode"],
            written["safeMessage"],
        ), path


@pytest.mark.parametrize("mode", ["host", "overlay"])
@pytest.mark.parametrize("resolver", [Resolver.OPENAT2, Resolver.WALK], ids=str)
@pytest.mark.parametrize("policy", [NESTED_POLICY, PLAIN_POLICY], ids=["nested", "plain"])
async def test_query_agrees_with_the_fs_tools_on_every_corpus_path(
    gateway: Gateway, short_tmp: Path, resolver: Resolver, policy: str, mode: str
) -> None:
    if resolver is Resolver.OPENAT2 and not openat2_available():
        pytest.skip("this kernel does not allow openat2")
    ws, docs = short_tmp / "ws", short_tmp / "docs"
    corpus = build_tree(ws, short_tmp / "outside", docs)
    corpus += [entry[0] for entry in TABLE]
    if policy is NESTED_POLICY:  # the grants the segments were chosen for
        corpus += _segment_paths()
    run = await gateway.create_run(ws, policy.format(docs=docs, mode=mode))
    # On overlay the grants point into the session's merged view, not the directory.
    assert (run.spec.grants[0].host_root == ws.resolve()) is (mode == "host")
    with forced_resolver(resolver):
        await check_reads(run, corpus)
        # Writes change the tree: each answer is checked against the call just after it.
        for path in corpus:
            await check_write(run, path)
    assert not (short_tmp / "outside" / "planted.md").exists()
