"""Under steady load the Merkle tree stays close behind the log: the flusher holds the
leaves of flushes that have the next flush already wanted (group commit for the tree),
but none longer than about TREE_HOLD_S, so a run-end checkpoint (which waits for the
tree, bounded) covers the entries just made durable.

Real files in tmp_path, a real flusher thread, a disk made slow: the fdatasync is a
sleep. A second and a half of load, so not in the unit lane.
"""

from __future__ import annotations

import os
import time
from collections import deque
from collections.abc import Callable, Sequence
from pathlib import Path

import pytest
import trio

from gatewayd.audit import open_audit_log, verify_file, writer
from tests.unit.test_audit_group_commit import call_fields

# No entry is ever due: only waiters (or close) make the flusher write.
NEVER_DUE_S = 3600.0
PATIENCE_S = 20.0
# Each flush's fdatasync, and how often a call comes: several calls ask while each flush
# syncs, so the next flush is wanted at the end of every flush.
SYNC_S = 0.01
CALL_EVERY_S = 0.003
# How long the callers keep the flusher busy: several times the bound below. A hold
# that only TREE_BATCH_LEAVES ends lasts about a second here (at most one entry per
# CALL_EVERY_S).
LOAD_S = 1.5
# How far the tree may fall behind: TREE_HOLD_S and the flush that ends the hold, with
# room for a loaded machine (measured beside a busy loop: 20 to 75 ms; 0.4 to 1.4 s
# before the hold was bounded in time).
LAG_BOUND_S = 10 * writer.TREE_HOLD_S + SYNC_S


async def wait_until(done: Callable[[], bool]) -> None:
    with trio.fail_after(PATIENCE_S):
        while not done():
            await trio.sleep(0.001)


async def test_the_tree_stays_close_behind_the_log_while_the_next_flush_is_wanted(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = tmp_path / "audit.jsonl"
    # A slow disk, the same for every flush: the sync sleeps (the durability of these
    # entries is not what is tested).
    monkeypatch.setattr(os, "fdatasync", lambda fd: time.sleep(SYNC_S))
    async with open_audit_log(path, fsync=True, sync_delay_s=NEVER_DUE_S) as log:
        tree = log.tree
        assert tree is not None
        await wait_until(lambda: tree.size == log.durable_seq)  # open's own entries
        appends = 0
        real_append = tree.append

        def counting_append(hashes: Sequence[bytes]) -> None:
            nonlocal appends
            appends += 1
            real_append(hashes)

        monkeypatch.setattr(tree, "append", counting_append)
        flushes = log.fsync_count
        stop = trio.current_time() + LOAD_S

        async def call(n: int) -> None:
            await log.durable(log.record("call", **call_fields(n)))

        # (when first seen durable, seq): durable entries the tree may not hold yet.
        behind: deque[tuple[float, int]] = deque()
        seen = log.durable_seq
        worst_s, worst_entries = 0.0, 0
        async with trio.open_nursery() as nursery:
            n = 0
            while (now := trio.current_time()) < stop:
                # A call every few milliseconds, each waiting for its entry: several ask
                # while each flush syncs, so the next flush is always wanted.
                nursery.start_soon(call, n)
                n += 1
                if log.durable_seq > seen:
                    seen = log.durable_seq
                    behind.append((now, seen))
                size = tree.size
                while behind and behind[0][1] <= size:
                    behind.popleft()
                if behind:
                    worst_s = max(worst_s, now - behind[0][0])
                worst_entries = max(worst_entries, log.durable_seq - size)
                await trio.sleep(CALL_EVERY_S)
        flushes = log.fsync_count - flushes
        # The callers kept the next flush wanted: the tree took several flushes' leaves
        # at a time (otherwise nothing here held a leaf at all).
        assert appends < flushes
        assert worst_s < LAG_BOUND_S, (
            f"the tree fell {worst_s * 1000:.0f} ms ({worst_entries} entries) behind the "
            f"log ({flushes} flushes, {appends} tree appends)"
        )
        await wait_until(lambda: tree.size == log.durable_seq)
    assert verify_file(path).ok
