"""What the audit log's Merkle tree costs, and what its checkpoints and proofs cost.

    .venv/bin/python bench/audit_tree.py [--entries 20000] [--rounds 3] [--sizes 10000,100000,1000000]

In one run:

- **append** — the audit writer (``open_audit_log``, fdatasync off so the disk does not
  hide the difference) recording ``--entries`` entries, 64 at a time, each batch waited
  for (``durable``), with the tree off and on, alternating over ``--rounds``: wall
  time per entry, and the difference. The tree is grown on the flusher thread, so the
  trio thread (``record()``) pays nothing; the difference is the flusher's added work
  (the leaf hash, about one node hash, and the level files' writes). Also the tree's
  own cost alone: ``TreeStore.append`` per entry, in batches of 64.
- **checkpoint** — signing one checkpoint (Ed25519 over the note text) and writing it
  with its history line (fsync'd), median of 200.
- **proofs** — a node store of ``max(--sizes)`` leaves (synthetic leaf hashes, built with
  ``TreeStore.append``), then for each size: the root at that size, inclusion proofs of
  500 random leaves and consistency proofs from 500 random older sizes, each verified:
  median and worst time to build one, its number of hashes and bytes (32 per hash).
  The issue's target: a proof in at most 10 ms at 10^6 entries.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import random
import shutil
import statistics
import tempfile
import time
from pathlib import Path

import trio

from gatewayd.audit import AuditEvent, open_audit_log
from gatewayd.audit.checkpoint import Checkpoint
from gatewayd.audit.checkpointer import write_checkpoint
from gatewayd.audit.merkle import verify_consistency, verify_inclusion
from gatewayd.audit.note import Signer, generate_key, sign_note
from gatewayd.audit.treestore import open_tree

BATCH = 64
PROOFS = 500


async def _append(path: Path, entries: int, tree: bool) -> tuple[float, float]:
    async with open_audit_log(path, fsync=False, tree=tree) as log:
        cpu = time.process_time()  # every thread's: the flusher's work included
        started = time.perf_counter()
        for start in range(0, entries, BATCH):
            for i in range(start, min(start + BATCH, entries)):
                log.record(
                    "event",
                    event=AuditEvent.EGRESS,
                    detail={"i": i, "domain": "example.com", "port": 443, "verdict": "allow"},
                )
            await log.durable(log.last_seq)
        elapsed = time.perf_counter() - started
        cpu = time.process_time() - cpu
    return elapsed / entries, cpu / entries


def bench_append(entries: int, rounds: int) -> None:
    per: dict[bool, list[float]] = {False: [], True: []}
    per_cpu: dict[bool, list[float]] = {False: [], True: []}
    for _ in range(rounds):
        for tree in (False, True):
            directory = Path(tempfile.mkdtemp(prefix="bench-tree-"))
            try:
                wall, cpu = trio.run(_append, directory / "audit.jsonl", entries, tree)
                per[tree].append(wall)
                per_cpu[tree].append(cpu)
            finally:
                shutil.rmtree(directory)
    off, on = statistics.median(per[False]), statistics.median(per[True])
    cpu_off, cpu_on = statistics.median(per_cpu[False]), statistics.median(per_cpu[True])
    print(f"append ({entries} entries x {rounds} rounds, batches of {BATCH}, no fdatasync)")
    print(f"  tree off   {off * 1e6:8.2f} us/entry wall, {cpu_off * 1e6:8.2f} us/entry CPU")
    print(f"  tree on    {on * 1e6:8.2f} us/entry wall, {cpu_on * 1e6:8.2f} us/entry CPU")
    print(
        f"  the tree adds {(on - off) * 1e6:6.2f} us/entry wall, {(cpu_on - cpu_off) * 1e6:6.2f} "
        "us/entry CPU (target: at most 10)"
    )
    directory = Path(tempfile.mkdtemp(prefix="bench-tree-"))
    try:
        store = open_tree(directory / "audit.jsonl", last_seq=0)
        line = b'{"seq":1,"time":"2026-11-27T01:00:00.000000Z","kind":"event"' + b"x" * 300
        started, cpu = time.perf_counter(), time.thread_time()
        for _ in range(0, entries, BATCH):
            store.append(
                [hashlib.sha256(b"\x00" + line + str(i).encode()).digest() for i in range(BATCH)]
            )
        alone = (time.perf_counter() - started) / entries
        alone_cpu = (time.thread_time() - cpu) / entries
        store.close()
    finally:
        shutil.rmtree(directory)
    print(
        f"  TreeStore.append alone (leaf hash + nodes + writes): {alone * 1e6:6.2f} us/entry "
        f"wall, {alone_cpu * 1e6:6.2f} us/entry CPU"
    )


def bench_checkpoint() -> None:
    signer = Signer.from_string(generate_key("bench.example/audit")[0])
    directory = Path(tempfile.mkdtemp(prefix="bench-tree-"))
    try:
        log_path = directory / "audit.jsonl"
        sign_times, write_times = [], []
        for size in range(1, 201):
            checkpoint = Checkpoint(signer.name, size, hashlib.sha256(str(size).encode()).digest())
            started = time.perf_counter()
            note = sign_note(checkpoint.body(), [signer])
            signed = time.perf_counter()
            write_checkpoint(log_path, note, size, fsync=True)
            written = time.perf_counter()
            sign_times.append(signed - started)
            write_times.append(written - signed)
        print("checkpoint (median of 200)")
        print(f"  sign (Ed25519 note)          {statistics.median(sign_times) * 1e6:8.1f} us")
        print(f"  write + history line, fsync  {statistics.median(write_times) * 1e3:8.3f} ms")
    finally:
        shutil.rmtree(directory)


def _ms(values: list[float]) -> str:
    p99 = statistics.quantiles(values, n=100)[98]
    return (
        f"median {statistics.median(values) * 1e3:6.3f} ms, p99 {p99 * 1e3:6.3f} ms, "
        f"worst {max(values) * 1e3:6.3f} ms"
    )


def bench_proofs(sizes: list[int]) -> None:
    directory = Path(tempfile.mkdtemp(prefix="bench-tree-"))
    rng = random.Random(22)
    try:
        log_path = directory / "audit.jsonl"
        store = open_tree(log_path, last_seq=0)
        biggest = max(sizes)
        started = time.perf_counter()
        chunk = 1 << 14
        for start in range(0, biggest, chunk):
            store.append(
                [
                    hashlib.sha256(i.to_bytes(8, "big")).digest()
                    for i in range(start, min(start + chunk, biggest))
                ]
            )
        built = time.perf_counter() - started
        store.close()
        store = open_tree(log_path, writable=False)  # as `gatewayd audit prove` reads it
        disk = sum(f.stat().st_size for f in (directory / "audit.jsonl.tree").iterdir())
        print(
            f"proofs (a node store of {biggest} leaves, {disk / 2**20:.1f} MiB, built in "
            f"{built:.1f} s; {PROOFS} proofs of each kind per size, each verified)"
        )
        for size in sizes:
            root = store.root_at(size)
            inclusion, inclusion_cpu, inclusion_len = [], [], []
            for _ in range(PROOFS):
                index = rng.randrange(size)
                began, cpu = time.perf_counter(), time.thread_time()
                proof = store.inclusion_proof(index, size)
                inclusion.append(time.perf_counter() - began)
                inclusion_cpu.append(time.thread_time() - cpu)
                inclusion_len.append(len(proof))
                verify_inclusion(index, size, store.leaf(index), proof, root)
            consistency, consistency_cpu, consistency_len = [], [], []
            for _ in range(PROOFS):
                old = rng.randrange(1, size)
                began, cpu = time.perf_counter(), time.thread_time()
                proof = store.consistency_proof(old, size)
                consistency.append(time.perf_counter() - began)
                consistency_cpu.append(time.thread_time() - cpu)
                consistency_len.append(len(proof))
                verify_consistency(old, size, store.root_at(old), root, proof)
            print(f"  size {size:>9}")
            print(
                f"    inclusion    wall {_ms(inclusion)}; {max(inclusion_len)} hashes at most "
                f"({max(inclusion_len) * 32} bytes)\n                 CPU  {_ms(inclusion_cpu)}"
            )
            print(
                f"    consistency  wall {_ms(consistency)}; {max(consistency_len)} hashes at "
                f"most ({max(consistency_len) * 32} bytes)\n                 CPU  "
                f"{_ms(consistency_cpu)}"
            )
        store.close()
    finally:
        shutil.rmtree(directory)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--entries", type=int, default=20000)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--sizes", default="10000,100000,1000000")
    args = parser.parse_args()
    print(f"cpus {os.cpu_count()}")
    bench_append(args.entries, args.rounds)
    bench_checkpoint()
    bench_proofs([int(s) for s in args.sizes.split(",")])


if __name__ == "__main__":
    main()
