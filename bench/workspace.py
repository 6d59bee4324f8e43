"""What each workspace backend costs on a realistic tree, beside a plain `cp -a` of the
same tree measured in the same run (the baseline).

    .venv/bin/python bench/workspace.py [--files 10000] [--rounds 5] [--changes 100]

Needs root (the overlay backend mounts overlayfs and tmpfs). The tree is generated once,
deterministically (seed 7), under a private temporary directory on the same file system
as the system's temporary directory: ``--files`` files nested about 20 entries per
directory, text files of 200 B-8 KiB and one binary in 200 (a few KiB with NUL bytes),
plus a few symlinks. Per round, for each backend (``host``; ``overlay``; ``overlay`` with
``max_delta_bytes`` set, its delta on a tmpfs; ``agentfs``, its delta in an AgentFS
database) over a fresh copy of the tree:

- **create**: ``create(base, state_dir)``;
- **write**: one ``write()`` of a new 4 KiB file (what an fs tool's write costs);
- **sync**: ``sync()`` after ``--changes`` changes (70% modified, 15% added, 10%
  removed, 5% renamed, made through ``root`` and not timed): what the run pays after a
  command that changed them. Only agentfs has work here (its view into its database);
- **idle sync**: ``sync()`` again, nothing changed: what every other command pays;
- **diff**: ``diff()`` of those changes;
- **seal**: ``seal()``, what a run's end costs (overlay unmounts; agentfs syncs a last
  time, makes its database durable and deletes the view; host has nothing to do);
- **commit**: ``commit()`` of those changes, sealed (``gatewayd workspace commit``);
- **discard**: ``discard()`` of the same mix of changes in a second, fresh session,
  synced and sealed first (untimed), as a run's end leaves it.

The baseline is ``/usr/bin/cp -a`` of the whole tree to a new directory, once per round,
set up like a backend (a fresh copy of the tree, then the timed copy of that copy) and
run in the same shuffled order: on the machine measured, a copy right after removing a
tree ran 2-3x slower than one right after making one, so a baseline set up differently
from ``create`` would skew every ratio. Every timed step starts after ``sync`` (so no
step pays for the previous one's writeback). Printed: the median of each over the rounds in ms, with its ratio to the
median ``cp -a``; a progress line per round on stderr. Figures, never assertions.

Resource handling: every session is closed in a ``finally``; on exit (including Ctrl-C
and SIGTERM) every mount below the bench's directory is unmounted before the directory
is removed, and the directory is kept (with a message) if one cannot be.
"""

from __future__ import annotations

import argparse
import os
import random
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from types import FrameType
from typing import Final, TypeVar

from gatewayd.workspace import HostWorkspace, OverlayWorkspace, WorkspaceSession
from gatewayd.workspace.agentfs import AgentFSWorkspace

T = TypeVar("T")

CP: Final = "/usr/bin/cp"
UMOUNT: Final = "/usr/bin/umount"
SEED: Final = 7
ENTRIES_PER_DIR: Final = 20
# The limited overlay's delta tmpfs: far above what --changes writes, so it only costs.
BENCH_DELTA_LIMIT: Final = 256 << 20
STEPS: Final = ("create", "write", "sync", "idle sync", "diff", "seal", "commit", "discard")
BACKENDS: Final = ("host", "overlay", "overlay, tmpfs delta", "agentfs")
WRITE_BYTES: Final = 4096
COLUMN: Final = 16
BASELINE: Final = "cp -a (baseline)"

WORDS: Final = [
    *("def", "return", "import", "class", "self", "value", "result", "error", "path"),
    *("workspace", "session", "commit", "discard", "overlay", "snapshot", "journal"),
    *("config", "policy", "audit", "sandbox", "request", "response"),
]


def text_blob(rng: random.Random, size: int) -> bytes:
    lines = []
    total = 0
    while total < size:
        line = " ".join(rng.choices(WORDS, k=rng.randint(3, 12))) + "\n"
        lines.append(line)
        total += len(line)
    return "".join(lines).encode()[:size]


def generate_tree(root: Path, files: int) -> tuple[int, int]:
    """``files`` files under ``root``, about ENTRIES_PER_DIR entries per directory.

    Returns (bytes written, directories made).
    """
    rng = random.Random(SEED)
    per_leaf = ENTRIES_PER_DIR - 2  # leave room for a subdirectory or a symlink
    total = 0
    dirs: set[Path] = set()
    for k in range(files):
        leaf = k // per_leaf
        mid = leaf // ENTRIES_PER_DIR
        top = mid // ENTRIES_PER_DIR
        directory = root / f"pkg{top}" / f"mod{mid}" / f"part{leaf}"
        if directory not in dirs:
            directory.mkdir(parents=True, exist_ok=True)
            dirs.add(directory)
        if k % 200 == 199:
            data = bytes(rng.getrandbits(8) for _ in range(rng.randint(1024, 6144))) + b"\0"
            (directory / f"blob{k}.bin").write_bytes(data)
        else:
            data = text_blob(rng, rng.randint(200, 8192))
            (directory / f"file{k}.py").write_bytes(data)
        total += len(data)
        if k % 1000 == 500:
            os.symlink(f"file{k}.py", directory / f"link{k}.py")
    made = {p for d in dirs for p in [d, *d.parents] if root in p.parents}
    return total, len(made)


@dataclass(frozen=True, slots=True, kw_only=True)
class ChangeMix:
    modified: int
    added: int
    removed: int
    renamed: int

    @classmethod
    def of(cls, changes: int) -> ChangeMix:
        renamed = max(1, changes * 5 // 100)
        removed = max(1, changes * 10 // 100)
        added = max(1, changes * 15 // 100)
        return cls(
            modified=max(1, changes - renamed - removed - added),
            added=added,
            removed=removed,
            renamed=renamed,
        )

    def __str__(self) -> str:
        total = self.modified + self.added + self.removed + self.renamed
        return (
            f"{total} changes ({self.modified} modified, {self.added} added, "
            f"{self.removed} removed, {self.renamed} renamed)"
        )


def regular_files(root: Path) -> list[Path]:
    found = []
    for dirpath, _dirs, names in os.walk(root):
        for name in names:
            path = Path(dirpath, name)
            if not path.is_symlink():
                found.append(path)
    return sorted(found)


def make_changes(root: Path, mix: ChangeMix, rng: random.Random) -> None:
    """Apply ``mix`` through ``root`` (the view the sandbox would write)."""
    files = regular_files(root)
    picked = rng.sample(files, mix.modified + mix.removed + mix.renamed)
    modify = picked[: mix.modified]
    remove = picked[mix.modified : mix.modified + mix.removed]
    rename = picked[mix.modified + mix.removed :]
    for path in modify:
        with open(path, "ab") as out:
            out.write(b"# edited by the bench\n")
    for path in remove:
        path.unlink()
    for path in rename:
        path.rename(path.with_name(f"renamed-{path.name}"))
    for i in range(mix.added):
        target = rng.choice(files).parent / f"added{i}.py"
        target.write_bytes(text_blob(rng, rng.randint(200, 8192)))


def open_session(backend: str, base: Path, state: Path) -> WorkspaceSession:
    if backend == "host":
        return HostWorkspace.create(base, state)
    if backend == "agentfs":
        return AgentFSWorkspace.create(base, state)
    limit = BENCH_DELTA_LIMIT if backend == "overlay, tmpfs delta" else None
    return OverlayWorkspace.create(base, state, max_delta_bytes=limit)


def timed(step: Callable[[], T]) -> tuple[T, float]:
    """``step()``'s result and its wall time, after flushing earlier writes (sync)."""
    os.sync()
    start = time.perf_counter()
    result = step()
    return result, time.perf_counter() - start


def copy(source: Path, dest: Path) -> None:
    subprocess.run([CP, "-a", "--", str(source), str(dest)], check=True)


def mounts_below(directory: Path) -> list[Path]:
    """Mount points at or below ``directory`` from /proc/self/mountinfo, deepest first."""
    prefix = f"{directory}/"
    found = []
    for line in Path("/proc/self/mountinfo").read_text().splitlines():
        point = line.split(" ")[4]
        if point == str(directory) or point.startswith(prefix):
            found.append(Path(point))
    return sorted(found, key=lambda p: len(p.parts), reverse=True)


@contextmanager
def bench_directory() -> Iterator[Path]:
    """A private directory, its mounts undone and itself removed on any exit."""
    directory = Path(tempfile.mkdtemp(prefix="cogni-bench-ws-"))

    def on_sigterm(signum: int, frame: FrameType | None) -> None:
        raise KeyboardInterrupt  # run the same finally blocks as Ctrl-C

    previous = signal.signal(signal.SIGTERM, on_sigterm)
    try:
        yield directory
    finally:
        signal.signal(signal.SIGTERM, previous)
        left = []
        for point in mounts_below(directory):
            if subprocess.run([UMOUNT, "-l", str(point)], check=False).returncode != 0:
                left.append(point)
        if left:
            # Never delete through a mount: keep everything for a look by hand.
            print(f"workspace: could not unmount {left}; kept {directory}", file=sys.stderr)
        else:
            shutil.rmtree(directory, ignore_errors=True)


@dataclass
class Samples:
    baseline: list[float] = field(default_factory=list)
    steps: dict[tuple[str, str], list[float]] = field(default_factory=dict)

    def add(self, backend: str, step: str, seconds: float) -> None:
        self.steps.setdefault((backend, step), []).append(seconds)


def run_baseline(pristine: Path, work: Path) -> float:
    base = work / "base"
    copy(pristine, base)
    try:
        return timed(lambda: copy(base, work / "cp-copy"))[1]
    finally:
        shutil.rmtree(base, ignore_errors=True)
        shutil.rmtree(work / "cp-copy", ignore_errors=True)


def run_backend(
    backend: str, pristine: Path, work: Path, mix: ChangeMix, rng: random.Random
) -> dict[str, float]:
    base = work / "base"
    copy(pristine, base)
    times: dict[str, float] = {}
    try:
        ws: WorkspaceSession | None = None
        try:
            opened, times["create"] = timed(
                lambda: open_session(backend, base, work / "state-commit")
            )
            ws = opened
            data = text_blob(rng, WRITE_BYTES)
            _, times["write"] = timed(lambda: opened.write("bench-write.py", data))
            make_changes(opened.root, mix, rng)
            _, times["sync"] = timed(opened.sync)
            _, times["idle sync"] = timed(opened.sync)
            _, times["diff"] = timed(opened.diff)
            _, times["seal"] = timed(opened.seal)
            _, times["commit"] = timed(opened.commit)
        finally:
            if ws is not None:
                ws.close()
        ws = None
        try:
            ws = open_session(backend, base, work / "state-discard")
            make_changes(ws.root, mix, rng)
            ws.sync()
            ws.seal()
            _, times["discard"] = timed(ws.discard)
        finally:
            if ws is not None:
                ws.close()
    finally:
        shutil.rmtree(base, ignore_errors=True)
        for name in ("state-commit", "state-discard"):
            shutil.rmtree(work / name, ignore_errors=True)
    return times


def report(samples: Samples, args: argparse.Namespace, header: str) -> None:
    base = statistics.median(samples.baseline)
    print(header)
    print(f"{args.rounds} rounds; medians in ms, and the ratio to the median cp -a")
    print(f"{'':24}" + "".join(f"{step:>{COLUMN}}" for step in STEPS))
    print(f"{BASELINE:24}{base * 1e3:>12.1f}  1.00x")
    for backend in BACKENDS:
        cells = []
        for step in STEPS:
            median = statistics.median(samples.steps[(backend, step)])
            cells.append(f"{median * 1e3:>{COLUMN - 7}.1f} {median / base:>5.2f}x")
        print(f"{backend:24}" + "".join(cells))


def main() -> int:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--files", type=int, default=10_000, help="files in the generated tree")
    ap.add_argument("--rounds", type=int, default=5, help="measured rounds (medians printed)")
    ap.add_argument("--changes", type=int, default=100, help="changes before diff and discard")
    args = ap.parse_args()
    if os.geteuid() != 0:
        print("workspace: needs root (overlayfs and tmpfs mounts)", file=sys.stderr)
        return 2
    if args.files < 20 or args.rounds < 1 or args.changes < 4:
        ap.error("need --files >= 20, --rounds >= 1 and --changes >= 4")
    mix = ChangeMix.of(min(args.changes, args.files // 4))
    samples = Samples()
    rng = random.Random(SEED)
    with bench_directory() as directory:
        pristine = directory / "tree"
        pristine.mkdir()
        size, dirs = generate_tree(pristine, args.files)
        header = f"{args.files:,} files, {size / 1e6:.1f} MB in {dirs:,} directories; {mix}"
        for round_no in range(1, args.rounds + 1):
            order = [BASELINE, *BACKENDS]
            rng.shuffle(order)  # drift hits every variant alike
            for backend in order:
                if backend == BASELINE:
                    samples.baseline.append(run_baseline(pristine, directory))
                    continue
                for step, seconds in run_backend(backend, pristine, directory, mix, rng).items():
                    samples.add(backend, step, seconds)
            host_create = samples.steps[("host", "create")][-1]
            print(
                f"workspace: round {round_no}/{args.rounds}: cp -a "
                f"{samples.baseline[-1] * 1e3:.0f} ms, host create {host_create * 1e3:.0f} ms",
                file=sys.stderr,
                flush=True,
            )
    report(samples, args, header)
    return 0


if __name__ == "__main__":
    try:
        sys.exit(main())
    except KeyboardInterrupt:  # cleaned up by bench_directory's finally
        print("workspace: interrupted", file=sys.stderr)
        sys.exit(130)
