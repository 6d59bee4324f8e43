"""The diff rules of the workspace backends, on plain directories (no mounts)."""

from __future__ import annotations

import errno
import os
from pathlib import Path

import pytest

from gatewayd.errors import PolicyViolation
from gatewayd.workspace import treediff
from gatewayd.workspace.session import split_relative
from gatewayd.workspace.treediff import (
    BINARY_SNIFF_BYTES,
    compare_trees,
    content,
    is_binary,
    walk_entries,
)


@pytest.mark.parametrize(
    ("data", "binary"),
    [
        (b"plain text\n", False),
        ("caf\u00e9 \u2603\n".encode(), False),
        (b"", False),
        (b"a\x00b", True),
        (b"caf\xe9", True),  # Latin-1, not UTF-8
        (b"x" * BINARY_SNIFF_BYTES + b"\x00", False),  # NUL past the sniffed prefix, valid UTF-8
    ],
)
def test_binary_is_a_nul_in_the_first_8k_or_invalid_utf8(data: bytes, binary: bool) -> None:
    assert is_binary(data) is binary


def _trees(tmp_path: Path) -> tuple[Path, Path]:
    old, new = tmp_path / "old", tmp_path / "new"
    old.mkdir()
    new.mkdir()
    return old, new


def test_identical_contents_pair_one_to_one_in_sorted_order(tmp_path: Path) -> None:
    old, new = _trees(tmp_path)
    (old / "a").write_text("same\n")
    (old / "b").write_text("same\n")
    (new / "x").write_text("same\n")
    diff = compare_trees(old, new, [""])
    assert diff.renamed == [("a", "x")]
    assert diff.removed == ["b"]
    assert diff.added == []


def test_a_symlink_is_compared_by_its_target(tmp_path: Path) -> None:
    old, new = _trees(tmp_path)
    os.symlink("one", old / "link")
    os.symlink("two", new / "link")
    diff = compare_trees(old, new, [""])
    assert diff.modified == ["link"]
    # Like git: the target is the content, with no final newline.
    assert "-one\n\\ No newline at end of file\n+two\n" in diff.unified


def test_a_removed_file_without_final_newline_is_marked(tmp_path: Path) -> None:
    old, new = _trees(tmp_path)
    (old / "f").write_text("last")
    diff = compare_trees(old, new, [""])
    assert diff.unified == (
        "--- a/f\n+++ /dev/null\n@@ -1 +0,0 @@\n-last\n\\ No newline at end of file\n"
    )


def test_scopes_limit_what_is_compared(tmp_path: Path) -> None:
    old, new = _trees(tmp_path)
    (old / "seen").write_text("1\n")
    (new / "seen").write_text("2\n")
    (new / "unseen").write_text("x\n")
    diff = compare_trees(old, new, ["seen"])
    assert diff.modified == ["seen"]
    assert diff.added == []


@pytest.mark.parametrize("path", ["/abs", "..", "a/../b", "a/../../b"])
def test_split_relative_refuses_escapes(path: str) -> None:
    with pytest.raises(PolicyViolation):
        split_relative(path)


def test_split_relative_drops_dots_and_empty_parts() -> None:
    assert split_relative("./a//b/.") == ("a", "b")
    assert split_relative(".") == ()


def test_content_and_walk_never_go_through_a_symlinked_directory(tmp_path: Path) -> None:
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "secret").write_text("host secret\n")
    root = tmp_path / "root"
    root.mkdir()
    os.symlink(outside, root / "dir")
    # As if the tree listed 'dir/secret' while 'dir' was still a directory.
    with pytest.raises(OSError) as excinfo:
        content(root, "dir/secret", "file")
    assert excinfo.value.errno in (errno.ELOOP, errno.ENOTDIR)
    assert walk_entries(root, "") == {"dir": "link"}
    # Seen through the link, 'dir/secret' does not exist (its parent is no directory).
    assert walk_entries(root, "dir/secret") == {}


# --- bounded memory: the sandbox decides how much it writes, not gatewayd's memory ---


def test_a_huge_file_is_compared_in_chunks_and_listed_without_a_hunk(tmp_path: Path) -> None:
    import tracemalloc

    old, new = tmp_path / "old", tmp_path / "new"
    old.mkdir()
    new.mkdir()
    size = 64 << 20
    for root, fill in ((old, b"a"), (new, b"b")):
        with open(root / "big.txt", "wb") as f:
            for _ in range(size // (1 << 20)):
                f.write(fill * (1 << 20))
    tracemalloc.start()
    try:
        diff = compare_trees(old, new, [""])
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert diff.modified == ["big.txt"] and diff.binary == ["big.txt"]
    assert diff.unified == ""
    assert peak < 8 << 20, f"peak {peak} bytes for a {size}-byte file"


def test_a_text_file_over_the_hunk_limit_is_listed_as_binary(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(treediff, "MAX_HUNK_FILE_BYTES", 100)
    old, new = tmp_path / "old", tmp_path / "new"
    old.mkdir()
    new.mkdir()
    (old / "long.txt").write_text("x\n" * 100)
    (new / "long.txt").write_text("y\n" * 100)
    (old / "short.txt").write_text("a\n")
    (new / "short.txt").write_text("b\n")
    diff = compare_trees(old, new, [""])
    assert diff.binary == ["long.txt"]
    assert "+b" in diff.unified and "long.txt" not in diff.unified


def test_hunks_stop_at_the_unified_limit_and_say_which_files_are_left_out(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(treediff, "MAX_UNIFIED_CHARS", 10)
    old, new = tmp_path / "old", tmp_path / "new"
    old.mkdir()
    new.mkdir()
    for name in ("a.txt", "b.txt", "c.txt"):
        (new / name).write_text(f"{name}\n")
    diff = compare_trees(old, new, [""])
    assert diff.added == ["a.txt", "b.txt", "c.txt"]
    assert diff.unified.count("+++ b/") == 1
    assert diff.unified.endswith(
        "# 2 more changed text file(s) without hunks: the diff reached 10 characters "
        "(b.txt, c.txt)\n"
    )


def test_utf8_split_across_chunks_is_still_text(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(treediff, "READ_CHUNK_BYTES", 3)
    old, new = tmp_path / "old", tmp_path / "new"
    old.mkdir()
    new.mkdir()
    (new / "u.txt").write_text("héllo wörld ✓\n")
    (new / "bad.txt").write_bytes("é".encode()[:1] + b"abc\n")
    diff = compare_trees(old, new, [""])
    assert diff.binary == ["bad.txt"]
    assert "+héllo wörld ✓" in diff.unified
