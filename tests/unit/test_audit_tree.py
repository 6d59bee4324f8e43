"""The audit log's Merkle tree as the writer keeps it: one leaf per entry across
rotation, the durable node store beside the log, and every state a crash (or a hand)
can leave the store in, recovered from the log at the next open."""

from __future__ import annotations

import functools
import os
from pathlib import Path

import pytest
import trio

from gatewayd.audit import AuditEvent, AuditLog, open_audit_log
from gatewayd.audit.merkle import (
    HASH_SIZE,
    leaf_hash,
    root_from_hashes,
    verify_consistency,
    verify_inclusion,
)
from gatewayd.audit.proofs import TreeReader, log_leaves
from gatewayd.audit.query import read_log
from gatewayd.audit.segments import list_segments
from gatewayd.audit.treestore import TreeError, open_tree, tree_dir

SEGMENT_BYTES = 2048
MARK = AuditEvent.EGRESS


async def write(
    path: Path, count: int, *, max_bytes: int = SEGMENT_BYTES, tree: bool = True
) -> None:
    async with open_audit_log(path, fsync=False, max_bytes=max_bytes, tree=tree) as log:
        for i in range(count):
            log.record("event", event=MARK, detail={"i": i})
        await log.durable(log.last_seq)


def lines(path: Path) -> list[bytes]:
    return [r.raw for r in read_log(path) if r.entry is not None and "seq" in r.entry]


def expected_root(path: Path) -> tuple[int, bytes]:
    leaves = [leaf.hash for leaf in log_leaves(path).leaves]
    return len(leaves), root_from_hashes(leaves)


@pytest.fixture
def log_path(tmp_path: Path) -> Path:
    return tmp_path / "audit" / "audit.jsonl"


def test_every_entry_is_a_leaf_across_rotations(log_path: Path) -> None:
    trio.run(write, log_path, 60)
    assert len(list_segments(log_path)) >= 3
    all_lines = lines(log_path)
    store = open_tree(log_path, writable=False)
    try:
        assert store.size == len(all_lines)
        assert store.root() == root_from_hashes([leaf_hash(line) for line in all_lines])
        # the leaf is the line without its newline
        assert store.leaf(0) == leaf_hash(all_lines[0])
        size, root = store.head()
        for index in range(size):
            proof = store.inclusion_proof(index, size)
            verify_inclusion(index, size, leaf_hash(all_lines[index]), proof, root)
        for old in range(size + 1):
            verify_consistency(
                old, size, store.root_at(old), root, store.consistency_proof(old, size)
            )
    finally:
        store.close()


def test_the_tree_continues_across_restarts(log_path: Path) -> None:
    trio.run(write, log_path, 10)
    first_size, first_root = expected_root(log_path)
    trio.run(write, log_path, 10)
    store = open_tree(log_path, writable=False)
    try:
        assert (store.size, store.root()) == expected_root(log_path)
        assert store.root_at(first_size) == first_root
    finally:
        store.close()


def _level(log_path: Path, level: int) -> Path:
    return tree_dir(log_path) / f"level-{level:02d}"


def _cut(path: Path, keep: int) -> None:
    with path.open("r+b") as file:
        file.truncate(keep)


@pytest.mark.parametrize(
    "damage",
    [
        "torn leaf record",
        "leaves behind the log",
        "upper level ahead",
        "upper level behind",
        "store removed",
        "last leaf altered",
        "store ahead of the log",
        "level file removed",
    ],
)
def test_a_damaged_store_is_recovered_from_the_log(log_path: Path, damage: str) -> None:
    trio.run(write, log_path, 40)
    leaves = _level(log_path, 0)
    if damage == "torn leaf record":
        _cut(leaves, leaves.stat().st_size - 10)
    elif damage == "leaves behind the log":
        _cut(leaves, 5 * HASH_SIZE)
    elif damage == "upper level ahead":
        with _level(log_path, 1).open("ab") as file:
            file.write(b"\xee" * HASH_SIZE * 3)
    elif damage == "upper level behind":
        _cut(_level(log_path, 2), HASH_SIZE)
    elif damage == "store removed":
        for child in tree_dir(log_path).iterdir():
            child.unlink()
        tree_dir(log_path).rmdir()
    elif damage == "last leaf altered":
        with leaves.open("r+b") as file:
            file.seek(leaves.stat().st_size - HASH_SIZE)
            file.write(b"\x00" * HASH_SIZE)
    elif damage == "store ahead of the log":
        with leaves.open("ab") as file:
            file.write(b"\x11" * HASH_SIZE * 4)
    elif damage == "level file removed":
        _level(log_path, 3).unlink()
    trio.run(write, log_path, 3)
    store = open_tree(log_path, writable=False)
    try:
        assert (store.size, store.root()) == expected_root(log_path)
        size = store.size
        for level in range(1, 6):
            # every level holds exactly the perfect subtrees the leaves make
            assert _level(log_path, level).stat().st_size == (size >> level) * HASH_SIZE
    finally:
        store.close()


def test_a_store_that_does_not_match_says_why_it_was_rebuilt(log_path: Path) -> None:
    trio.run(write, log_path, 10)
    leaves = _level(log_path, 0)
    with leaves.open("r+b") as file:
        file.seek(leaves.stat().st_size - HASH_SIZE)
        file.write(b"\x00" * HASH_SIZE)
    store = open_tree(log_path)
    try:
        assert store.rebuilt_because is not None
        assert "last leaf is not the log's entry" in store.rebuilt_because
        assert store.root() == expected_root(log_path)[1]
    finally:
        store.close()


def test_torn_bytes_are_no_leaves(log_path: Path) -> None:
    trio.run(functools.partial(write, log_path, 5, max_bytes=0))
    with log_path.open("ab") as file:
        file.write(b'{"seq":8,"time":"2026-1')  # a crash in the middle of a line
    trio.run(functools.partial(write, log_path, 2, max_bytes=0))
    read = log_leaves(log_path)
    assert read.broken is None
    assert [leaf.seq for leaf in read.leaves] == list(range(1, len(read.leaves) + 1))
    store = open_tree(log_path, writable=False)
    try:
        assert (store.size, store.root()) == expected_root(log_path)
    finally:
        store.close()


def test_a_tree_that_cannot_be_opened_never_stops_the_log(log_path: Path) -> None:
    log_path.parent.mkdir(mode=0o700)
    tree_dir(log_path).write_text("not a directory")

    async def main() -> None:
        async with open_audit_log(log_path, fsync=False) as log:
            assert log.tree is None
            assert log.tree_failure is not None
            assert "cannot be used" in log.tree_failure
            await log.append("event", event=MARK, detail={"i": 1})

    trio.run(main)
    assert len(lines(log_path)) == 3


def tree_is_off(log: AuditLog) -> bool:
    return log.tree is None


def test_a_tree_write_failure_switches_the_tree_off_not_the_log(log_path: Path) -> None:
    async def main() -> None:
        async with open_audit_log(log_path, fsync=False) as log:
            assert log.tree is not None
            for fd in log.tree._fds:  # the store's files go away under it
                os.close(fd)
            log.tree._fds[:] = [os.open("/dev/null", os.O_RDONLY) for _ in log.tree._fds]
            await log.append("event", event=MARK, detail={"i": 1})
            await log.append("event", event=MARK, detail={"i": 2})
            assert tree_is_off(log)
            assert log.tree_failure is not None
            assert "writing the Merkle tree" in log.tree_failure

    trio.run(main)
    assert len(lines(log_path)) == 4


def test_a_partial_log_without_its_store_cannot_be_treed(log_path: Path) -> None:
    trio.run(write, log_path, 40)
    oldest = list_segments(log_path)[0][1]
    oldest.unlink()
    for child in tree_dir(log_path).iterdir():
        child.unlink()
    with pytest.raises(TreeError, match="older segments were deleted"):
        open_tree(log_path)


def test_a_partial_log_keeps_its_store(log_path: Path) -> None:
    """Retention deletes old segments; the store still proves what they held."""
    trio.run(write, log_path, 40)
    size, root = expected_root(log_path)
    list_segments(log_path)[0][1].unlink()
    trio.run(write, log_path, 2)
    store = open_tree(log_path, writable=False)
    try:
        assert store.root_at(size) == root
    finally:
        store.close()


def test_the_reader_falls_back_to_the_log_when_there_is_no_store(log_path: Path) -> None:
    trio.run(functools.partial(write, log_path, 20, tree=False))
    assert not tree_dir(log_path).exists()
    size, root = expected_root(log_path)
    reader = TreeReader(log_path)
    try:
        assert reader.root_at(size) == root
        proof = reader.inclusion_proof(3, size)
        verify_inclusion(3, size, reader.leaf(3), proof, root)
        verify_consistency(4, size, reader.root_at(4), root, reader.consistency_proof(4, size))
    finally:
        reader.close()
