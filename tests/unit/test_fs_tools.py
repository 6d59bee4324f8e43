"""The fs.* tools on real directories, called through their registered Tools under trio."""

from __future__ import annotations

import base64
import itertools
import os
import re
import shutil
import socket
import stat
import tempfile
import threading
import time
from pathlib import Path, PurePosixPath
from typing import Any

import msgspec
import pytest
import trio
from hypothesis import given, settings
from hypothesis import strategies as st

from gatewayd.errors import (
    ArgumentsRejected,
    GatewayError,
    InvalidArguments,
    PolicyViolation,
    ToolFailed,
)
from gatewayd.hostpaths.beneath import Resolver, forced_resolver, openat2_available
from gatewayd.hostpaths.binding import bind_paths
from gatewayd.policy import Allow, Deny, RunRules, decide, load_policy_text
from gatewayd.policy.paths import PathAccess, PathGrant, PathMode, ResolvedPath
from gatewayd.tools import builtin_tools
from gatewayd.tools.fs import listing as fs_listing
from gatewayd.tools.fs.listing import Glob, ListArgs, list_dir
from gatewayd.tools.fs.read import (
    OUTPUT_HEADROOM_BYTES,
    LineWindow,
    ReadArgs,
    read_file,
    sniff_image,
)
from gatewayd.tools.fs.threads import in_thread_abandoned_on_cancel, in_thread_to_completion
from gatewayd.tools.fs.write import EditArgs, replace_file
from gatewayd.tools.registry import ToolContext
from tests.hypothesis_counts import examples

SECRET = "OUTSIDE-SECRET"
VISIBLE_ROOT = PurePosixPath("/workspace")
DEFAULT_OUTPUT = 1 << 20
PNG = b"\x89PNG\r\n\x1a\n" + bytes(range(256)) * 4
TOOLS = builtin_tools()


@pytest.fixture
def root(tmp_path: Path) -> Path:
    path = tmp_path / "root"
    path.mkdir()
    return path


@pytest.fixture
def outside(tmp_path: Path) -> Path:
    path = tmp_path / "outside"
    path.mkdir()
    (path / "secret.txt").write_text(SECRET)
    return path


def make_grant(
    host_root: Path, *, suffixes: tuple[str, ...] = (), max_file_bytes: int | None = None
) -> PathGrant:
    return PathGrant(
        name="workspace",
        host_root=host_root,
        root_id=(os.stat(host_root).st_dev, os.stat(host_root).st_ino),
        holds_nested=False,
        visible_root=VISIBLE_ROOT,
        mode=PathMode.RW,
        suffixes=suffixes,
        max_file_bytes=max_file_bytes,
    )


def resolve(grant: PathGrant, access: PathAccess) -> ResolvedPath:
    """What the policy hands the runner: the agent path mapped lexically onto the grant."""
    path = PurePosixPath(access.path)
    parts = path.parts[1:] if path.is_absolute() else (*VISIBLE_ROOT.parts[1:], *path.parts)
    below = tuple(p for p in parts[len(VISIBLE_ROOT.parts) - 1 :] if p not in ("", "."))
    return ResolvedPath(
        grant=grant,
        parts=below,
        visible=str(VISIBLE_ROOT.joinpath(*below)),
        access=access.access,
    )


async def call(
    tool: str,
    args: dict[str, Any],
    grant: PathGrant,
    *,
    max_output_bytes: int = DEFAULT_OUTPUT,
) -> dict[str, Any]:
    """Validate, ask what the call requests, resolve and run, as dispatch does."""
    spec = TOOLS[tool]
    typed = spec.decode(args)
    resolved = tuple(resolve(grant, access) for access in spec.requests(typed).paths)
    ctx = ToolContext(
        run_id="run-1", grants=(grant,), max_output_bytes=max_output_bytes, resolved=resolved
    )
    with trio.fail_after(10):
        result: dict[str, Any] = await spec.runner.run(typed, ctx)
    # Every result must be JSON on the wire.
    msgspec.json.encode(result)
    return result


def assert_safe(exc: GatewayError, tmp_path: Path) -> None:
    message = str(exc)
    assert str(tmp_path) not in message, "a host path leaked into a message"
    assert SECRET not in message


def tree(root: Path) -> list[str]:
    return sorted(str(p.relative_to(root)) for p in root.rglob("*"))


# --- the registry -------------------------------------------------------------------


def test_builtin_tools_are_exactly_these() -> None:
    assert set(TOOLS) == {
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
    }
    assert all(name == spec.name for name, spec in TOOLS.items())


@pytest.mark.parametrize("name", sorted(TOOLS))
def test_every_schema_describes_its_fields_and_forbids_unknown_ones(name: str) -> None:
    spec = TOOLS[name]
    schema = spec.manifest.args_schema
    body = schema["$defs"][schema["$ref"].rsplit("/", 1)[-1]]
    assert body["additionalProperties"] is False
    assert body.get("description")
    for prop in body.get("properties", {}).values():
        assert prop.get("description"), f"{name}: a field without a description"
    with pytest.raises(ArgumentsRejected):
        spec.decode({"path": "x", "nonsense": 1})


def test_schema_bounds_reject_out_of_range_arguments() -> None:
    with pytest.raises(msgspec.ValidationError, match="<= 20000"):
        msgspec.convert({"path": "a.txt", "limit": 20001}, ReadArgs)
    with pytest.raises(msgspec.ValidationError, match=">= 0"):
        msgspec.convert({"path": "a.txt", "offset": -1}, ReadArgs)
    with pytest.raises(msgspec.ValidationError, match="<= 10000"):
        msgspec.convert({"limit": 10001}, ListArgs)
    with pytest.raises(msgspec.ValidationError, match="length >= 1"):
        msgspec.convert({"path": "a.txt", "old": "", "new": "x"}, EditArgs)


def test_paths_name_what_each_call_touches() -> None:
    def paths(tool: str, args: dict[str, Any]) -> tuple[PathAccess, ...]:
        spec = TOOLS[tool]
        return spec.requests(spec.decode(args)).paths

    assert paths("fs.read", {"path": "a.txt"}) == (PathAccess(path="a.txt", access="read"),)
    assert paths("fs.write", {"path": "a.txt", "content": "héllo"}) == (
        PathAccess(path="a.txt", access="write", size=6),
    )
    assert paths("fs.write", {"path": "a.txt", "content": "x", "append": True}) == (
        PathAccess(path="a.txt", access="write", size=None),
    )
    assert paths("fs.edit", {"path": "a.txt", "old": "a", "new": "b"}) == (
        PathAccess(path="a.txt", access="read"),
        PathAccess(path="a.txt", access="write"),
    )
    assert paths("fs.list", {}) == (PathAccess(path=".", access="read", metadata_only=True),)
    assert paths("fs.stat", {"path": "d"}) == (
        PathAccess(path="d", access="read", metadata_only=True),
    )
    assert paths("time.now", {}) == ()


# --- fs.read ---------------------------------------------------------------------------


async def test_read_returns_text_with_line_counts(resolver: Resolver, root: Path) -> None:
    (root / "a.txt").write_text("one\ntwo\nthree")
    result = await call("fs.read", {"path": "a.txt"}, make_grant(root))
    assert result == {
        "type": "text",
        "path": "/workspace/a.txt",
        "content": "one\ntwo\nthree",
        "bytes": 13,
        "totalLines": 3,
        "offset": 0,
        "outputLines": 3,
        "truncated": False,
        "truncatedBy": None,
    }


async def test_read_pages_by_offset_and_limit_and_says_lines_were_cut(root: Path) -> None:
    (root / "a.txt").write_text("".join(f"line {i}\n" for i in range(10)))
    result = await call("fs.read", {"path": "a.txt", "offset": 3, "limit": 2}, make_grant(root))
    assert result["content"] == "line 3\nline 4\n"
    assert (result["outputLines"], result["totalLines"]) == (2, 10)
    assert (result["truncated"], result["truncatedBy"]) == (True, "lines")
    last = await call("fs.read", {"path": "a.txt", "offset": 8, "limit": 5}, make_grant(root))
    assert last["content"] == "line 8\nline 9\n"
    assert last["truncated"] is False


async def test_read_of_an_empty_file_is_empty_text(root: Path) -> None:
    (root / "empty.txt").write_bytes(b"")
    result = await call("fs.read", {"path": "empty.txt"}, make_grant(root))
    assert (result["content"], result["totalLines"], result["truncated"]) == ("", 0, False)


async def test_read_offset_past_the_end_is_invalid_and_says_the_line_count(root: Path) -> None:
    (root / "a.txt").write_text("a\nb\n")
    with pytest.raises(InvalidArguments) as caught:
        await call("fs.read", {"path": "a.txt", "offset": 2}, make_grant(root))
    assert str(caught.value) == (
        "offset 2 is past the end of '/workspace/a.txt', which has 2 lines; "
        "offsets are 0-based, so the last line is offset 1"
    )


async def test_read_caps_content_by_the_output_budget(root: Path) -> None:
    (root / "a.txt").write_text("x" * 99 + "\n" + "y" * 99 + "\n" + "z\n")
    cap = OUTPUT_HEADROOM_BYTES + len("/workspace/a.txt") + 150
    result = await call("fs.read", {"path": "a.txt"}, make_grant(root), max_output_bytes=cap)
    assert result["content"] == "x" * 99 + "\n"
    assert (result["truncatedBy"], result["outputLines"], result["totalLines"]) == ("bytes", 1, 3)
    assert len(msgspec.json.encode(result)) <= cap


async def test_read_of_one_huge_line_returns_the_prefix_that_fits(root: Path) -> None:
    (root / "a.txt").write_text('"' * 5000)  # every quote costs two bytes in JSON
    cap = OUTPUT_HEADROOM_BYTES + len("/workspace/a.txt") + 100
    result = await call("fs.read", {"path": "a.txt"}, make_grant(root), max_output_bytes=cap)
    assert result["content"] == '"' * 50
    assert result["truncatedBy"] == "bytes"


async def test_read_over_the_grant_limit_is_refused_with_size_and_limit(
    root: Path, tmp_path: Path
) -> None:
    (root / "big.txt").write_text("x" * 101)
    with pytest.raises(PolicyViolation) as caught:
        await call("fs.read", {"path": "big.txt"}, make_grant(root, max_file_bytes=100))
    assert str(caught.value) == (
        "'/workspace/big.txt' is 101 bytes, over the limit for files in '/workspace' of 100 bytes"
    )
    assert_safe(caught.value, tmp_path)


async def test_read_returns_images_as_base64(root: Path) -> None:
    (root / "pic.png").write_bytes(PNG)
    result = await call("fs.read", {"path": "pic.png"}, make_grant(root))
    assert result["type"] == "image"
    assert result["mimeType"] == "image/png"
    assert result["bytes"] == len(PNG)
    assert base64.b64decode(result["base64"]) == PNG


async def test_read_refuses_an_image_too_big_for_the_output_cap(root: Path) -> None:
    (root / "pic.png").write_bytes(PNG)
    cap = OUTPUT_HEADROOM_BYTES + len("/workspace/pic.png") + 400
    with pytest.raises(PolicyViolation) as caught:
        await call("fs.read", {"path": "pic.png"}, make_grant(root), max_output_bytes=cap)
    message = str(caught.value)
    assert f"image/png image of {len(PNG)} bytes" in message
    assert "more than the 400 bytes a tool result may hold" in message
    assert "images up to 300 bytes can be read" in message


@pytest.mark.parametrize(
    ("head", "mime"),
    [
        (b"\x89PNG\r\n\x1a\n....", "image/png"),
        (b"\xff\xd8\xff\xe0....", "image/jpeg"),
        (b"GIF89a......", "image/gif"),
        (b"GIF87a......", "image/gif"),
        (b"RIFF\x00\x00\x00\x00WEBP", "image/webp"),
        (b"RIFF\x00\x00\x00\x00WAVE", None),
        (b"plain text..", None),
    ],
)
def test_images_are_recognised_by_their_magic_bytes(head: bytes, mime: str | None) -> None:
    assert sniff_image(head) == mime


@pytest.mark.parametrize("data", [b"abc\x00def", b"caf\xe9 latin-1", b"ok\n" * 30000 + b"\xff"])
async def test_read_of_binary_reports_binary_without_content(root: Path, data: bytes) -> None:
    (root / "blob.bin").write_bytes(data)
    result = await call("fs.read", {"path": "blob.bin"}, make_grant(root))
    assert result["type"] == "binary"
    assert result["bytes"] == len(data)
    assert "content" not in result
    assert "UTF-8 text" in result["note"]


async def test_read_of_a_fifo_is_refused_and_does_not_block(resolver: Resolver, root: Path) -> None:
    os.mkfifo(root / "pipe")
    with pytest.raises(PolicyViolation) as caught:
        await call("fs.read", {"path": "pipe"}, make_grant(root))
    assert "FIFO" in str(caught.value)


async def test_read_of_a_hard_link_to_an_outside_file_is_refused(
    resolver: Resolver, root: Path, outside: Path, tmp_path: Path
) -> None:
    os.link(outside / "secret.txt", root / "hl.txt")
    with pytest.raises(PolicyViolation) as caught:
        await call("fs.read", {"path": "hl.txt"}, make_grant(root))
    assert "hard links" in str(caught.value)
    assert_safe(caught.value, tmp_path)


async def test_read_through_a_symlink_to_outside_is_refused(
    resolver: Resolver, root: Path, outside: Path, tmp_path: Path
) -> None:
    (root / "out").symlink_to(outside)
    (root / "link.txt").symlink_to(outside / "secret.txt")
    for path in ("out/secret.txt", "link.txt"):
        with pytest.raises(PolicyViolation) as caught:
            await call("fs.read", {"path": path}, make_grant(root))
        assert_safe(caught.value, tmp_path)


async def test_read_follows_an_inside_symlink_except_where_suffixes_are_enforced(
    root: Path,
) -> None:
    if not openat2_available():
        pytest.skip("this kernel does not allow openat2")
    (root / "key.pem").write_text("private")
    (root / "notes.md").symlink_to("key.pem")
    with forced_resolver(Resolver.OPENAT2):
        plain = await call("fs.read", {"path": "notes.md"}, make_grant(root))
        assert plain["content"] == "private"
        with pytest.raises(PolicyViolation) as caught:
            await call("fs.read", {"path": "notes.md"}, make_grant(root, suffixes=(".md",)))
    assert "'/workspace/notes.md' is a symlink" in str(caught.value)


async def test_read_of_missing_file_or_directory_fails_helpfully(root: Path) -> None:
    (root / "d").mkdir()
    with pytest.raises(
        ToolFailed, match=re.escape("'/workspace/nope.txt' does not exist; fs.list")
    ):
        await call("fs.read", {"path": "nope.txt"}, make_grant(root))
    with pytest.raises(ToolFailed, match=re.escape("'/workspace/d' is a directory; fs.list")):
        await call("fs.read", {"path": "d"}, make_grant(root))


def _lines(text: str) -> list[str]:
    pieces = text.split("\n")
    lines = [p + "\n" for p in pieces[:-1]]
    return [*lines, pieces[-1]] if pieces[-1] else lines


@settings(max_examples=examples(200), deadline=None)
@given(
    text=st.text(alphabet=st.sampled_from('ab\n"é\t'), max_size=200),
    cuts=st.lists(st.integers(min_value=0, max_value=400), max_size=6),
    offset=st.integers(min_value=0, max_value=40),
    limit=st.integers(min_value=1, max_value=40),
    budget=st.integers(min_value=0, max_value=300),
)
def test_line_window_is_an_exact_page_within_budget_however_bytes_arrive(
    text: str, cuts: list[int], offset: int, limit: int, budget: int
) -> None:
    data = text.encode()
    window = LineWindow(offset=offset, limit=limit, budget=budget)
    edges = sorted({0, len(data), *(c for c in cuts if c < len(data))})
    for start, end in itertools.pairwise(edges):
        window.feed(data[start:end])
    window.finish()
    lines = _lines(text)
    page = "".join(lines[offset : offset + limit])
    content = "".join(window.pieces)
    assert window.line_index == len(lines)
    assert len(msgspec.json.encode(content)) - 2 <= budget
    assert page.startswith(content)
    if window.truncated_by is None:
        assert content == page
        assert offset + limit >= len(lines)
    elif window.truncated_by == "lines":
        assert content == page
    else:
        assert content != page


# --- fs.write --------------------------------------------------------------------------


async def test_write_creates_the_file_and_its_parents(resolver: Resolver, root: Path) -> None:
    result = await call("fs.write", {"path": "a/b/c.txt", "content": "héllo"}, make_grant(root))
    assert result == {"path": "/workspace/a/b/c.txt", "bytes": 6, "created": True}
    assert (root / "a" / "b" / "c.txt").read_text() == "héllo"
    assert stat.S_IMODE((root / "a" / "b" / "c.txt").stat().st_mode) & 0o600 == 0o600


async def test_write_replaces_atomically_keeping_mode_and_leaving_no_temp_file(
    root: Path,
) -> None:
    target = root / "a.txt"
    target.write_text("old content")
    target.chmod(0o640)
    result = await call("fs.write", {"path": "a.txt", "content": "new"}, make_grant(root))
    assert result["created"] is False
    assert target.read_text() == "new"
    assert stat.S_IMODE(target.stat().st_mode) == 0o640
    assert tree(root) == ["a.txt"]


async def test_write_over_a_symlink_replaces_the_link_not_the_outside_file(
    resolver: Resolver, root: Path, outside: Path
) -> None:
    (root / "link.txt").symlink_to(outside / "secret.txt")
    result = await call("fs.write", {"path": "link.txt", "content": "mine"}, make_grant(root))
    assert result["created"] is False
    assert (outside / "secret.txt").read_text() == SECRET
    assert not (root / "link.txt").is_symlink()
    assert (root / "link.txt").read_text() == "mine"


async def test_write_through_a_symlinked_directory_to_outside_is_refused(
    resolver: Resolver, root: Path, outside: Path, tmp_path: Path
) -> None:
    (root / "out").symlink_to(outside)
    for path in ("out/new.txt", "out/deeper/new.txt"):
        with pytest.raises(PolicyViolation) as caught:
            await call("fs.write", {"path": path, "content": "x"}, make_grant(root))
        assert_safe(caught.value, tmp_path)
    assert tree(outside) == ["secret.txt"]


async def test_write_and_edit_through_an_inside_symlinked_directory_are_refused(
    resolver: Resolver, root: Path
) -> None:
    (root / "ro-docs").mkdir()
    (root / "ro-docs" / "a.txt").write_text("abc")
    (root / "alias").symlink_to("ro-docs")
    with pytest.raises(PolicyViolation, match="writes never go through a symlink"):
        await call("fs.write", {"path": "alias/new.txt", "content": "x"}, make_grant(root))
    with pytest.raises(PolicyViolation, match="writes never go through a symlink"):
        await call("fs.edit", {"path": "alias/a.txt", "old": "b", "new": "x"}, make_grant(root))
    assert tree(root / "ro-docs") == ["a.txt"]
    assert (root / "ro-docs" / "a.txt").read_text() == "abc"


async def test_write_to_a_hard_linked_file_is_refused_and_leaves_it_alone(
    resolver: Resolver, root: Path, outside: Path
) -> None:
    os.link(outside / "secret.txt", root / "hl.txt")
    for append in (False, True):
        with pytest.raises(PolicyViolation, match="is one of several hard links"):
            await call(
                "fs.write", {"path": "hl.txt", "content": "x", "append": append}, make_grant(root)
            )
    assert (outside / "secret.txt").read_text() == SECRET


async def test_write_onto_a_directory_or_a_fifo_is_refused(root: Path) -> None:
    (root / "d").mkdir()
    os.mkfifo(root / "pipe")
    with pytest.raises(ToolFailed, match="'/workspace/d' is a directory"):
        await call("fs.write", {"path": "d", "content": "x"}, make_grant(root))
    for append in (False, True):
        with pytest.raises(PolicyViolation, match="not a regular file"):
            await call(
                "fs.write", {"path": "pipe", "content": "x", "append": append}, make_grant(root)
            )


async def test_devices_are_neither_read_nor_written(resolver: Resolver, root: Path) -> None:
    try:
        os.mknod(root / "null", stat.S_IFCHR | 0o666, os.makedev(1, 3))
    except PermissionError:
        pytest.skip("making a device node needs CAP_MKNOD")
    with pytest.raises(PolicyViolation, match="is a device, not a regular file"):
        await call("fs.read", {"path": "null"}, make_grant(root))
    for append in (False, True):
        with pytest.raises(PolicyViolation, match="is a device, not a regular file"):
            await call(
                "fs.write", {"path": "null", "content": "x", "append": append}, make_grant(root)
            )
    assert stat.S_ISCHR(os.lstat(root / "null").st_mode)


async def test_append_creates_then_appends(resolver: Resolver, root: Path) -> None:
    grant = make_grant(root)
    first = await call("fs.write", {"path": "log.txt", "content": "a\n", "append": True}, grant)
    second = await call("fs.write", {"path": "log.txt", "content": "b\n", "append": True}, grant)
    assert (first["created"], second["created"]) == (True, False)
    assert second["bytes"] == 2
    assert (root / "log.txt").read_text() == "a\nb\n"


async def test_append_never_writes_through_a_symlink(
    resolver: Resolver, root: Path, outside: Path
) -> None:
    (root / "link.txt").symlink_to(outside / "secret.txt")
    with pytest.raises(PolicyViolation, match="symlink"):
        await call(
            "fs.write", {"path": "link.txt", "content": "x", "append": True}, make_grant(root)
        )
    assert (outside / "secret.txt").read_text() == SECRET


async def test_write_and_append_over_the_grant_limit_are_refused(root: Path) -> None:
    grant = make_grant(root, max_file_bytes=10)
    with pytest.raises(PolicyViolation, match=r"11 bytes, over the limit .* of 10 bytes"):
        await call("fs.write", {"path": "new/a.txt", "content": "x" * 11}, grant)
    assert tree(root) == []  # refused before any directory was made
    with pytest.raises(PolicyViolation, match="11 bytes, over the limit"):
        await call("fs.write", {"path": "new.txt", "content": "x" * 11, "append": True}, grant)
    assert tree(root) == []
    (root / "log.txt").write_text("12345678")
    with pytest.raises(PolicyViolation, match="11 bytes, over the limit"):
        await call("fs.write", {"path": "log.txt", "content": "abc", "append": True}, grant)
    assert (root / "log.txt").read_text() == "12345678"


async def test_write_of_unencodable_text_is_invalid_arguments(root: Path) -> None:
    with pytest.raises(InvalidArguments, match="unpaired surrogate"):
        await call("fs.write", {"path": "a.txt", "content": "bad \ud800"}, make_grant(root))


async def test_write_to_the_grant_root_itself_is_refused(root: Path) -> None:
    with pytest.raises(ToolFailed, match="root of a grant"):
        await call("fs.write", {"path": "/workspace", "content": "x"}, make_grant(root))


# --- fs.edit ---------------------------------------------------------------------------


async def test_edit_replaces_the_single_match(resolver: Resolver, root: Path) -> None:
    (root / "a.py").write_text("x = 1\ny = 2\n")
    (root / "a.py").chmod(0o600)
    result = await call(
        "fs.edit", {"path": "a.py", "old": "y = 2", "new": "y = 3"}, make_grant(root)
    )
    assert result == {"path": "/workspace/a.py", "replacements": 1, "bytes": 12}
    assert (root / "a.py").read_text() == "x = 1\ny = 3\n"
    assert stat.S_IMODE((root / "a.py").stat().st_mode) == 0o600
    assert tree(root) == ["a.py"]


async def test_edit_with_no_match_says_it_must_match_exactly(root: Path) -> None:
    (root / "a.py").write_text("x = 1\n")
    with pytest.raises(InvalidArguments) as caught:
        await call("fs.edit", {"path": "a.py", "old": "x=1", "new": "x=2"}, make_grant(root))
    assert "'old' was not found in '/workspace/a.py'" in str(caught.value)
    assert "exactly" in str(caught.value)
    assert (root / "a.py").read_text() == "x = 1\n"


@pytest.mark.parametrize(("text", "old", "count"), [("a a a", "a", 3), ("aaa", "aa", 2)])
async def test_edit_with_several_matches_asks_for_more_context(
    root: Path, text: str, old: str, count: int
) -> None:
    (root / "a.txt").write_text(text)
    with pytest.raises(InvalidArguments) as caught:
        await call("fs.edit", {"path": "a.txt", "old": old, "new": "b"}, make_grant(root))
    assert f"matches {count} times" in str(caught.value)
    assert "include more context" in str(caught.value)
    assert (root / "a.txt").read_text() == text


async def test_edit_does_not_follow_a_final_symlink(resolver: Resolver, root: Path) -> None:
    (root / "real.txt").write_text("abc")
    (root / "link.txt").symlink_to("real.txt")
    with pytest.raises(PolicyViolation, match="symlink"):
        await call("fs.edit", {"path": "link.txt", "old": "b", "new": "x"}, make_grant(root))
    assert (root / "real.txt").read_text() == "abc"


async def test_edit_refuses_hard_links_and_binary_files(root: Path, outside: Path) -> None:
    os.link(outside / "secret.txt", root / "hl.txt")
    with pytest.raises(PolicyViolation, match="hard links"):
        await call("fs.edit", {"path": "hl.txt", "old": "SECRET", "new": "x"}, make_grant(root))
    (root / "b.txt").write_bytes(b"\xff\xfe")
    with pytest.raises(
        ToolFailed, match=re.escape("not UTF-8 text; fs.edit edits text files only")
    ):
        await call("fs.edit", {"path": "b.txt", "old": "a", "new": "x"}, make_grant(root))


async def test_edit_result_over_the_limit_is_refused(root: Path) -> None:
    (root / "a.txt").write_text("abc")
    with pytest.raises(PolicyViolation, match="12 bytes, over the limit"):
        await call(
            "fs.edit",
            {"path": "a.txt", "old": "b", "new": "b" * 10},
            make_grant(root, max_file_bytes=11),
        )
    assert (root / "a.txt").read_text() == "abc"


def test_edit_refuses_to_write_when_the_file_changed_since_it_was_read(root: Path) -> None:
    (root / "a.txt").write_text("abc")
    grant = make_grant(root)
    target = resolve(grant, PathAccess(path="a.txt", access="write"))
    before = os.stat(root / "a.txt")
    # Someone else replaces the file between fs.edit's read and its write.
    (root / "a.txt.new").write_text("other")
    os.rename(root / "a.txt.new", root / "a.txt")
    fd = os.open(root, os.O_PATH | os.O_DIRECTORY)
    try:
        with pytest.raises(ToolFailed, match="changed while it was being edited"):
            replace_file(fd, "a.txt", b"x", target.visible, expected=(before.st_dev, before.st_ino))
    finally:
        os.close(fd)
    assert (root / "a.txt").read_text() == "other"


# --- fs.list ---------------------------------------------------------------------------


@pytest.fixture
def project(root: Path, outside: Path) -> Path:
    (root / "src").mkdir()
    (root / "src" / "app.py").write_text("print()\n")
    (root / "src" / "util.py").write_text("")
    (root / "docs" / "guide").mkdir(parents=True)
    (root / "docs" / "index.md").write_text("# hi\n")
    (root / "docs" / "guide" / "deep.md").write_text("deep\n")
    (root / "README.md").write_text("readme")
    (root / "out").symlink_to(outside)
    (outside / "leak.md").write_text(SECRET)
    return root


async def test_list_shows_the_directory_entries_with_types_and_sizes(
    resolver: Resolver, project: Path
) -> None:
    result = await call("fs.list", {}, make_grant(project))
    assert result == {
        "path": "/workspace",
        "entries": [
            {"path": "/workspace/README.md", "type": "file", "size": 6},
            {"path": "/workspace/docs", "type": "dir", "size": None},
            {"path": "/workspace/out", "type": "symlink", "size": None},
            {"path": "/workspace/src", "type": "dir", "size": None},
        ],
        "truncated": False,
    }


async def test_list_recursive_glob_never_follows_symlinks(
    resolver: Resolver, project: Path
) -> None:
    result = await call("fs.list", {"pattern": "**/*.md"}, make_grant(project))
    assert [e["path"] for e in result["entries"]] == [
        "/workspace/README.md",
        "/workspace/docs/guide/deep.md",
        "/workspace/docs/index.md",
    ]


async def test_list_of_a_subdirectory_with_a_nested_pattern(project: Path) -> None:
    result = await call(
        "fs.list", {"path": "/workspace/src", "pattern": "*.py"}, make_grant(project)
    )
    assert [e["path"] for e in result["entries"]] == [
        "/workspace/src/app.py",
        "/workspace/src/util.py",
    ]
    nested = await call("fs.list", {"pattern": "docs/*/*.md"}, make_grant(project))
    assert [e["path"] for e in nested["entries"]] == ["/workspace/docs/guide/deep.md"]


async def test_list_stops_at_the_limit_and_says_so(root: Path) -> None:
    for i in range(5):
        (root / f"f{i}.txt").write_text("")
    result = await call("fs.list", {"limit": 3}, make_grant(root))
    assert [e["path"] for e in result["entries"]] == [f"/workspace/f{i}.txt" for i in range(3)]
    assert result["truncated"] is True


async def test_list_stops_at_the_visit_cap_on_huge_trees(
    root: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(fs_listing, "LIST_MAX_VISITED_ENTRIES", 20)
    for d in range(5):
        (root / f"d{d}").mkdir()
        for i in range(10):
            (root / f"d{d}" / f"f{i}.py").write_text("")
    result = await call("fs.list", {"pattern": "**/*.py"}, make_grant(root))
    assert result["truncated"] is True
    assert 0 < len(result["entries"]) <= 20


async def test_list_stops_descending_at_the_depth_cap(
    root: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(fs_listing, "LIST_MAX_DEPTH", 3)
    (root / "a" / "b" / "c" / "d").mkdir(parents=True)
    result = await call("fs.list", {"pattern": "**"}, make_grant(root))
    assert [e["path"] for e in result["entries"]] == [
        "/workspace/a",
        "/workspace/a/b",
        "/workspace/a/b/c",
    ]
    assert result["truncated"] is True


@pytest.mark.parametrize("pattern", ["../*", "a/../b", "/etc/*", "a//b", "./x", "nul\0"])
async def test_list_refuses_patterns_that_could_leave_the_directory(
    root: Path, pattern: str
) -> None:
    with pytest.raises(InvalidArguments) as caught:
        await call("fs.list", {"pattern": pattern}, make_grant(root))
    assert "'**/*.md'" in str(caught.value)  # it shows what a good pattern looks like


async def test_list_of_a_file_or_through_an_outside_symlink_is_refused(
    resolver: Resolver, project: Path, tmp_path: Path
) -> None:
    with pytest.raises(
        ToolFailed, match=re.escape("is not a directory; fs.list lists directories")
    ):
        await call("fs.list", {"path": "README.md"}, make_grant(project))
    with pytest.raises(PolicyViolation) as caught:
        await call("fs.list", {"path": "out"}, make_grant(project))
    assert_safe(caught.value, tmp_path)


def test_glob_matches_like_a_shell_with_double_star_spanning_directories() -> None:
    def matches(pattern: str, path: str) -> bool:
        glob = Glob.parse(pattern)
        states = glob.start()
        for name in path.split("/"):
            states = glob.step(states, name)
        return glob.accepts(states)

    assert matches("*.py", "a.py")
    assert not matches("*.py", "src/a.py")
    assert matches("**/*.py", "a.py")
    assert matches("**/*.py", "src/deep/a.py")
    assert matches("src/**", "src/x/y")
    assert matches("**", "anything/at/all")
    assert not matches("src/*.py", "lib/a.py")
    assert matches("a/**/b", "a/b")
    assert matches("a/**/b", "a/x/y/b")


# --- fs.stat ---------------------------------------------------------------------------


async def test_stat_of_a_file_reports_type_size_mode_and_mtime(
    resolver: Resolver, root: Path
) -> None:
    (root / "a.txt").write_text("hello")
    (root / "a.txt").chmod(0o640)
    os.utime(root / "a.txt", ns=(0, 1_767_323_045_678_000_000))
    result = await call("fs.stat", {"path": "a.txt"}, make_grant(root))
    assert result == {
        "path": "/workspace/a.txt",
        "type": "file",
        "size": 5,
        "mtime": "2026-01-02T03:04:05.678Z",
        "mode": "0640",
    }


async def test_stat_reports_a_symlink_without_following_or_revealing_it(
    resolver: Resolver, root: Path, outside: Path, tmp_path: Path
) -> None:
    (root / "link").symlink_to(outside / "secret.txt")
    result = await call("fs.stat", {"path": "link"}, make_grant(root))
    assert result["type"] == "symlink"
    assert str(tmp_path) not in str(result)


async def test_stat_of_directories_and_the_grant_root(root: Path) -> None:
    (root / "d").mkdir()
    assert (await call("fs.stat", {"path": "d"}, make_grant(root)))["type"] == "dir"
    top = await call("fs.stat", {"path": "/workspace"}, make_grant(root))
    assert (top["path"], top["type"]) == ("/workspace", "dir")


async def test_stat_of_missing_path_or_outside_parent_fails_helpfully(
    resolver: Resolver, root: Path, outside: Path
) -> None:
    with pytest.raises(ToolFailed, match="'/workspace/nope' does not exist"):
        await call("fs.stat", {"path": "nope"}, make_grant(root))
    (root / "out").symlink_to(outside)
    with pytest.raises(PolicyViolation):
        await call("fs.stat", {"path": "out/secret.txt"}, make_grant(root))


# --- grants nested in a writable grant: pinned roots, no symlinks ----------------------

NESTED_POLICY = """
version: 1
name: nested
tools: {allow: ["fs.*"]}
filesystem:
  paths:
    workspace: {root: ., mode: rw}
    docs: {root: docs, mode: ro, suffixes: [.md], max_file_bytes: 100}
    out: {root: out, mode: rw}
"""


@pytest.fixture
def nested(root: Path) -> tuple[PathGrant, ...]:
    """The grants of a run whose rw workspace holds a ro ``docs`` and a rw ``out`` grant."""
    (root / "docs").mkdir()
    (root / "docs" / "guide.md").write_text("# guide\n")
    (root / "docs" / "key.pem").write_text("PRIVATE KEY\n")
    (root / "docs" / "big.md").write_text("x" * 5000)
    (root / "out").mkdir()
    return bind_paths(load_policy_text(NESTED_POLICY, "test"), root)


async def call_nested(
    tool: str, args: dict[str, Any], grants: tuple[PathGrant, ...]
) -> dict[str, Any]:
    """As dispatch does: validate, ask the pure policy, then run."""
    spec = TOOLS[tool]
    typed = spec.decode(args)
    decision = decide(
        tool,
        spec.requests(typed).paths,
        RunRules(tool_patterns=("fs.*",), run_tool_ids=None, grants=grants),
    )
    if isinstance(decision, Deny):
        raise decision.as_error()
    assert isinstance(decision, Allow)
    ctx = ToolContext(
        run_id="run-1", grants=grants, max_output_bytes=DEFAULT_OUTPUT, resolved=decision.resolved
    )
    with trio.fail_after(10):
        result: dict[str, Any] = await spec.runner.run(typed, ctx)
    return result


def test_bind_paths_pins_each_root_and_marks_the_grants_that_hold_others(
    root: Path, nested: tuple[PathGrant, ...]
) -> None:
    workspace, docs, out = nested
    for grant in nested:
        st = os.stat(grant.host_root)
        assert grant.root_id == (st.st_dev, st.st_ino)
    assert (workspace.holds_nested, docs.holds_nested, out.holds_nested) == (True, False, False)


SWAPPED_CALLS = [
    ("fs.read", {"path": "/workspace/docs/secret.md"}),
    ("fs.list", {"path": "/workspace/docs"}),
    ("fs.stat", {"path": "/workspace/docs/secret.md"}),
    ("fs.stat", {"path": "/workspace/docs"}),
    ("fs.read", {"path": "/workspace/out/secret.md"}),
    ("fs.write", {"path": "/workspace/out/planted.md", "content": "pwned"}),
    ("fs.write", {"path": "/workspace/out/secret.md", "content": "x", "append": True}),
    ("fs.edit", {"path": "/workspace/out/secret.md", "old": "SECRET", "new": "GONE"}),
    ("fs.list", {"path": "/workspace/out", "pattern": "**"}),
]


@pytest.mark.parametrize("how", ["symlink", "directory"])
@pytest.mark.parametrize(("tool", "args"), SWAPPED_CALLS)
async def test_a_nested_root_swapped_after_the_run_started_is_refused(
    resolver: Resolver,
    root: Path,
    outside: Path,
    tmp_path: Path,
    nested: tuple[PathGrant, ...],
    how: str,
    tool: str,
    args: dict[str, Any],
) -> None:
    # The agent owns the rw workspace: it moves the nested roots away and puts, in
    # their place, a symlink to a host directory or a directory of its own making.
    (outside / "secret.md").write_text(SECRET)
    for name in ("docs", "out"):
        (root / name).rename(tmp_path / f"moved-{name}")
        if how == "symlink":
            (root / name).symlink_to(outside)
        else:
            (root / name).mkdir()
            (root / name / "secret.md").write_text(SECRET)
    before = {p: p.read_text() for p in (outside / "secret.md", root / "out" / "secret.md")}
    with pytest.raises(PolicyViolation) as caught:
        await call_nested(tool, args, nested)
    visible = "/workspace/docs" if "/docs" in args["path"] else "/workspace/out"
    assert str(caught.value).startswith(
        f"the directory behind '{visible}' was replaced after the run started "
        "(by a symlink or another directory), so it is refused"
    )
    assert_safe(caught.value, tmp_path)
    assert {p: p.read_text() for p in before} == before
    assert sorted(os.listdir(outside)) == ["secret.md", "secret.txt"]


async def test_a_nested_root_still_in_place_works(
    resolver: Resolver, root: Path, nested: tuple[PathGrant, ...]
) -> None:
    read = await call_nested("fs.read", {"path": "/workspace/docs/guide.md"}, nested)
    assert read["content"] == "# guide\n"
    written = await call_nested("fs.write", {"path": "out/a.md", "content": "a"}, nested)
    assert written["created"] is True
    assert (root / "out" / "a.md").read_text() == "a"


@pytest.mark.parametrize(
    ("link", "target", "path", "symlink"),
    [
        ("lnk", "docs/key.pem", "/workspace/lnk", "/workspace/lnk"),
        ("lnkdir", "docs", "/workspace/lnkdir/key.pem", "/workspace/lnkdir"),
        ("lnkdir", "docs", "/workspace/lnkdir/big.md", "/workspace/lnkdir"),
    ],
)
async def test_no_symlink_is_read_through_in_a_grant_that_holds_another(
    resolver: Resolver,
    root: Path,
    nested: tuple[PathGrant, ...],
    link: str,
    target: str,
    path: str,
    symlink: str,
) -> None:
    # docs allows only .md files of at most 100 bytes; a link in the workspace to
    # docs/key.pem or docs/big.md would read them under the workspace's rules.
    (root / link).symlink_to(target)
    with pytest.raises(PolicyViolation) as caught:
        await call_nested("fs.read", {"path": path}, nested)
    message = str(caught.value)
    assert f"'{symlink}'" in message
    assert (
        "'/workspace' holds the directory of another path grant with its own rules, which "
        "a symlink could dodge, so no symlink is followed there: use the real path"
    ) in message
    if link == "lnkdir":
        with pytest.raises(PolicyViolation, match="no symlink is followed there"):
            await call_nested("fs.list", {"path": "/workspace/lnkdir"}, nested)


async def test_the_real_path_into_a_nested_grant_applies_its_rules(
    resolver: Resolver, nested: tuple[PathGrant, ...]
) -> None:
    with pytest.raises(PolicyViolation, match=r"Allowed suffixes: \.md"):
        await call_nested("fs.read", {"path": "/workspace/docs/key.pem"}, nested)
    with pytest.raises(PolicyViolation, match="over the limit for files in '/workspace/docs'"):
        await call_nested("fs.read", {"path": "/workspace/docs/big.md"}, nested)


async def test_a_grant_that_holds_no_other_still_follows_inside_symlinks(
    root: Path,
) -> None:
    if not openat2_available():
        pytest.skip("this kernel does not allow openat2 (the walk follows no symlink)")
    (root / "a.txt").write_text("target\n")
    (root / "lnk").symlink_to("a.txt")
    grants = bind_paths(
        load_policy_text(
            "version: 1\nname: flat\nfilesystem: {paths: {workspace: {root: ., mode: rw}}}\n",
            "test",
        ),
        root,
    )
    assert grants[0].holds_nested is False
    with forced_resolver(Resolver.OPENAT2):
        result = await call_nested("fs.read", {"path": "lnk"}, grants)
    assert result["content"] == "target\n"


# --- fs.stat is metadata: suffix rules do not refuse it --------------------------------


async def test_stat_of_directories_in_a_suffix_restricted_grant_is_allowed(
    root: Path, nested: tuple[PathGrant, ...]
) -> None:
    (root / "docs" / "sub").mkdir()
    for path in ("/workspace/docs", "/workspace/docs/sub"):
        result = await call_nested("fs.stat", {"path": path}, nested)
        assert (result["path"], result["type"]) == (path, "dir")
    # Contents still follow the rule.
    with pytest.raises(PolicyViolation, match=r"suffix not allowed.\nAllowed suffixes: .md"):
        await call_nested("fs.read", {"path": "/workspace/docs/key.pem"}, nested)


# --- cancellation: reads are abandoned, writes finish ------------------------------------


async def test_a_call_without_effect_answers_a_cancel_at_once_and_is_told_to_stop() -> None:
    started = threading.Event()
    stopped_seen = threading.Event()

    def slow(stop: threading.Event) -> dict[str, Any]:
        started.set()
        # Without abandon_on_cancel the cancel below would wait here for up to 5 s.
        if stop.wait(timeout=5):
            stopped_seen.set()
        return {}

    begin = time.monotonic()
    with trio.move_on_after(0.05) as scope:
        await in_thread_abandoned_on_cancel(slow)
    assert scope.cancelled_caught
    assert time.monotonic() - begin < 1
    assert started.is_set()
    assert await trio.to_thread.run_sync(stopped_seen.wait, 5)


async def test_a_call_with_effect_is_never_abandoned_midway(tmp_path: Path) -> None:
    done = tmp_path / "done"

    def write() -> dict[str, Any]:
        time.sleep(0.3)
        done.write_text("written")
        return {}

    with trio.move_on_after(0.02):
        await in_thread_to_completion(write)
    # The cancel came at 20 ms, but the answer waited until the write was over.
    assert done.read_text() == "written"


def test_an_abandoned_read_or_list_stops_at_its_next_step(root: Path) -> None:
    (root / "a.txt").write_text("line\n" * 100)
    (root / "d").mkdir()
    grant = make_grant(root)
    stop = threading.Event()
    stop.set()
    message = "the call was stopped (timed out or cancelled) before it finished"
    with pytest.raises(ToolFailed, match=re.escape(message)):
        read_file(ReadArgs(path="a.txt"), resolve(grant, read("a.txt")), DEFAULT_OUTPUT, stop=stop)
    with pytest.raises(ToolFailed, match=re.escape(message)):
        list_dir(ListArgs(path="."), resolve(grant, read(".")), stop=stop)
    # Not set: the same calls finish.
    unset = threading.Event()
    assert (
        read_file(
            ReadArgs(path="a.txt"), resolve(grant, read("a.txt")), DEFAULT_OUTPUT, stop=unset
        )["totalLines"]
        == 100
    )


def read(path: str) -> PathAccess:
    return PathAccess(path=path, access="read")


def test_repeated_double_stars_collapse_into_one() -> None:
    assert Glob.parse("/".join(["**"] * 300) + "/*.md").segments == ("**", "*.md")
    assert Glob.parse("a/**/**/b/**").segments == ("a", "**", "b", "**")
    glob = Glob.parse("**/**/**/x")
    states = glob.start()
    for name in ("p", "q", "r", "s"):
        states = glob.step(states, name)
        assert len(states) <= 2
    assert glob.accepts(glob.step(states, "x"))


# --- ownership: what the host tools make is owned like its directory ----------------


@pytest.mark.skipif(os.geteuid() != 0, reason="chown to another uid needs root")
async def test_new_files_and_directories_take_their_directorys_owner(root: Path) -> None:
    run_uid = 1_234_567  # a run's uid, as in a workspace lent to it
    os.chown(root, run_uid, run_uid)
    (root / "kept.txt").write_text("old\n")
    os.chown(root / "kept.txt", 7_654_321, 7_654_321)
    grant = make_grant(root)

    await call("fs.write", {"path": "new/deeper/made.txt", "content": "x"}, grant)
    await call("fs.write", {"path": "log.txt", "content": "a\n", "append": True}, grant)
    await call("fs.write", {"path": "kept.txt", "content": "new\n"}, grant)
    await call("fs.edit", {"path": "new/deeper/made.txt", "old": "x", "new": "y"}, grant)

    def owner(rel: str) -> tuple[int, int]:
        st = os.lstat(root / rel)
        return st.st_uid, st.st_gid

    for made in ("new", "new/deeper", "new/deeper/made.txt", "log.txt"):
        assert owner(made) == (run_uid, run_uid), made
    # A replaced file keeps its owner, as it keeps its mode.
    assert owner("kept.txt") == (7_654_321, 7_654_321)
    assert (root / "kept.txt").read_text() == "new\n"


async def test_files_in_a_directory_of_our_own_stay_ours(root: Path) -> None:
    await call("fs.write", {"path": "a/b.txt", "content": "x"}, make_grant(root))
    assert os.lstat(root / "a" / "b.txt").st_uid == os.geteuid()
    assert os.lstat(root / "a").st_uid == os.geteuid()


# --- fs.stat and fs.list tell nothing about what is outside a grant ----------------------

# Facts of an inode outside the grant, each one distinctive, so a leak is recognised
# wherever it turns up in a result.
OUTSIDE_SIZE = 31_337
OUTSIDE_MODE = 0o4751
OUTSIDE_MTIME_NS = 1_000_000_000_123_000_000
OUTSIDE_FACTS = ("31337", "4751", "2001-09-09T01:46:40.123Z")
# The entries' own facts, where they are the grant's own inodes.
INSIDE_MTIME_NS = 1_767_323_045_678_000_000
INSIDE_MTIME = "2026-01-02T03:04:05.678Z"
# A symlink's target as long as a name may be: its length must not show either.
LONG_TARGET = "/nonexistent/" + "t" * 242


def make_socket(path: Path) -> None:
    """A unix socket file at ``path``: bound in a short directory (sun_path holds 107
    bytes), then moved there (the same file system: pytest's tmp_path is under /tmp)."""
    short = Path(tempfile.mkdtemp(prefix="s", dir="/tmp"))
    try:
        with socket.socket(socket.AF_UNIX) as sock:
            sock.bind(str(short / "s"))
        os.rename(short / "s", path)
    finally:
        shutil.rmtree(short)


def make_device(path: Path, mode: int) -> None:
    """A character device node (the numbers of /dev/null; only its name is ever used)."""
    os.mknod(path, stat.S_IFCHR | mode, os.makedev(1, 3))


def plant_outside(outside: Path, kind: str) -> Path:
    """An inode of ``kind`` outside the grant, with the distinctive facts above."""
    path = outside / f"outside-{kind}"
    if kind == "file":
        path.write_bytes(b"x" * OUTSIDE_SIZE)
    elif kind == "fifo":
        os.mkfifo(path)
    elif kind == "socket":
        make_socket(path)
    elif kind == "device":
        make_device(path, 0o600)
    if kind == "symlink":
        path.symlink_to("/etc/" + "s" * 137)
    else:
        os.chmod(path, OUTSIDE_MODE)
    os.utime(path, ns=(OUTSIDE_MTIME_NS, OUTSIDE_MTIME_NS), follow_symlinks=False)
    return path


def plant_inside(path: Path, kind: str, outside: Path) -> None:
    """A single-link entry of ``kind`` at ``path``, with INSIDE_MTIME as its own time."""
    if kind == "fifo":
        os.mkfifo(path, 0o640)
    elif kind == "socket":
        make_socket(path)
        os.chmod(path, 0o750)
    elif kind == "device":
        make_device(path, 0o600)
    elif kind == "symlink-absolute":
        path.symlink_to(outside / "secret.txt")
    elif kind == "symlink-relative":
        path.symlink_to(os.path.relpath(outside / "secret.txt", path.parent))
    elif kind == "symlink-dangling":
        path.symlink_to(LONG_TARGET)
    elif kind == "symlink-proc":
        path.symlink_to("/proc/self/root/etc/shadow")
    elif kind == "symlink-inside":
        path.symlink_to("../README.md")
    else:
        raise AssertionError(f"no such kind: {kind}")
    os.utime(path, ns=(INSIDE_MTIME_NS, INSIDE_MTIME_NS), follow_symlinks=False)


CAN_MKNOD = os.geteuid() == 0
needs_mknod = pytest.mark.skipif(not CAN_MKNOD, reason="making a device node needs root")

# (name in the grant, how it is made, the type fs.stat and fs.list say, its own mode).
# "hardlink-*": the test, on the host, links an inode that lives outside into the grant
# (the sandbox cannot: the grant is another mount there); nothing of that inode may
# show, its mode included. Every other kind has a single name, but may point outside
# (symlinks, whatever their target) or has no size of its own (FIFO, socket, device).
WITHHELD_KINDS: list[tuple[str, str, str, str | None]] = [
    ("hl-file", "hardlink-file", "file", None),
    ("hl-fifo", "hardlink-fifo", "other", None),
    ("hl-socket", "hardlink-socket", "other", None),
    ("hl-device", "hardlink-device", "other", None),
    ("hl-symlink", "hardlink-symlink", "symlink", None),
    ("ln-abs", "symlink-absolute", "symlink", "0777"),
    ("ln-rel", "symlink-relative", "symlink", "0777"),
    ("ln-dangling", "symlink-dangling", "symlink", "0777"),
    ("ln-proc", "symlink-proc", "symlink", "0777"),
    ("ln-inside", "symlink-inside", "symlink", "0777"),
    ("fifo", "fifo", "other", "0640"),
    ("sock", "socket", "other", "0750"),
    ("dev", "device", "other", "0600"),
]
PLANTABLE_KINDS = [k for k in WITHHELD_KINDS if CAN_MKNOD or "device" not in k[1]]


def plant(directory: Path, name: str, kind: str, outside: Path) -> None:
    if kind.startswith("hardlink-"):
        source = plant_outside(outside, kind.removeprefix("hardlink-"))
        os.link(source, directory / name, follow_symlinks=False)
        assert os.lstat(directory / name).st_nlink == 2
    else:
        plant_inside(directory / name, kind, outside)


def expected_stat(visible: str, kind: str, type_: str, mode: str | None) -> dict[str, Any]:
    if kind.startswith("hardlink-"):
        return {
            "path": visible,
            "type": type_,
            "size": None,
            "mtime": None,
            "mode": None,
            "hardLinked": True,
        }
    return {"path": visible, "type": type_, "size": None, "mtime": INSIDE_MTIME, "mode": mode}


def assert_nothing_from_outside(result: dict[str, Any], tmp_path: Path) -> None:
    wire = msgspec.json.encode(result).decode()
    for fact in (*OUTSIDE_FACTS, str(tmp_path), SECRET, "/etc/", "/proc/", LONG_TARGET):
        assert fact not in wire, f"{fact!r} from outside the grant is in {wire}"


@pytest.mark.parametrize(
    ("name", "kind", "type_", "mode"),
    [
        pytest.param(*k, id=k[1], marks=[needs_mknod] if "device" in k[1] else [])
        for k in WITHHELD_KINDS
    ],
)
async def test_stat_tells_nothing_of_an_outside_inode_or_of_where_a_symlink_points(
    resolver: Resolver,
    root: Path,
    outside: Path,
    tmp_path: Path,
    name: str,
    kind: str,
    type_: str,
    mode: str | None,
) -> None:
    (root / "README.md").write_text("readme")
    (root / "sub").mkdir()
    plant(root / "sub", name, kind, outside)
    result = await call("fs.stat", {"path": f"sub/{name}"}, make_grant(root))
    note = result.pop("note", None)
    assert result == expected_stat(f"/workspace/sub/{name}", kind, type_, mode)
    assert_nothing_from_outside(result, tmp_path)
    if kind.startswith("hardlink-"):
        # It says why nothing is shown and what helps, as fs.read's refusal does.
        assert note is not None
        assert "one of several hard links" in note
        assert "size, time and mode are not shown" in note
        assert "a copy has a single link" in note
    else:
        assert note is None


@pytest.mark.parametrize(
    ("args", "base"),
    [
        ({"path": "/workspace/sub"}, "/workspace/sub"),  # the directory's own entries
        ({"path": "/workspace", "pattern": "**"}, "/workspace/sub"),  # every depth
        ({"path": "/workspace", "pattern": "sub/*"}, "/workspace/sub"),  # a nested glob
        ({"path": "/workspace", "pattern": "**/sub/*"}, "/workspace/sub"),
    ],
    ids=["own-entries", "double-star", "nested-glob", "double-star-nested"],
)
async def test_list_tells_nothing_of_an_outside_inode_at_any_depth_or_pattern(
    resolver: Resolver,
    root: Path,
    outside: Path,
    tmp_path: Path,
    args: dict[str, Any],
    base: str,
) -> None:
    # Every kind side by side with ordinary files and a directory, whose sizes stay.
    sub = root / "sub"
    sub.mkdir()
    (root / "README.md").write_text("readme")
    (sub / "plain.txt").write_bytes(b"p" * 12)
    (sub / "dir").mkdir()
    expected: list[dict[str, Any]] = [
        {"path": f"{base}/dir", "type": "dir", "size": None},
        {"path": f"{base}/plain.txt", "type": "file", "size": 12},
    ]
    for name, kind, type_, _mode in PLANTABLE_KINDS:
        plant(sub, name, kind, outside)
        entry: dict[str, Any] = {"path": f"{base}/{name}", "type": type_, "size": None}
        if kind.startswith("hardlink-"):
            entry["hardLinked"] = True
        expected.append(entry)
    expected.sort(key=lambda e: str(e["path"]))
    result = await call("fs.list", args, make_grant(root))
    listed = [e for e in result["entries"] if e["path"].startswith(f"{base}/")]
    assert listed == expected
    assert_nothing_from_outside(result, tmp_path)
    if args.get("pattern") == "**":
        readme = {"path": "/workspace/README.md", "type": "file", "size": 6}
        assert readme in result["entries"]


async def test_stat_keeps_a_directorys_facts_and_a_file_is_its_own_once_its_other_name_goes(
    root: Path,
) -> None:
    (root / "d").mkdir()
    os.chmod(root / "d", 0o750)
    os.utime(root / "d", ns=(INSIDE_MTIME_NS, INSIDE_MTIME_NS))
    result = await call("fs.stat", {"path": "d"}, make_grant(root))
    assert result == {
        "path": "/workspace/d",
        "type": "dir",
        "size": os.stat(root / "d").st_size,
        "mtime": INSIDE_MTIME,
        "mode": "0750",
    }
    # A file whose other name is gone has one link again: it is the grant's own.
    (root / "d" / "f.txt").write_text("once")
    os.link(root / "d" / "f.txt", root / "f2.txt")
    assert (await call("fs.stat", {"path": "f2.txt"}, make_grant(root)))["hardLinked"] is True
    os.unlink(root / "d" / "f.txt")
    again = await call("fs.stat", {"path": "f2.txt"}, make_grant(root))
    assert (again["size"], "hardLinked" in again) == (4, False)


async def test_a_symlink_into_another_grant_is_described_without_its_target(
    resolver: Resolver, root: Path, nested: tuple[PathGrant, ...]
) -> None:
    (root / "lnk").symlink_to("docs/key.pem")
    stat_result = await call_nested("fs.stat", {"path": "/workspace/lnk"}, nested)
    assert (stat_result["type"], stat_result["size"]) == ("symlink", None)
    listing = await call_nested("fs.list", {"path": "/workspace", "pattern": "**"}, nested)
    assert {"path": "/workspace/lnk", "type": "symlink", "size": None} in listing["entries"]


# An outside inode with this many names: a refusal must not count them.
OUTSIDE_NAMES = 7

REFUSING_CALLS = [
    pytest.param("fs.read", {}, "copy the file to get one", id="read"),
    pytest.param("fs.write", {"content": "x"}, "delete it and write anew", id="write"),
    pytest.param(
        "fs.write", {"content": "x", "append": True}, "copy the file to get one", id="append"
    ),
    pytest.param("fs.edit", {"old": "x", "new": "y"}, "copy the file to get one", id="edit"),
]


@pytest.mark.parametrize(("tool", "extra", "remedy"), REFUSING_CALLS)
async def test_a_hard_link_refusal_does_not_tell_how_many_names_the_file_has(
    resolver: Resolver,
    root: Path,
    outside: Path,
    tmp_path: Path,
    tool: str,
    extra: dict[str, Any],
    remedy: str,
) -> None:
    source = outside / "secret.txt"
    for index in range(OUTSIDE_NAMES - 2):
        os.link(source, outside / f"name-{index}")
    os.link(source, root / "hl.txt")
    assert os.stat(root / "hl.txt").st_nlink == OUTSIDE_NAMES
    with pytest.raises(PolicyViolation) as caught:
        await call(tool, {"path": "hl.txt", **extra}, make_grant(root))
    message = str(caught.value)
    assert caught.value.code.value == "policy_denied"
    assert message == (
        "'/workspace/hl.txt' is one of several hard links to the same file; a hard link "
        "can make a file from outside the readable paths appear inside them, so only "
        f"files with a single link can be read or written ({remedy})"
    )
    assert str(OUTSIDE_NAMES) not in message
    assert_safe(caught.value, tmp_path)
    assert source.read_text() == SECRET
