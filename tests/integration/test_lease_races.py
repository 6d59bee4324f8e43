"""The lease against whoever owns the directory that holds a workspace (the owner of
/home/alice owns /home/alice/ws and may rename it at any moment): a real
``renameat2(RENAME_EXCHANGE)`` loop, run by an unprivileged uid, swaps the workspace with a
symlink to a root-owned decoy (a set-user-ID file standing in for /usr/bin/su, a
directory standing in for /etc) or with another directory of its own, while gatewayd
lends the workspace, gives it back at a run's end, and returns a crashed daemon's lease
at the next start.

Whatever the racer wins, the decoys must stay exactly as they were, and the directory
lent must be the one judged (and bound), and come back whole. The decoys live under
/tmp, outside the lendable root, so a regression changes only them.
"""

from __future__ import annotations

import ctypes
import os
import re
import secrets
import shutil
import subprocess
import tempfile
from collections import Counter
from collections.abc import AsyncIterator, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Final

import pytest

from gatewayd.config import GatewaydConfig, SandboxUids
from gatewayd.daemon import Daemon, open_daemon
from gatewayd.runs import Grant, RunRequest
from gatewayd.sandbox.lease import LeaseError, give_back, lend
from gatewayd.sandbox.lendable import LendableRoots, NotLendable
from gatewayd.sandbox.limits import HostUser
from gatewayd.sandbox.session import UnsafeMounts, WorkspaceInUse, clean_leftovers

DEMO = Path(__file__).resolve().parents[2] / "policies" / "examples" / "demo.yaml"
PY = "/usr/bin/python3"
SETPRIV = "/usr/bin/setpriv"
# The racer: an unprivileged user, the owner of the workspace's parent directory.
RACER_UID: Final = 3_100_000 + secrets.randbelow(100_000)
# The uid a lease-level test lends to (the daemon-level tests take one from their pool).
SANDBOX: Final = HostUser(uid=4_300_000 + secrets.randbelow(100_000), gid=4_300_000)
# How often each race is run. The code before the descriptor-based lease lost every one
# well within these counts (a decoy changed after a few hundred lend cycles at most; a
# run's end or the next start left the tree unreturned within the first attempts,
# whenever its path was the symlink), and each test still takes seconds. A cycle (lend,
# give back) takes about a millisecond, so one racer serves many; an attempt (a daemon's
# run) takes tens, so each has its own racer.
LEND_CYCLES: Final = 2000
RECOVERY_CYCLES: Final = 400
RUN_END_ATTEMPTS: Final = 40
PINNED_ATTEMPTS: Final = 40
# The racer looks at its stdin (the test's "stop") once per this many swaps.
SWAPS_PER_POLL: Final = 64
_AS_RACER: Final = (SETPRIV, f"--reuid={RACER_UID}", f"--regid={RACER_UID}", "--clear-groups")
_AT_FDCWD: Final = -100
_RENAME_EXCHANGE: Final = 2

RACER = f"""
import ctypes, os, select, sys
libc = ctypes.CDLL(None, use_errno=True)
a, b = os.fsencode(sys.argv[1]), os.fsencode(sys.argv[2])
os.write(1, b"racing as %d %d %d\\n" % (os.getuid(), os.geteuid(), len(os.getgroups())))
swaps = 0
while not select.select([0], [], [], 0)[0]:  # until the test closes our stdin
    for _ in range({SWAPS_PER_POLL}):
        swaps += libc.renameat2({_AT_FDCWD}, a, {_AT_FDCWD}, b, {_RENAME_EXCHANGE}) == 0
os.write(1, b"%d\\n" % swaps)
"""


def _unavailable() -> str | None:
    if os.geteuid() != 0:
        return "lending needs root (chown, a uid per run)"
    for tool in ("/usr/bin/bwrap", PY, SETPRIV):
        if not os.path.exists(tool):
            return f"needs {tool}"
    return None


pytestmark = pytest.mark.skipif(_unavailable() is not None, reason=str(_unavailable()))


@contextmanager
def racing(a: Path, b: Path, swaps: list[int]) -> Iterator[None]:
    """Exchange ``a`` and ``b`` over and over, as :data:`RACER_UID`, from before the body
    starts until it ends; appends how many exchanges happened to ``swaps``."""
    proc = subprocess.Popen(
        [*_AS_RACER, PY, "-I", "-S", "-c", RACER, str(a), str(b)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
    )
    assert proc.stdin is not None and proc.stdout is not None
    try:
        # An ordinary user: no root uid, no supplementary group (and so no capability).
        assert proc.stdout.readline() == f"racing as {RACER_UID} {RACER_UID} 0\n".encode()
        yield
    finally:
        proc.stdin.close()
        line = proc.stdout.readline()
        assert proc.wait() == 0
        swaps.append(int(line))


class Decoys:
    """Root-owned stand-ins for the system, outside the lendable root: what a symlink
    swapped in for the workspace leads to."""

    def __init__(self, base: Path) -> None:
        system = base / "system"
        system.mkdir()
        self.su = system / "su"
        self.su.write_bytes(b"#!/bin/sh\n")
        self.su.chmod(0o4755)
        self.etc = system / "etc"
        self.etc.mkdir()
        (self.etc / "passwd").write_text("root:x:0:0::/root:/bin/sh\n")
        self.before = self.state()

    def target(self, kind: str) -> Path:
        return self.su if kind == "file" else self.etc

    def state(self) -> list[tuple[int, int, int]]:
        return [
            (st.st_uid, st.st_gid, st.st_mode)
            for st in map(os.lstat, (self.su, self.etc, self.etc / "passwd"))
        ]

    def assert_untouched(self, step: str) -> None:
        assert self.state() == self.before, f"{step}: a decoy changed"


class Homes:
    """The lendable root, and in it one home per attempt, owned by the racer, holding the
    workspace and the name the racer swaps it with."""

    def __init__(self, base: Path) -> None:
        self.root = base / "homes"
        self.root.mkdir()
        self.count = 0

    def make(self, swap_with: Path | None) -> tuple[Path, Path]:
        """A fresh home's workspace (with a file and a subdirectory) and the other name:
        a symlink to ``swap_with``, or, for None, a second workspace of the racer's."""
        self.count += 1
        home = self.root / f"home{self.count}"
        ws, other = home / "ws", home / "other"
        for path in (home, ws, ws / "sub"):
            path.mkdir()
        (ws / "notes.txt").write_text("mine\n")
        (ws / "sub" / "deep.txt").write_text("mine too\n")
        if swap_with is None:
            other.mkdir()
            (other / "notes.txt").write_text("the other one\n")
        else:
            other.symlink_to(swap_with)
        for path in (home, *_entries(home)):
            os.lchown(path, RACER_UID, RACER_UID)
        return ws, other


def _entries(tree: Path) -> list[Path]:
    """Every entry beneath ``tree``, never through a symlink."""
    found = []
    for top, dirs, files in os.walk(tree):
        found += [Path(top) / name for name in dirs + files]
    return found


def _owners(tree: Path) -> set[int]:
    """The owners of ``tree`` (a directory, or /proc/self/fd/N of one) and all in it."""
    return {os.stat(tree).st_uid} | {os.lstat(path).st_uid for path in _entries(tree)}


def _identity(path: Path) -> tuple[int, int]:
    st = os.lstat(path)
    return (st.st_dev, st.st_ino)


def _found(home: Path, identity: tuple[int, int]) -> Path:
    """Under which of its names in ``home`` the directory ``identity`` is now."""
    (path,) = [p for p in home.iterdir() if _identity(p) == identity]
    return path


def _exchange(a: Path, b: Path) -> None:
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.renameat2(_AT_FDCWD, bytes(a), _AT_FDCWD, bytes(b), _RENAME_EXCHANGE) != 0:
        raise OSError(ctypes.get_errno(), f"renameat2 {a} {b}")


@pytest.fixture
def base() -> Iterator[Path]:
    path = Path(tempfile.mkdtemp(prefix="cg-race-", dir="/tmp"))
    path.chmod(0o711)  # the racer and the sandbox pass through
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


# --- lending ------------------------------------------------------------------------------


@pytest.mark.parametrize("kind", ["file", "directory"])
def test_lending_under_a_racer_changes_only_the_directory_judged_never_a_symlinks_target(
    base: Path, kind: str
) -> None:
    decoys = Decoys(base)
    homes = Homes(base)
    roots = LendableRoots(configured=(homes.root,))
    ws, other = homes.make(decoys.target(kind))
    workspace = _identity(ws)
    held = os.open(ws, os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC)
    tree = Path(f"/proc/self/fd/{held}")  # the directory, wherever the racer puts it
    swaps: list[int] = []
    outcomes: Counter[str] = Counter()
    try:
        with racing(ws, other, swaps):
            for cycle in range(LEND_CYCLES):
                try:
                    lease = lend([ws], SANDBOX, base, roots=roots)
                    refusal = ""
                except (NotLendable, LeaseError) as exc:
                    lease, refusal = None, str(exc)
                decoys.assert_untouched(f"cycle {cycle}")
                if lease is None:
                    # The path was a symlink when it was opened: nothing lent, said so.
                    outcomes["refused"] += 1
                    assert refusal == f"{ws} cannot be lent: it is a symlink; name a directory"
                    assert _owners(tree) == {RACER_UID}, f"cycle {cycle}: refused, yet lent"
                    continue
                outcomes["lent"] += 1
                assert [t.identity for t in lease.trees] == [workspace]
                assert _owners(tree) == {SANDBOX.uid}, f"cycle {cycle}: not all of it lent"
                give_back(lease, held={str(ws): held})  # a live run's way
                decoys.assert_untouched(f"cycle {cycle}")
                assert _owners(tree) == {RACER_UID}, f"cycle {cycle}: not given back"
    finally:
        os.close(held)
    assert sum(swaps) > 0, "the racer never swapped: the test proved nothing"
    assert outcomes["lent"] > 0 and outcomes["refused"] > 0, outcomes


# --- giving back at a run's end -----------------------------------------------------------


@pytest.fixture
async def daemon(base: Path) -> AsyncIterator[Daemon]:
    config = GatewaydConfig(
        state_dir=base / "state",
        policy_dirs=(DEMO.parent,),
        netns_prefix=f"cgt{secrets.token_hex(4)}-",
        sandbox_uids=SandboxUids(base=1_700_000_000 + secrets.randbelow(50_000) * 1024, count=64),
        lendable_roots=(base / "homes",),
        # The races are those of lending the workspace directory itself to the sandbox.
        workspace_mode="host",
    )
    (base / "homes").mkdir()
    async with open_daemon(config, preload=True) as live:
        assert live.runs.support.available, live.runs.support.reason
        yield live


def _request(workspace: Path) -> RunRequest:
    return RunRequest(
        workspacePath=str(workspace),
        policy="demo",
        actorId="tester",
        tenantId="t1",
        grant=Grant(allowSandbox=True),
    )


class _ExistingRoot(Homes):
    def __init__(self, base: Path) -> None:  # the daemon fixture made the root
        self.root = base / "homes"
        self.count = 0


@pytest.mark.parametrize("kind", ["file", "directory"])
async def test_a_runs_end_under_a_racer_gives_back_the_whole_directory_lent_and_nothing_else(
    base: Path, daemon: Daemon, kind: str
) -> None:
    decoys = Decoys(base)
    homes = _ExistingRoot(base)
    swaps: list[int] = []
    for attempt in range(RUN_END_ATTEMPTS):
        ws, other = homes.make(decoys.target(kind))
        workspace = _identity(ws)
        run = await daemon.runs.start(_request(ws))
        assert run.sandbox is not None
        made = await daemon.runs.exec(
            run.run_id, ["sh", "-c", "echo made > /workspace/made.txt && mkdir /workspace/new"]
        )
        assert made.exitCode == 0, made.stderr
        with racing(ws, other, swaps):
            await daemon.runs.end(run.run_id)
        decoys.assert_untouched(f"attempt {attempt}")
        tree = _found(ws.parent, workspace)
        # Wherever the racer left it, all of it is its owner's again, the run's files too.
        assert _owners(tree) == {RACER_UID}, f"attempt {attempt}: not given back"
        assert (tree / "made.txt").read_text() == "made\n"
    assert sum(swaps) > 0, "the racer never swapped: the test proved nothing"


# --- a crashed daemon's lease, returned at the next start -----------------------------------


@pytest.mark.parametrize("kind", ["file", "directory"])
def test_a_crashed_daemons_lease_is_returned_under_a_racer_only_to_the_directory_lent(
    base: Path, kind: str
) -> None:
    decoys = Decoys(base)
    homes = Homes(base)
    roots = LendableRoots(configured=(homes.root,))
    runs = base / "state" / "runs"
    runs.mkdir(parents=True)
    ws, other = homes.make(decoys.target(kind))
    workspace = _identity(ws)
    held = os.open(ws, os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC)
    tree = Path(f"/proc/self/fd/{held}")  # the directory, wherever the racer puts it
    swaps: list[int] = []
    outcomes: Counter[str] = Counter()
    try:
        with racing(ws, other, swaps):
            for cycle in range(RECOVERY_CYCLES):
                run_dir = runs / secrets.token_hex(16)
                run_dir.mkdir()
                try:  # a run's start, its lease recorded in its directory
                    lease = lend([ws], SANDBOX, run_dir, roots=roots)
                except NotLendable:
                    run_dir.rmdir()
                    continue
                made = tree / f"made{cycle}.txt"  # what the run made, as its uid
                made.write_text("the run's\n")
                os.chown(made, SANDBOX.uid, SANDBOX.gid)
                # The daemon died; the next one starts.
                cleaned = clean_leftovers(runs, None)
                decoys.assert_untouched(f"cycle {cycle}")
                if cleaned.get("failed"):
                    # The path led elsewhere when it was opened: nothing changed, the
                    # record stays, and the message says what to do.
                    outcomes["kept"] += 1
                    (failure,) = cleaned["failed"]
                    assert failure.startswith(f"{run_dir.name}: could not give back: {ws}: ")
                    assert "nothing of it was changed, and the lease record stays" in failure
                    assert f"put the directory lent back at {ws}" in failure, failure
                    assert (run_dir / "lease.json").is_file()
                    assert _owners(tree) == {SANDBOX.uid}, f"cycle {cycle}: half given back"
                    give_back(lease, held={str(ws): held})  # done with this one
                    shutil.rmtree(run_dir)
                else:
                    outcomes["returned"] += 1
                    assert cleaned == {
                        "leasesReturned": [str(ws)],
                        "runDirs": [run_dir.name],
                        "netns": [],
                    }
                    assert not run_dir.exists()
                assert _owners(tree) == {RACER_UID}, f"cycle {cycle}: not given back"
        # Once the directory is back at its path, the kept record is returned.
        if _identity(ws) != workspace:
            _exchange(ws, other)
        run_dir = runs / secrets.token_hex(16)
        run_dir.mkdir()
        lend([ws], SANDBOX, run_dir, roots=roots)
        _exchange(ws, other)  # moved away: kept
        assert clean_leftovers(runs, None)["failed"]
        assert _owners(tree) == {SANDBOX.uid}
        _exchange(ws, other)  # put back: returned
        assert clean_leftovers(runs, None)["leasesReturned"] == [str(ws)]
        assert _owners(tree) == {RACER_UID}
    finally:
        os.close(held)
    assert sum(swaps) > 0, "the racer never swapped: the test proved nothing"
    assert outcomes["kept"] > 0 and outcomes["returned"] > 0, outcomes


# --- what the sandbox binds is what is lent -------------------------------------------------


async def test_a_run_is_lent_exactly_the_directory_its_sandbox_binds_while_the_path_is_swapped(
    base: Path, daemon: Daemon
) -> None:
    homes = _ExistingRoot(base)
    swaps: list[int] = []
    outcomes: Counter[str] = Counter()
    pinned_refusal = (
        "{ws} is no longer the directory the run was created with; refusing to bind "
        "whatever is there now"
    )
    lent_refusal = (
        r"cannot lend run [0-9a-f]{{32}}'s workspace: {ws} is no longer the directory the "
        r"run's sandbox binds \(device and inode \d+:\d+, now \d+:\d+: it was replaced "
        r"after the run was created\); nothing was lent"
    )
    for attempt in range(PINNED_ATTEMPTS):
        ws, other = homes.make(None)  # two directories of the racer's: ws and other
        with racing(ws, other, swaps):
            try:
                # The sandbox's own pinning and lending race here, not a session's
                # snapshot (a copy of a tree being swapped fails, refusing the run).
                run = await daemon.runs.start(_request(ws), workspace_session=False)
                refusal = ""
            except (UnsafeMounts, WorkspaceInUse) as exc:
                refusal = str(exc)
        if refusal:
            # The path led to the other directory by the time it was pinned (the policy's
            # workspace grant is pinned since the run's creation) or lent: refused.
            if refusal == pinned_refusal.format(ws=ws):
                outcomes["refused when pinned"] += 1
            else:
                assert re.fullmatch(lent_refusal.format(ws=re.escape(str(ws))), refusal), refusal
                outcomes["refused when lent"] += 1
            assert _owners(ws) == _owners(other) == {RACER_UID}
            continue
        outcomes["started"] += 1
        assert run.sandbox is not None
        uid = run.sandbox.user.uid
        # From inside: the directory bound at /workspace is the one lent (writable).
        wrote = await daemon.runs.exec(
            run.run_id, ["sh", "-c", "cat /workspace/notes.txt && echo w > /workspace/w.txt"]
        )
        assert wrote.exitCode == 0, f"attempt {attempt}: {wrote.stderr!r}"
        bound = ws if (ws / "w.txt").exists() else other
        assert wrote.stdout == (bound / "notes.txt").read_bytes()
        # ... and the only one lent: the other is all its owner's.
        assert _owners(bound) == {uid}
        assert _owners(other if bound == ws else ws) == {RACER_UID}
        await daemon.runs.end(run.run_id)
        assert _owners(ws) == _owners(other) == {RACER_UID}
    assert sum(swaps) > 0, "the racer never swapped: the test proved nothing"
    # Both checks met the race, and runs still start under it.
    assert all(outcomes[k] for k in ("started", "refused when pinned", "refused when lent")), (
        outcomes
    )
