"""What the agentfs backend does beyond the shared contract (test_workspace_contract.py runs
that on it): the delta really in the AgentFS database, the view synced cheaply and
safely, seal and reopen from another process, the delta limit, and commit recovery.

Real files and real AgentFS databases (the SDK over pyturso); other processes are real
Python processes.
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import stat
import subprocess
import sys
import tempfile
import textwrap
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import trio
from agentfs_sdk import AgentFS, AgentFSOptions

from gatewayd.errors import LimitExceeded, PolicyViolation
from gatewayd.workspace import agentfs as agentfs_module
from gatewayd.workspace.agentfs import AgentFSWorkspace, recover_commit
from gatewayd.workspace.overlay import apply_operation as overlay_apply_operation
from gatewayd.workspace.session import WorkspaceError
from gatewayd.workspace.store import WorkspaceStore
from tests.conftest import ROOT
from tests.integration import test_run_workspaces as runs
from tests.integration.test_workspace_contract import make_base, make_every_kind_of_change, tree

LIMIT = 64 << 10


@pytest.fixture
def base(tmp_path: Path) -> Path:
    return make_base(tmp_path)


@pytest.fixture
def state(tmp_path: Path) -> Path:
    return tmp_path / "state"


@pytest.fixture
def session(base: Path, state: Path) -> Iterator[AgentFSWorkspace]:
    ws = AgentFSWorkspace.create(base, state)
    try:
        yield ws
    finally:
        ws.close()


@pytest.fixture
def limited(base: Path, state: Path) -> Iterator[AgentFSWorkspace]:
    ws = AgentFSWorkspace.create(base, state, max_delta_bytes=LIMIT)
    try:
        yield ws
    finally:
        ws.close()


def in_another_process(code: str) -> str:
    """Run ``code`` in a fresh Python process (gatewayd importable); its stdout."""
    done = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout


def read_database(path: Path) -> dict[str, object]:
    """What an AgentFS reader (the SDK itself, another connection) finds in ``path``."""

    async def read() -> dict[str, object]:
        agent = await AgentFS.open(AgentFSOptions(path=str(path)))
        try:
            db = agent.get_database()
            found: dict[str, object] = {}
            readme = await agent.fs.stat("/README.md")
            found["readme_mode"] = readme.mode
            found["readme"] = await agent.fs.read_file("/README.md", encoding=None)
            link = await agent.fs.stat("/new-link")
            cursor = await db.execute("SELECT target FROM fs_symlink WHERE ino = ?", (link.ino,))
            found["link_mode"] = link.mode
            found["link_target"] = (await cursor.fetchone())[0]
            cursor = await db.execute("SELECT path, parent_path FROM fs_whiteout ORDER BY path")
            found["whiteouts"] = [tuple(row) for row in await cursor.fetchall()]
            cursor = await db.execute("SELECT value FROM fs_overlay_config WHERE key = 'base_path'")
            found["base_path"] = (await cursor.fetchone())[0]
            found["top"] = await agent.fs.readdir("/")
            return found
        finally:
            await agent.close()

    return asyncio.run(read())


# --- the delta is in the database -------------------------------------------------------


def test_seal_leaves_the_delta_in_agentfs_tables_and_removes_the_view(
    session: AgentFSWorkspace, base: Path, state: Path
) -> None:
    make_every_kind_of_change(session)
    os.symlink("README.md", session.root / "new-link")
    os.chmod(session.root / "README.md", 0o600)
    session.seal()
    assert not session.root.exists()
    session.close()  # a sealed session keeps its delta
    found = read_database(state / agentfs_module.DB_NAME)
    assert found["readme_mode"] == stat.S_IFREG | 0o600
    assert found["readme"] == b"# project\n\nline 2, edited\nline three\n"
    assert found["link_mode"] == stat.S_IFLNK | 0o777
    assert found["link_target"] == "README.md"
    # Only the topmost removal is a whiteout; old_dir's children are covered by it.
    assert found["whiteouts"] == [
        ("/docs/guide.txt", "/docs"),
        ("/doomed.txt", "/"),
        ("/old_dir", "/"),
    ]
    assert found["base_path"] == str(base)
    # Only what changed (and the directories holding it) is in the delta.
    assert found["top"] == ["README.md", "docs", "guide-moved.txt", "logo.bin", "new", "new-link"]


def test_a_sealed_session_is_committed_from_another_process(
    session: AgentFSWorkspace, base: Path, state: Path
) -> None:
    make_every_kind_of_change(session)
    os.symlink("src/main.py", session.root / "new-link")
    os.chmod(session.root / "src" / "main.py", 0o755)
    os.chmod(session.root / "src", 0o750)
    expected = tree(session.root)
    before = tree(base)
    session.seal()
    session.close()
    assert tree(base) == before
    out = in_another_process(f"""
        import json
        from pathlib import Path
        from gatewayd.workspace.agentfs import AgentFSWorkspace
        ws = AgentFSWorkspace.reopen(Path({str(base)!r}), Path({str(state)!r}))
        diff = ws.diff()
        print(json.dumps({{"modified": diff.modified, "renamed": diff.renamed,
                           "touched": ws.touched()}}))
        ws.commit()
        """)
    shown = json.loads(out)
    assert shown["modified"] == ["README.md", "logo.bin"]
    assert shown["renamed"] == [["docs/guide.txt", "guide-moved.txt"]]
    assert "old_dir" in shown["touched"]
    assert tree(base) == expected
    assert os.listdir(state) == []


def test_a_session_whose_process_died_is_reopened_with_its_unsynced_changes(
    base: Path, state: Path
) -> None:
    in_another_process(f"""
        import os
        from pathlib import Path
        from gatewayd.workspace.agentfs import AgentFSWorkspace
        ws = AgentFSWorkspace.create(Path({str(base)!r}), Path({str(state)!r}))
        ws.write("synced.txt", b"recorded at once\\n")
        (ws.root / "unsynced.txt").write_bytes(b"only in the view\\n")
        os._exit(0)  # gatewayd dies: no seal, no close
        """)
    ws = AgentFSWorkspace.reopen(base, state)
    try:
        assert ws.is_sealed
        assert not ws.root.exists()  # sealed now: synced, then the view removed
        assert ws.diff().added == ["synced.txt", "unsynced.txt"]
        ws.commit()
    finally:
        ws.close()
    assert (base / "unsynced.txt").read_bytes() == b"only in the view\n"


def test_a_sealed_session_takes_no_more_writes(session: AgentFSWorkspace) -> None:
    session.seal()
    with pytest.raises(WorkspaceError, match=r"is sealed \(its run is over\)"):
        session.write("late.txt", b"too late\n")
    assert session.diff().empty


def test_reopen_refuses_another_base_and_a_missing_database(
    session: AgentFSWorkspace, base: Path, state: Path, tmp_path: Path
) -> None:
    session.seal()
    session.close()
    other = tmp_path / "other"
    other.mkdir()
    with pytest.raises(WorkspaceError, match=f"is a delta over {base}, not over {other}"):
        AgentFSWorkspace.reopen(other, state)
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(WorkspaceError, match="has no AgentFS database"):
        AgentFSWorkspace.reopen(base, empty)


def test_a_discarded_sealed_session_leaves_the_base_and_nothing_else(
    session: AgentFSWorkspace, base: Path, state: Path
) -> None:
    before = tree(base)
    make_every_kind_of_change(session)
    session.seal()
    session.close()
    again = AgentFSWorkspace.reopen(base, state)
    again.discard()
    assert tree(base) == before
    assert os.listdir(state) == []


# --- sync ----------------------------------------------------------------------------------


def test_a_sync_that_finds_nothing_writes_nothing(
    session: AgentFSWorkspace, monkeypatch: pytest.MonkeyPatch
) -> None:
    session.write("a.txt", b"one\n")
    # Past the racy window, one sync re-reads what was written close to the clock tick.
    time.sleep(2 * agentfs_module.RACY_WINDOW_NS / 1e9)
    session.sync()
    calls: list[object] = []
    delta = session._delta
    assert delta is not None
    real_run = delta.run

    def counting_run(coro: object) -> object:
        calls.append(coro)
        return real_run(coro)  # type: ignore[arg-type]

    monkeypatch.setattr(delta, "run", counting_run)
    session.sync()
    session.sync()
    assert calls == []
    (session.root / "a.txt").write_bytes(b"two\n")
    session.sync()
    assert calls  # a real change is written


def test_lending_the_view_and_giving_it_back_puts_nothing_in_the_delta(
    session: AgentFSWorkspace,
) -> None:
    # What the run's lease does to the view: every entry chowned to the run's uid and
    # back (every ctime changes; no content, mode or mtime does).
    owner = os.stat(session.root / "README.md")
    for uid in (54321, owner.st_uid):
        for dirpath, dirnames, filenames in os.walk(session.root):
            for name in dirnames + filenames:
                os.chown(Path(dirpath, name), uid, owner.st_gid, follow_symlinks=False)
    session.sync()
    assert session.delta_operations() == []
    assert session.diff().empty


def test_an_entry_read_close_to_the_clock_tick_is_read_again(session: AgentFSWorkspace) -> None:
    session.write("a.txt", b"aaaa")
    # Same size, same inode, written at once: the kernel's coarse clock may give it the
    # very times the first write had. The record says "read again" instead of trusting it.
    assert session._rows["a.txt"].seen is not None
    assert session._rows["a.txt"].seen[3] == -1
    with open(session.root / "a.txt", "r+b") as out:
        out.write(b"bbbb")
    assert session.diff().unified.endswith("+bbbb\n\\ No newline at end of file\n")


def test_sync_never_follows_a_planted_symlink_or_blocks_on_a_fifo(
    session: AgentFSWorkspace, base: Path, tmp_path: Path
) -> None:
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "secret.txt").write_bytes(b"host secret\n")
    os.symlink(outside, session.root / "dir-link")
    os.symlink(outside / "secret.txt", session.root / "file-link")
    os.mkfifo(session.root / "pipe")
    os.link(session.root / "README.md", session.root / "hard")
    session.sync()
    diff = session.diff()
    assert diff.added == ["dir-link", "file-link", "hard"]
    assert "host secret" not in diff.unified
    session.commit()
    assert os.readlink(base / "dir-link") == str(outside)
    assert not (base / "pipe").exists()  # not workspace content
    assert (base / "hard").read_bytes() == (base / "README.md").read_bytes()
    assert os.stat(base / "hard").st_nlink == 1
    assert sorted(os.listdir(outside)) == ["secret.txt"]


def test_a_name_agentfs_cannot_store_is_refused_by_name_never_dropped(
    session: AgentFSWorkspace,
) -> None:
    odd = os.fsdecode(b"caf\xe9.txt")
    (session.root / odd).write_bytes(b"x\n")
    with pytest.raises(WorkspaceError, match=r"is not valid UTF-8.*rename it"):
        session.sync()
    with pytest.raises(WorkspaceError, match="is not valid UTF-8"):
        session.commit()
    assert session.is_open
    os.rename(session.root / odd, session.root / "cafe.txt")
    assert session.diff().added == ["cafe.txt"]


def test_session_calls_from_trio_worker_threads_do_not_block_the_loop(
    session: AgentFSWorkspace,
) -> None:
    async def main() -> list[str]:
        await trio.to_thread.run_sync(session.write, "t.txt", b"from trio\n")
        diff = await trio.to_thread.run_sync(session.diff)
        return diff.added

    assert trio.run(main) == ["t.txt"]


# --- the delta limit -------------------------------------------------------------------------


def test_a_write_past_the_limit_is_refused_before_it_is_written(
    limited: AgentFSWorkspace, base: Path
) -> None:
    limited.write("fits.bin", b"x" * (LIMIT - 10))
    with pytest.raises(LimitExceeded, match=rf"past the session's delta limit of {LIMIT} bytes"):
        limited.write("more.bin", b"y" * 20)
    assert not (limited.root / "more.bin").exists()
    limited.write("fits.bin", b"z" * LIMIT)  # replacing counts the new size only
    assert limited.diff().added == ["fits.bin"]


def test_a_view_past_the_limit_is_refused_at_sync_until_files_are_removed(
    limited: AgentFSWorkspace, base: Path
) -> None:
    limited.write("kept.txt", b"kept\n")
    (limited.root / "big.bin").write_bytes(b"x" * (LIMIT + 1))
    with pytest.raises(LimitExceeded, match=r"hold \d+ bytes, past the session's delta limit"):
        limited.sync()
    with pytest.raises(LimitExceeded):
        limited.diff()
    with pytest.raises(LimitExceeded):
        limited.commit()
    assert not (base / "kept.txt").exists()
    (limited.root / "big.bin").unlink()
    limited.commit()
    assert (base / "kept.txt").read_bytes() == b"kept\n"


def test_a_flood_of_entries_is_refused_at_sync_whatever_the_byte_limit(
    session: AgentFSWorkspace, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(agentfs_module, "MAX_DELTA_ENTRIES", 8)
    flood = session.root / "flood"
    flood.mkdir()
    for i in range(10):
        (flood / f"{i}.txt").write_bytes(b"")
    with pytest.raises(
        LimitExceeded, match=r"touch 11 entries, past the agentfs backend's limit of 8"
    ):
        session.sync()
    for i in range(5):
        (flood / f"{i}.txt").unlink()
    assert session.diff().added == ["flood/", *(f"flood/{i}.txt" for i in range(5, 10))]


def test_a_seal_past_the_limit_keeps_the_view_and_says_why(
    limited: AgentFSWorkspace, base: Path, state: Path
) -> None:
    before = tree(base)
    (limited.root / "big.bin").write_bytes(b"x" * (LIMIT + 1))
    limited.seal()
    assert (limited.root / "big.bin").exists()  # nothing the sandbox wrote is lost
    with pytest.raises(WorkspaceError, match=r"could not be recorded .*delta limit.*discard"):
        limited.commit()
    # What the database holds can still be shown (the store lists and records it).
    assert limited.diff().empty
    limited.close()
    again = AgentFSWorkspace.reopen(base, state)
    with pytest.raises(WorkspaceError, match="could not be recorded"):
        again.commit()
    again.discard()
    assert tree(base) == before
    assert os.listdir(state) == []


# --- commit recovery ---------------------------------------------------------------------


def _crash_after(monkeypatch: pytest.MonkeyPatch, count: int) -> None:
    real_apply = overlay_apply_operation
    calls = 0

    def crashing(base_fd: int, upper: Path, op: str, rel: str) -> None:
        nonlocal calls
        calls += 1
        if calls > count:
            raise OSError("simulated crash")
        real_apply(base_fd, upper, op, rel)

    monkeypatch.setattr(agentfs_module, "apply_operation", crashing)


def test_an_interrupted_commit_is_finished_by_recovery(
    session: AgentFSWorkspace, base: Path, state: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    make_every_kind_of_change(session)
    os.symlink("README.md", session.root / "new-link")
    expected = tree(session.root)
    _crash_after(monkeypatch, 3)
    with pytest.raises(OSError, match="simulated crash"):
        session.commit()
    assert (state / agentfs_module.JOURNAL_NAME).exists()
    assert tree(base) != expected  # half applied
    monkeypatch.undo()
    with pytest.raises(WorkspaceError, match="was being committed; the commit is finished"):
        AgentFSWorkspace.reopen(base, state)
    assert tree(base) == expected
    assert os.listdir(state) == []
    assert not recover_commit(state)


def test_create_finishes_an_interrupted_commit_first(
    session: AgentFSWorkspace, base: Path, state: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    make_every_kind_of_change(session)
    expected = tree(session.root)
    _crash_after(monkeypatch, 1)
    with pytest.raises(OSError, match="simulated crash"):
        session.commit()
    monkeypatch.undo()
    again = AgentFSWorkspace.create(base, state)
    try:
        assert tree(base) == expected
        assert again.diff().empty
    finally:
        again.close()


def test_a_journal_without_its_export_says_what_is_left(
    session: AgentFSWorkspace, state: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    session.write("README.md", b"changed\n")
    _crash_after(monkeypatch, 0)
    with pytest.raises(OSError, match="simulated crash"):
        session.commit()
    monkeypatch.undo()
    for entry in (state / agentfs_module.UPPER_NAME).iterdir():
        entry.unlink()
    (state / agentfs_module.UPPER_NAME).rmdir()
    with pytest.raises(WorkspaceError, match=r"exported delta .* is gone.*still holds the delta"):
        recover_commit(state)


# --- errors -------------------------------------------------------------------------------


@pytest.mark.parametrize("bad", [0, -1, True, 1.5, "1M"])
def test_an_invalid_delta_limit_is_refused_before_anything_is_made(
    base: Path, state: Path, bad: object
) -> None:
    with pytest.raises(WorkspaceError, match="max_delta_bytes must be a positive number"):
        AgentFSWorkspace.create(base, state, max_delta_bytes=bad)  # type: ignore[arg-type]
    assert not state.exists()


def test_a_failed_copy_leaves_an_empty_state_directory(
    base: Path, state: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def failing_copy(source: Path, dest: Path) -> None:
        raise WorkspaceError(f"copying {source} to {dest} failed: simulated")

    monkeypatch.setattr(agentfs_module, "copy_tree_contents", failing_copy)
    with pytest.raises(WorkspaceError, match="simulated"):
        AgentFSWorkspace.create(base, state)
    assert os.listdir(state) == []


def test_paths_out_of_the_view_are_refused_before_the_limit_is_counted(
    limited: AgentFSWorkspace,
) -> None:
    with pytest.raises(PolicyViolation, match=r"contains '\.\.'"):
        limited.write("../escape.txt", b"x" * (LIMIT * 2))


# --- through the session store -----------------------------------------------------------


def test_a_kept_agentfs_session_is_committed_by_another_process_through_the_store(
    base: Path, tmp_path: Path
) -> None:
    run_id = "a" * 32
    store = WorkspaceStore(tmp_path / "gatewayd-state")
    handle = store.open_session(
        run_id, base, "agentfs", on_end="keep", keep_for_s=3600, max_delta_bytes=None
    )
    make_every_kind_of_change(handle.session)
    os.symlink("README.md", handle.root / "new-link")
    os.chmod(handle.root / "src" / "main.py", 0o700)
    expected = tree(handle.root)
    before = tree(base)
    handle.seal()
    assert store.end_of_run(run_id).startswith("kept until")
    assert tree(base) == before
    out = in_another_process(f"""
        from pathlib import Path
        from gatewayd.workspace.store import WorkspaceStore
        store = WorkspaceStore(Path({str(tmp_path / "gatewayd-state")!r}))
        print(store.info({run_id!r}).mode, len(store.commit({run_id!r}).modified))
        """)
    assert out.split() == ["agentfs", "2"]
    assert tree(base) == expected


# --- a real run in a real sandbox ----------------------------------------------------------


@pytest.mark.skipif(
    os.geteuid() != 0 or not os.path.exists("/usr/bin/bwrap"), reason="needs root and bubblewrap"
)
def test_a_gatewayd_run_on_agentfs_leaves_the_directory_until_commit(tmp_path: Path) -> None:
    # The run's lifecycle (tests/integration/test_run_workspaces.py has its helpers): the
    # view lent to the run's uid, synced after the command, sealed, given back; then the
    # CLI, another process, diffs and commits the kept session from its database.
    base = Path(tempfile.mkdtemp(prefix="cg-afs-", dir="/tmp"))
    base.chmod(0o711)  # the sandbox's uid passes through to its workspace and socket
    try:
        ws = runs.make_workspace(base)
        before = runs.tree(ws)
        proc = runs.gw_run(base, ws, "--workspace-mode", "agentfs")
        assert proc.returncode == 0, proc.stderr
        assert "workspace mode agentfs" in proc.stderr
        assert runs.tree(ws) == before
        run_id = runs.run_id_of(proc)
        state = str(base / "state")
        diff = runs.gw(base, "workspace", "diff", "--state-dir", state, run_id)
        assert diff.returncode == 0, diff.stderr
        assert "+++ b/added.txt" in diff.stdout and "--- a/gone.txt" in diff.stdout
        commit = runs.gw(base, "workspace", "commit", "--state-dir", state, run_id)
        assert commit.returncode == 0, commit.stderr
        after = runs.tree(ws)
        assert after["added.txt"][3] == b"new\n"
        assert after["notes.md"][3] == b"hello\nmore\n"
        assert "gone.txt" not in after
        assert after["run.sh"][1] == 0o600
        assert after["link"][3] == "src"
        assert after["deep/er/f"][3] == b"x\n"
        assert after["src/main.py"][3] == b"print(2)\n"
        assert {entry[2] for entry in after.values()} == {os.stat(ws).st_uid}
    finally:
        shutil.rmtree(base, ignore_errors=True)
