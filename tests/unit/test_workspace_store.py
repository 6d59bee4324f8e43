"""The session store (gatewayd/workspace/store.py) on real directories and real overlay
mounts: a run's session from open to seal to its end, then diff, commit and discard
from another store instance (as `gatewayd workspace ...` does from another process), the
conflict check, the lock, expiry and recovery after a crash."""

from __future__ import annotations

import json
import os
import stat
import subprocess
import sys
import time
from collections.abc import Iterator, Mapping
from pathlib import Path

import pytest

from gatewayd.errors import InvalidArguments, LimitExceeded
from gatewayd.protocol import ErrorCode
from gatewayd.workspace import WorkspaceError
from gatewayd.workspace.store import (
    MAX_KEEP_FOR_S,
    DeltaTooLarge,
    RunWorkspace,
    WorkspaceBusy,
    WorkspaceConflict,
    WorkspaceNotFound,
    WorkspaceStore,
    _mounts_under,
    iso_time,
)
from tests.workspace_helpers import commit_in_child, run_child, tree, unmount_all_under

RUN = "a" * 32
OTHER_RUN = "b" * 32
KEEP_S = 3600
# Roomy for what the tests write, so the limited overlay runs every test.
DELTA_LIMIT = 4 << 20

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="overlay mounts need root")


def make_base(where: Path) -> Path:
    base = where / "base"
    (base / "src").mkdir(parents=True)
    (base / "gone").mkdir()
    (base / "gone" / "x.txt").write_text("x\n")
    (base / "src" / "main.py").write_text("print(1)\n")
    (base / "src" / "other.py").write_text("other\n")
    (base / "README").write_text("readme\n")
    os.symlink("src/main.py", base / "link")
    return base


@pytest.fixture
def where(tmp_path: Path) -> Iterator[Path]:
    yield tmp_path
    unmount_all_under(tmp_path)


@pytest.fixture(params=["host", "overlay", "overlay-limited"])
def kind(request: pytest.FixtureRequest) -> str:
    return str(request.param)


def open_run(
    store: WorkspaceStore,
    base: Path,
    kind: str,
    *,
    run_id: str = RUN,
    on_end: str = "keep",
    keep_for_s: int = KEEP_S,
    max_delta_bytes: int | None = None,
) -> RunWorkspace:
    mode = "host" if kind == "host" else "overlay"
    if kind == "overlay-limited" and max_delta_bytes is None:
        max_delta_bytes = DELTA_LIMIT
    return store.open_session(
        run_id,
        base,
        mode,  # type: ignore[arg-type]
        on_end=on_end,  # type: ignore[arg-type]
        keep_for_s=keep_for_s,
        max_delta_bytes=max_delta_bytes,
    )


def kept_new_file(where: Path, kind: str) -> tuple[Path, WorkspaceStore, RunWorkspace]:
    """A base, a store in ``where``, and the run's session that added new.txt, kept."""
    base = make_base(where)
    store = WorkspaceStore(where / "state")
    handle = open_run(store, base, kind)
    (handle.root / "new.txt").write_text("n\n")
    store.end_of_run(RUN)
    return base, store, handle


def run_writes(handle: RunWorkspace) -> None:
    """What a run does in its workspace: add, modify, delete a file and a directory."""
    root = handle.root
    (root / "src" / "main.py").write_text("print(2)\n")
    (root / "new.txt").write_text("new\n")
    (root / "README").unlink()
    subprocess.run(["rm", "-rf", str(root / "gone")], check=True)


def test_a_kept_session_commits_from_another_store(where: Path, kind: str) -> None:
    base = make_base(where)
    before = tree(base)
    store = WorkspaceStore(where / "state")
    handle = open_run(store, base, kind)
    assert handle.directory == where / "state" / "workspaces" / RUN
    assert stat.S_IMODE(os.stat(handle.directory).st_mode) == 0o700
    assert handle.mode == ("host" if kind == "host" else "overlay")
    run_writes(handle)
    if kind != "host":
        assert tree(base) == before, "an overlay run writes nothing to the base"
    handle.seal()
    assert handle.info.state == "kept"
    assert handle.info.counts["added"] == 1 and handle.info.counts["modified"] == 1
    if kind != "host":
        assert not os.path.ismount(handle.root), "seal unmounts the merged view"
    outcome = store.end_of_run(RUN)
    assert outcome.startswith("kept until ")
    assert iso_time(time.time() + KEEP_S)[:13] in outcome

    # Another process: a new store on the same state directory, no mount.
    other = WorkspaceStore(where / "state")
    [info] = other.list()
    assert info.run_id == RUN and info.state == "kept" and info.keep_until is not None
    diff = other.diff(RUN)
    assert diff.added == ["new.txt"]
    assert diff.modified == ["src/main.py"]
    assert sorted(diff.removed) == ["README", "gone/", "gone/x.txt"]
    if kind != "host":
        assert tree(base) == before
    committed = other.commit(RUN)
    assert committed.added == ["new.txt"]
    assert (base / "src" / "main.py").read_text() == "print(2)\n"
    assert (base / "new.txt").read_text() == "new\n"
    assert not (base / "README").exists() and not (base / "gone").exists()
    assert os.readlink(base / "link") == "src/main.py"
    assert not handle.directory.exists(), "a committed session leaves nothing"
    assert other.list() == []
    with pytest.raises(WorkspaceNotFound) as caught:
        other.diff(RUN)
    assert caught.value.code is ErrorCode.BAD_REQUEST
    assert "gatewayd workspace list" in str(caught.value)


def test_discard_leaves_the_base_exactly_as_before(where: Path, kind: str) -> None:
    base = make_base(where)
    os.chmod(base / "src" / "main.py", 0o751)
    before = tree(base)
    store = WorkspaceStore(where / "state")
    handle = open_run(store, base, kind)
    run_writes(handle)
    os.chmod(handle.root / "src" / "other.py", 0o600)
    handle.seal()
    store.end_of_run(RUN)
    WorkspaceStore(where / "state").discard(RUN)
    assert tree(base) == before
    assert not handle.directory.exists()


@pytest.mark.parametrize("on_end", ["commit", "discard"])
def test_on_end_is_applied_at_the_end_of_the_run(where: Path, kind: str, on_end: str) -> None:
    base = make_base(where)
    before = tree(base)
    store = WorkspaceStore(where / "state")
    handle = open_run(store, base, kind, on_end=on_end)
    run_writes(handle)
    # end_of_run seals a session its caller did not.
    assert store.end_of_run(RUN) == ("committed" if on_end == "commit" else "discarded")
    if on_end == "commit":
        assert (base / "new.txt").exists() and not (base / "README").exists()
    else:
        assert tree(base) == before
    assert store.list() == []


def test_an_interrupted_run_is_kept_instead_of_committed(where: Path, kind: str) -> None:
    base = make_base(where)
    store = WorkspaceStore(where / "state")
    handle = open_run(store, base, kind, on_end="commit")
    (handle.root / "half.txt").write_text("half\n")
    outcome = store.end_of_run(RUN, interrupted="its time ran out")
    assert outcome.startswith("kept until ") and "commit skipped: its time ran out" in outcome
    (info,) = store.list()
    assert info.state == "kept" and info.note == "commit skipped: its time ran out"
    if kind != "host":  # host mode wrote the base during the run; discard restores it
        assert not (base / "half.txt").exists()
    store.discard(RUN)
    assert not (base / "half.txt").exists()


def test_an_on_end_override_discards_whatever_the_session_said(where: Path, kind: str) -> None:
    base = make_base(where)
    before = tree(base)
    store = WorkspaceStore(where / "state")
    handle = open_run(store, base, kind, on_end="commit")
    run_writes(handle)
    assert store.end_of_run(RUN, on_end="discard") == "discarded"
    assert tree(base) == before and store.list() == []


def test_commit_refuses_a_conflict_naming_the_files(where: Path) -> None:
    base = make_base(where)
    store = WorkspaceStore(where / "state")
    handle = open_run(store, base, "overlay")
    run_writes(handle)
    (handle.root / "src" / "other.py").chmod(0o600)
    store.end_of_run(RUN)
    # After the run: the operator edits a file the delta rewrites, adds one in a
    # directory the delta removes, and edits one the delta does not touch.
    (base / "src" / "main.py").write_text("operator's edit\n")
    (base / "gone" / "late.txt").write_text("late\n")
    (base / "src" / "untouched.txt").write_text("fine\n")
    with pytest.raises(WorkspaceConflict) as caught:
        store.commit(RUN)
    assert caught.value.paths == ["gone", "src/main.py"]
    message = str(caught.value)
    assert "gone, src/main.py" in message and "nothing was committed" in message
    assert caught.value.code is ErrorCode.TOOL_FAILED
    assert (base / "src" / "main.py").read_text() == "operator's edit\n"
    assert (base / "README").exists()
    assert store.info(RUN).state == "kept"
    # A mode change in the delta is a touch too; discard always works.
    (base / "src" / "other.py").write_text("edited\n")
    with pytest.raises(WorkspaceConflict) as again:
        store.commit(RUN)
    assert "src/other.py" in again.value.paths
    store.discard(RUN)
    assert (base / "src" / "main.py").read_text() == "operator's edit\n"
    assert (base / "src" / "other.py").read_text() == "edited\n"


def test_a_base_changed_back_and_forth_outside_the_delta_commits(where: Path) -> None:
    base = make_base(where)
    store = WorkspaceStore(where / "state")
    handle = open_run(store, base, "overlay")
    (handle.root / "src" / "main.py").write_text("run\n")
    store.end_of_run(RUN)
    # src is only merged into: a new file beside the touched one is no conflict.
    (base / "src" / "beside.txt").write_text("b\n")
    store.commit(RUN)
    assert (base / "src" / "main.py").read_text() == "run\n"
    assert (base / "src" / "beside.txt").read_text() == "b\n"


def test_on_end_commit_with_a_conflict_keeps_the_session(where: Path) -> None:
    base = make_base(where)
    store = WorkspaceStore(where / "state")
    handle = open_run(store, base, "overlay", on_end="commit")
    (handle.root / "README").write_text("run\n")
    handle.seal()
    (base / "README").write_text("operator\n")
    outcome = store.end_of_run(RUN)
    assert outcome.startswith("kept until ") and "commit refused" in outcome
    assert "README" in outcome
    info = store.info(RUN)
    assert info.state == "kept" and info.note is not None and "README" in info.note
    store.discard(RUN)


def test_a_live_session_is_refused_commit_and_discard(where: Path, kind: str) -> None:
    base = make_base(where)
    store = WorkspaceStore(where / "state")
    handle = open_run(store, base, kind)
    (handle.root / "new.txt").write_text("n\n")
    assert store.diff(RUN).added == ["new.txt"], "a live session's diff is its view"
    for operation in (store.commit, store.discard):
        with pytest.raises(WorkspaceBusy, match="still live"):
            operation(RUN)
    # Another process: the lock the live run holds refuses it.
    other = WorkspaceStore(where / "state")
    with pytest.raises(WorkspaceBusy) as caught:
        other.commit(RUN)
    assert "in use" in str(caught.value) and caught.value.code is ErrorCode.TOOL_FAILED
    with pytest.raises(WorkspaceBusy):
        other.diff(RUN)
    assert other.info(RUN).state == "live"
    store.end_of_run(RUN)
    other.discard(RUN)


def test_a_second_command_is_refused_while_one_holds_the_lock(where: Path) -> None:
    base, store, handle = kept_new_file(where, "overlay")
    holder = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import fcntl, sys, time\n"
            f"f = open({str(handle.directory / 'lock')!r}, 'a')\n"
            "fcntl.flock(f, fcntl.LOCK_EX)\n"
            "print('held', flush=True)\n"
            "time.sleep(60)\n",
        ],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert holder.stdout is not None and holder.stdout.readline() == "held\n"
        for operation in (store.commit, store.discard, store.diff):
            with pytest.raises(WorkspaceBusy, match="another command"):
                operation(RUN)
        assert store.expire(now=time.time() + 2 * KEEP_S) == [], "busy: left for later"
    finally:
        holder.kill()
        holder.wait()
    assert not (base / "new.txt").exists()
    store.commit(RUN)
    assert (base / "new.txt").exists()


def test_expiry_discards_kept_sessions_past_their_time(where: Path, kind: str) -> None:
    base = make_base(where)
    before = tree(base)
    store = WorkspaceStore(where / "state")
    handle = open_run(store, base, kind, keep_for_s=60)
    run_writes(handle)
    store.end_of_run(RUN)
    second = open_run(store, make_base(where / "other"), "overlay", run_id=OTHER_RUN)
    store.end_of_run(OTHER_RUN)
    assert second.info.keep_until is None  # the handle's record is from before the end
    assert store.expire(now=time.time() + 30) == []
    keep_until = store.info(RUN).keep_until
    assert keep_until is not None
    # OTHER_RUN is kept an hour, RUN a minute.
    assert store.expire(now=keep_until + 1) == [RUN]
    assert tree(base) == before
    assert [info.run_id for info in store.list()] == [OTHER_RUN]
    store.discard(OTHER_RUN)


def test_host_delta_past_its_limit_cannot_be_committed(where: Path) -> None:
    base = make_base(where)
    store = WorkspaceStore(where / "state")
    handle = open_run(store, base, "host", on_end="commit", max_delta_bytes=100)
    (handle.root / "big.bin").write_bytes(b"x" * 1000)
    outcome = store.end_of_run(RUN)
    assert "commit refused" in outcome and "past its limit of 100" in outcome
    info = store.info(RUN)
    assert info.state == "kept" and info.delta_bytes == 1000
    with pytest.raises(DeltaTooLarge) as caught:
        store.commit(RUN)
    assert caught.value.code is ErrorCode.LIMIT_EXCEEDED
    assert isinstance(caught.value, LimitExceeded)
    assert f"gatewayd workspace discard {RUN}" in str(caught.value)
    store.discard(RUN)
    assert not (base / "big.bin").exists()


def test_overlay_delta_limit_holds_while_the_run_writes(where: Path) -> None:
    base = make_base(where)
    store = WorkspaceStore(where / "state")
    handle = open_run(store, base, "overlay", max_delta_bytes=256 << 10)
    with pytest.raises(OSError) as caught:
        (handle.root / "big.bin").write_bytes(b"x" * (1 << 20))
    assert caught.value.errno == 28  # ENOSPC
    store.end_of_run(RUN)
    store.discard(RUN)


@pytest.mark.parametrize(
    ("changes", "code", "fragment"),
    [
        ({"run_id": "../etc"}, ErrorCode.INVALID_ARGS, "is not a run id"),
        ({"run_id": "A" * 32}, ErrorCode.INVALID_ARGS, "is not a run id"),
        ({"mode": "tmpfs"}, ErrorCode.INVALID_ARGS, "the modes are host, overlay, agentfs"),
        ({"on_end": "later"}, ErrorCode.INVALID_ARGS, "keep, commit, discard"),
        ({"keep_for_s": 0}, ErrorCode.INVALID_ARGS, f"1 to {MAX_KEEP_FOR_S}"),
        ({"keep_for_s": MAX_KEEP_FOR_S + 1}, ErrorCode.INVALID_ARGS, "90 days"),
        ({"keep_for_s": True}, ErrorCode.INVALID_ARGS, "whole seconds"),
        ({"max_delta_bytes": 0}, ErrorCode.INVALID_ARGS, "positive number of bytes"),
    ],
)
def test_open_session_refuses_bad_arguments(
    where: Path, changes: dict[str, object], code: ErrorCode, fragment: str
) -> None:
    base = make_base(where)
    arguments: dict[str, object] = {
        "run_id": RUN,
        "base": base,
        "mode": "overlay",
        "on_end": "keep",
        "keep_for_s": KEEP_S,
        "max_delta_bytes": None,
    } | changes
    store = WorkspaceStore(where / "state")
    with pytest.raises(InvalidArguments) as caught:
        store.open_session(
            str(arguments.pop("run_id")),
            Path(str(arguments.pop("base"))),
            arguments.pop("mode"),  # type: ignore[arg-type]
            **arguments,  # type: ignore[arg-type]
        )
    assert caught.value.code is code
    assert fragment in str(caught.value)
    assert store.list() == []


def test_open_session_refuses_a_base_holding_the_store(where: Path) -> None:
    base = make_base(where)
    store = WorkspaceStore(base / "state")
    with pytest.raises(WorkspaceError, match="holds gatewayd's workspace store"):
        open_run(store, base, "overlay")
    inside = WorkspaceStore(where / "state")
    (where / "state" / "workspaces" / "x").mkdir(parents=True)
    with pytest.raises(WorkspaceError, match="inside gatewayd's store"):
        open_run(inside, where / "state" / "workspaces" / "x", "overlay")
    with pytest.raises(WorkspaceError, match="not a directory"):
        open_run(inside, base / "README", "overlay")


def test_a_failed_open_leaves_nothing_and_gives_nothing_to_recover(where: Path) -> None:
    base = make_base(where)
    store = WorkspaceStore(where / "state")

    def refuse(directory: Path) -> None:
        (directory / "marker").write_text("x")
        raise WorkspaceError("lending refused")

    with pytest.raises(WorkspaceError, match="lending refused"):
        store.open_session(
            RUN,
            base,
            "overlay",
            on_end="keep",
            keep_for_s=KEEP_S,
            max_delta_bytes=None,
            before_mount=refuse,
        )
    assert not (where / "state" / "workspaces" / RUN).exists()
    open_run(store, base, "overlay")
    with pytest.raises(WorkspaceError, match="already has a workspace session"):
        open_run(store, base, "overlay")
    store.end_of_run(RUN)
    store.discard(RUN)


def test_end_of_run_of_an_unknown_run_is_refused(where: Path) -> None:
    with pytest.raises(WorkspaceNotFound, match="no live workspace session"):
        WorkspaceStore(where / "state").end_of_run(RUN)
    with pytest.raises(WorkspaceNotFound, match="never made"):
        WorkspaceStore(where / "state").commit(RUN)


def test_records_are_private(where: Path) -> None:
    base = make_base(where)
    store = WorkspaceStore(where / "state")
    handle = open_run(store, base, "overlay")
    meta = json.loads((handle.directory / "meta.json").read_text())
    assert meta["state"] == "live" and meta["base"] == str(base)
    for name in ("meta.json", "lock"):
        assert stat.S_IMODE(os.stat(handle.directory / name).st_mode) == 0o600
    store.end_of_run(RUN)
    assert stat.S_IMODE(os.stat(handle.directory / "seal.json").st_mode) == 0o600
    store.discard(RUN)


def test_recover_keeps_the_session_a_dead_daemon_left_live(where: Path, kind: str) -> None:
    base = make_base(where)
    before = tree(base)
    state = where / "state"
    # A daemon process opens a session, writes, and dies without ending the run.
    child = run_child(
        f"h = WorkspaceStore(Path({str(state)!r})).open_session({RUN!r}, "
        f"Path({str(base)!r}), {('host' if kind == 'host' else 'overlay')!r}, "
        "on_end='commit', keep_for_s=3600, "
        f"max_delta_bytes={DELTA_LIMIT if kind == 'overlay-limited' else None})\n"
        "(h.root / 'new.txt').write_text('from the dead run\\n')\n"
        "os._exit(9)\n"
    )
    assert child.returncode == 9
    store = WorkspaceStore(state)
    assert store.info(RUN).state == "live"
    [line] = store.recover()
    assert "its daemon ended during the run; kept until" in line
    info = store.info(RUN)
    assert info.state == "kept" and info.counts["added"] == 1
    assert info.note == "its daemon ended during the run"
    assert _mounts_under(info.base) == []
    assert [p.name for p in _mounts_under(state)] == (
        ["delta"] if kind == "overlay-limited" else []
    )
    assert store.recover() == [], "nothing left to do"
    assert store.diff(RUN).added == ["new.txt"]
    store.discard(RUN)
    assert tree(base) == before


def test_a_dead_run_is_recovered_by_the_next_command_too(where: Path) -> None:
    base = make_base(where)
    state = where / "state"
    child = run_child(
        f"h = WorkspaceStore(Path({str(state)!r})).open_session({RUN!r}, "
        f"Path({str(base)!r}), 'overlay', on_end='keep', keep_for_s=3600, "
        "max_delta_bytes=None)\n"
        "(h.root / 'new.txt').write_text('n\\n')\n"
        "os._exit(9)\n"
    )
    assert child.returncode == 9
    assert WorkspaceStore(state).commit(RUN).added == ["new.txt"]
    assert (base / "new.txt").read_text() == "n\n"


def test_a_crash_in_commit_is_finished_by_recover(where: Path) -> None:
    base = make_base(where)
    for n in range(20):
        (base / "src" / f"f{n:02}.py").write_text("old\n")
    state = where / "state"
    store = WorkspaceStore(state)
    handle = open_run(store, base, "overlay")
    for n in range(20):
        (handle.root / "src" / f"f{n:02}.py").write_text("new\n")
    store.end_of_run(RUN)
    # A command commits and is killed after applying five of the journal's operations.
    child = commit_in_child(
        state,
        RUN,
        "real = overlay.apply_operation\n"
        "count = 0\n"
        "def dying(*args):\n"
        "    global count\n"
        "    count += 1\n"
        "    if count > 5:\n"
        "        os._exit(9)\n"
        "    real(*args)\n"
        "overlay.apply_operation = dying\n",
    )
    assert child.returncode == 9
    contents = {(base / "src" / f"f{n:02}.py").read_text() for n in range(20)}
    assert contents == {"old\n", "new\n"}, "the commit was interrupted part-way"
    assert store.info(RUN).state == "committing"
    [line] = WorkspaceStore(state).recover()
    assert "finished the interrupted commit" in line
    assert {(base / "src" / f"f{n:02}.py").read_text() for n in range(20)} == {"new\n"}
    assert not handle.directory.exists()


def test_a_crash_in_commit_is_finished_by_the_next_commit(where: Path) -> None:
    base = make_base(where)
    state = where / "state"
    store = WorkspaceStore(state)
    handle = open_run(store, base, "overlay")
    run_writes(handle)
    store.end_of_run(RUN)
    child = commit_in_child(
        state,
        RUN,
        "def dying(*args):\n    os._exit(9)\noverlay.apply_operation = dying\n",
    )
    assert child.returncode == 9
    with pytest.raises(WorkspaceNotFound, match="finished the interrupted commit"):
        store.commit(RUN)
    assert (base / "new.txt").exists() and not (base / "README").exists()
    assert store.list() == []


def test_a_delta_tmpfs_lost_in_a_reboot_is_discarded_by_recover(where: Path) -> None:
    base = make_base(where)
    before = tree(base)
    state = where / "state"
    store = WorkspaceStore(state)
    handle = open_run(store, base, "overlay-limited")
    run_writes(handle)
    store.end_of_run(RUN)
    # A reboot: the tmpfs (and with it the upper directory) is gone.
    subprocess.run(["umount", str(handle.directory / "session" / "delta")], check=True)
    after_boot = WorkspaceStore(state)
    with pytest.raises(WorkspaceError, match="does not survive a reboot"):
        after_boot.commit(RUN)
    [line] = after_boot.recover()
    assert "discarded" in line and "does not survive a reboot" in line
    assert after_boot.list() == []
    assert tree(base) == before


def test_recover_leaves_a_session_another_process_holds(where: Path) -> None:
    base = make_base(where)
    store = WorkspaceStore(where / "state")
    open_run(store, base, "overlay")
    assert WorkspaceStore(where / "state").recover() == []
    assert store.info(RUN).state == "live"
    store.end_of_run(RUN)
    store.discard(RUN)


def test_recover_removes_a_session_that_never_opened(where: Path) -> None:
    (where / "state" / "workspaces" / RUN).mkdir(parents=True)
    (where / "state" / "workspaces" / "not-a-run").mkdir()
    lines = WorkspaceStore(where / "state").recover()
    assert lines == [f"run {RUN}: removed a session that never opened"]
    assert (where / "state" / "workspaces" / "not-a-run").is_dir()


def test_a_symlinked_base_entry_is_signed_as_the_link(where: Path) -> None:
    base = make_base(where)
    store = WorkspaceStore(where / "state")
    handle = open_run(store, base, "overlay")
    (handle.root / "link").unlink()
    (handle.root / "link").write_text("now a file\n")
    store.end_of_run(RUN)
    # The link's target changes; the link does not: no conflict.
    (base / "src" / "main.py").write_text("target edited\n")
    store.commit(RUN)
    assert (base / "link").read_text() == "now a file\n"
    assert not (base / "link").is_symlink()


def test_the_cli_checks_run_ids_as_the_store_does() -> None:
    from gatewayd.cli import run
    from gatewayd.cli import workspace as cli
    from gatewayd.workspace import store

    assert cli.RUN_ID_PATTERN.pattern == store.RUN_ID_PATTERN.pattern
    assert run._RUN_ID.pattern == store.RUN_ID_PATTERN.pattern


def test_what_the_store_does_is_recorded_before_it_is_done(where: Path) -> None:
    base = make_base(where)
    seen: list[tuple[str, str, dict[str, object], bool]] = []

    def record(event: object, run_id: str, detail: Mapping[str, object]) -> None:
        # Whether the base held the session's change when the entry was written.
        seen.append((str(event), run_id, dict(detail), (base / "new.txt").exists()))

    store = WorkspaceStore(where / "state", record=record)
    for run_id in (RUN, OTHER_RUN):
        handle = open_run(store, base, "overlay", run_id=run_id, keep_for_s=60)
        (handle.root / "new.txt").write_text(f"{run_id}\n")
        store.end_of_run(run_id)
    assert seen == [], "a run's own end is its caller's to audit"
    store.commit(RUN, by="ops")
    [(event, run_id, detail, written)] = seen
    assert (event, run_id, written) == ("workspace_committed", RUN, False)
    assert detail == {
        "mode": "overlay",
        "base": str(base),
        "by": "ops",
        "added": 1,
        "removed": 0,
        "modified": 0,
        "renamed": 0,
        "binary": 0,
    }
    # OTHER_RUN conflicts now (new.txt appeared); it expires instead.
    keep_until = store.info(OTHER_RUN).keep_until
    assert keep_until is not None
    assert store.expire(now=keep_until + 1) == [OTHER_RUN]
    event, run_id, detail, _ = seen[-1]
    assert (event, run_id, detail["by"]) == ("workspace_expired", OTHER_RUN, "expiry")
    assert str(detail["keptUntil"]).endswith("Z")
    handle = open_run(store, base, "overlay", run_id="c" * 32)
    store.end_of_run("c" * 32)
    store.discard("c" * 32, by="bob")
    assert seen[-1][:2] == ("workspace_discarded", "c" * 32) and seen[-1][2]["by"] == "bob"


def test_a_commit_that_fails_is_recorded_again_with_its_error(
    where: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from gatewayd.workspace import overlay

    base = make_base(where)
    seen: list[tuple[str, dict[str, object]]] = []
    store = WorkspaceStore(
        where / "state", record=lambda event, run_id, detail: seen.append((event, dict(detail)))
    )
    handle = open_run(store, base, "overlay")
    (handle.root / "new.txt").write_text("n\n")
    store.end_of_run(RUN)

    def failing(*args: object) -> None:
        raise OSError(5, "Input/output error")

    monkeypatch.setattr(overlay, "apply_operation", failing)
    with pytest.raises(OSError, match="Input/output error"):
        store.commit(RUN)
    assert [event for event, _ in seen] == ["workspace_committed", "workspace_committed"]
    assert "Input/output error" in str(seen[1][1]["error"])
    monkeypatch.undo()
    # The journal is left: recovery finishes the commit, and says so in the audit.
    [line] = store.recover()
    assert "finished the interrupted commit" in line
    assert seen[-1][0] == "workspace_recovered" and seen[-1][1]["what"] == line
    assert (base / "new.txt").read_text() == "n\n"


def test_damaged_records_are_refused_with_what_to_do(where: Path) -> None:
    base, store, handle = kept_new_file(where, "overlay")
    meta = handle.directory / "meta.json"
    good = meta.read_bytes()
    for damage in (b"{not json", b"[]", json.dumps({"run_id": RUN}).encode(), b" " * (2 << 20)):
        meta.write_bytes(damage)
        with pytest.raises(WorkspaceError) as caught:
            store.commit(RUN)
        assert "meta.json" in str(caught.value)
        assert "is malformed" in str(caught.value) or "cannot be read" in str(caught.value)
        assert store.list() == [], "an unreadable record is left out of the list"
    # A record naming another run than its directory.
    meta.write_bytes(good.replace(RUN.encode(), OTHER_RUN.encode()))
    with pytest.raises(WorkspaceError, match=f"it names run {OTHER_RUN}"):
        store.info(RUN)
    assert store.recover() == [f"run {RUN}: left alone: {store_error(store)}"]
    meta.write_bytes(good)
    seal = handle.directory / "seal.json"
    seal.write_text('{"signatures": {"new.txt": "no"}}')
    with pytest.raises(WorkspaceError, match="discard the session"):
        store.commit(RUN)
    assert not (base / "new.txt").exists()
    store.discard(RUN)


def store_error(store: WorkspaceStore) -> str:
    try:
        store.info(RUN)
    except WorkspaceError as exc:
        return str(exc)
    raise AssertionError("the record was readable")


def test_a_base_replaced_by_a_symlink_after_the_run_is_a_conflict(where: Path) -> None:
    base = make_base(where)
    store = WorkspaceStore(where / "state")
    handle = open_run(store, base, "overlay")
    (handle.root / "src" / "main.py").write_text("run\n")
    store.end_of_run(RUN)
    elsewhere = where / "elsewhere"
    (elsewhere / "src").mkdir(parents=True)
    (elsewhere / "src" / "main.py").write_text("not the base\n")
    os.rename(base / "src", where / "src.moved")
    os.symlink(elsewhere / "src", base / "src")
    with pytest.raises(WorkspaceConflict) as caught:
        store.commit(RUN)
    assert caught.value.paths == ["src", "src/main.py"]
    assert (elsewhere / "src" / "main.py").read_text() == "not the base\n"
    store.discard(RUN)


def test_a_host_session_whose_snapshot_is_gone_is_not_discarded_blindly(where: Path) -> None:
    base, store, handle = kept_new_file(where, "host")
    subprocess.run(["rm", "-rf", str(handle.directory / "session" / "snapshot")], check=True)
    with pytest.raises(WorkspaceError, match="has no snapshot"):
        store.discard(RUN)
    assert store.info(RUN).state == "kept", "the record is as it was"
    assert (base / "new.txt").exists()


def lending_child(borrower: int, base: Path) -> str:
    """The start of a child's script that lends ``base`` to uid ``borrower`` (``lend_base``)."""
    return (
        "from gatewayd.sandbox.lease import lend\n"
        "from gatewayd.sandbox.lendable import LendableRoots\n"
        "from gatewayd.sandbox.limits import HostUser\n"
        f"user = HostUser(uid={borrower}, gid={borrower})\n"
        f"base = Path({str(base)!r})\n"
        "def lend_base(directory):\n"
        "    lend([base], user, directory, roots=LendableRoots())\n"
    )


def test_recover_gives_back_the_base_a_dead_run_borrowed(where: Path) -> None:
    base = make_base(where)
    state = where / "state"
    borrower = 4_000_011
    child = run_child(
        lending_child(borrower, base)
        + f"h = WorkspaceStore(Path({str(state)!r})).open_session({RUN!r}, base, "
        "'overlay', on_end='keep', keep_for_s=3600, max_delta_bytes=None, "
        "before_mount=lend_base)\n"
        "(h.root / 'new.txt').write_text('n\\n')\n"
        "os._exit(9)\n"
    )
    assert child.returncode == 9
    assert os.stat(base / "src" / "main.py").st_uid == borrower
    store = WorkspaceStore(state)
    [line] = store.recover()
    assert "kept until" in line
    for path in (base, base / "src", base / "src" / "main.py", base / "README"):
        assert os.lstat(path).st_uid == 0, path
    assert not (store.root / RUN / "lease.json").exists()
    # The base's owner changing back is no conflict.
    assert store.commit(RUN).added == ["new.txt"]


@pytest.mark.parametrize("lent", ["the base", "nothing"])
def test_an_overlay_open_makes_its_record_and_the_lease_durable_in_one_fsync_before_lending(
    where: Path, monkeypatch: pytest.MonkeyPatch, lent: str
) -> None:
    # meta.json and the base's lease lie in one directory: one fsync of it, after both
    # are renamed into place and before the first chown, makes both names durable.
    from gatewayd.runs.workspaces import BaseLender, BaseLoan, give_back_base
    from gatewayd.sandbox.lendable import LendableRoots
    from gatewayd.sandbox.limits import HostUser
    from gatewayd.sandbox.uids import UidRange

    base = make_base(where)
    trees = (base,) if lent == "the base" else ()
    lender = BaseLender(
        BaseLoan(trees=trees, keep=frozenset(), whole=bool(trees)),
        HostUser(uid=4_000_013, gid=4_000_013),
        roots=LendableRoots(),
        pool_range=UidRange(4_100_000, 1),
    )
    events: list[tuple[str, str]] = []
    real_fsync, real_replace, real_chown = os.fsync, os.replace, os.chown

    def fsync(fd: int) -> None:
        events.append(("fsync", os.readlink(f"/proc/self/fd/{fd}")))
        real_fsync(fd)

    def replace(src: str | Path, dst: str | Path, **kwargs: object) -> None:
        events.append(("replace", Path(dst).name))
        real_replace(src, dst, **kwargs)  # type: ignore[arg-type]

    def chown(path: str | Path, uid: int, gid: int, **kwargs: object) -> None:
        events.append(("chown", str(path)))
        real_chown(path, uid, gid, **kwargs)  # type: ignore[arg-type]

    for name, fake in (("fsync", fsync), ("replace", replace), ("chown", chown)):
        monkeypatch.setattr(os, name, fake)
    store = WorkspaceStore(where / "state")
    handle = store.open_session(
        RUN,
        base,
        "overlay",
        on_end="keep",
        keep_for_s=KEEP_S,
        max_delta_bytes=None,
        before_mount=lender,
    )
    monkeypatch.undo()
    directory = os.path.realpath(handle.directory)
    lending = next((i for i, (kind, _) in enumerate(events) if kind == "chown"), len(events))
    synced = [i for i, event in enumerate(events[:lending]) if event == ("fsync", directory)]
    assert len(synced) == 1, events
    renamed = [name for kind, name in events[: synced[0]] if kind == "replace"]
    assert renamed == ["meta.json", "lease.json"], events
    assert (lending < len(events)) is bool(trees)
    handle.seal()
    give_back_base(handle.directory)
    store.end_of_run(RUN)
    assert os.lstat(base / "README").st_uid == 0


def test_recover_gives_back_a_lease_recorded_without_the_sessions_record(where: Path) -> None:
    # One fsync makes meta.json and the lease durable (above): a power cut before it
    # can leave the lease alone. Nothing is lent then; lent here, to see it given back.
    from gatewayd.sandbox.lease import lend
    from gatewayd.sandbox.lendable import LendableRoots
    from gatewayd.sandbox.limits import HostUser

    base = make_base(where)
    directory = where / "state" / "workspaces" / RUN
    directory.mkdir(parents=True)
    lend([base], HostUser(uid=4_000_014, gid=4_000_014), directory, roots=LendableRoots())
    assert os.lstat(base / "src" / "main.py").st_uid == 4_000_014
    lines = WorkspaceStore(where / "state").recover()
    assert lines == [f"run {RUN}: removed a session that never opened"]
    assert not directory.exists()
    for path in (base, base / "src", base / "src" / "main.py", base / "README", base / "link"):
        assert os.lstat(path).st_uid == 0, path


# --- a run's end writes its record once ---------------------------------------------


def _count_writes(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The names of the records the store writes from now on (each one a durable write:
    two fsyncs)."""
    from gatewayd.workspace import store as store_module

    written: list[str] = []
    real = store_module.write_atomically

    def counting(path: Path, data: bytes, mode: int = 0o600, *, sync_dir: bool = True) -> None:
        written.append(path.name)
        real(path, data, mode, sync_dir=sync_dir)

    monkeypatch.setattr(store_module, "write_atomically", counting)
    return written


@pytest.mark.parametrize(
    ("on_end", "records"),
    [
        ("keep", ["seal.json", "meta.json"]),  # kept, with its counts and keep time
        ("commit", ["seal.json", "meta.json", "meta.json"]),  # committing, committed
        ("discard", ["seal.json", "meta.json", "meta.json"]),  # discarding, discarded
    ],
)
def test_a_runs_end_records_the_seal_and_the_on_end_in_one_write(
    where: Path, monkeypatch: pytest.MonkeyPatch, on_end: str, records: list[str]
) -> None:
    base = make_base(where)
    store = WorkspaceStore(where / "state")
    handle = open_run(store, base, "overlay", on_end=on_end)
    (handle.root / "new.txt").write_text("n\n")
    written = _count_writes(monkeypatch)
    # As a run's end does: sealed, its record left for the on-end; the base given back
    # in between (none lent here).
    handle.seal(record_state=False)
    assert WorkspaceStore(where / "state").info(RUN).state == "live"
    outcome = store.end_of_run(RUN)
    assert written == records
    if on_end == "keep":
        info = WorkspaceStore(where / "state").info(RUN)
        assert outcome.startswith("kept until ") and info.state == "kept"
        assert info.counts["added"] == 1 and info.keep_until is not None
    else:
        assert outcome.startswith("committed" if on_end == "commit" else "discarded")
        assert (base / "new.txt").exists() is (on_end == "commit")


def test_a_failed_step_after_the_seal_leaves_the_session_recorded_sealed(
    where: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    base = make_base(where)
    state = where / "state"
    store = WorkspaceStore(state)
    handle = open_run(store, base, "overlay", on_end="commit")
    (handle.root / "new.txt").write_text("n\n")
    handle.seal(record_state=False)
    # A give-back that fails (the caller's step between the seal and the on-end).
    handle.keep_sealed_record()
    # As a seal records it: kept, with its counts, never committed.
    info = WorkspaceStore(state).info(RUN)
    assert info.state == "kept" and info.counts["added"] == 1 and info.keep_until is None
    assert not (base / "new.txt").exists()
    assert (handle.directory / "seal.json").is_file()
    # An on-end that fails before it writes a state records the seal the same way.
    from gatewayd.workspace import store as store_module

    def failing(*args: object, **kwargs: object) -> None:
        raise OSError(5, "the on-end failed")

    other = open_run(store, make_base(where / "other"), "overlay", run_id=OTHER_RUN)
    monkeypatch.setattr(store_module.WorkspaceStore, "_apply_on_end", failing)
    with pytest.raises(OSError, match="the on-end failed"):
        store.end_of_run(OTHER_RUN)
    monkeypatch.undo()
    assert WorkspaceStore(state).info(OTHER_RUN).state == "kept"
    assert other.info.state == "kept"
    # The failed end released its lock (the first session's, never ended here, is let
    # go as its daemon's death would): another process finds both kept, gives each its
    # keep time, and can discard them.
    handle._release()
    lines = WorkspaceStore(state).recover()
    assert len(lines) == 2 and all(": kept until " in line for line in lines), lines
    for run_id in (RUN, OTHER_RUN):
        WorkspaceStore(state).discard(run_id)


@pytest.mark.parametrize("dies", ["before the give-back", "after the give-back"])
def test_a_daemon_killed_between_the_seal_and_the_on_end_is_recovered(
    where: Path, dies: str
) -> None:
    """The seal's record (seal.json) is durable, meta.json still says live (the on-end
    writes it once): recovery keeps the session, never commits it, and gives the base
    back, as it kept a session recorded sealed before; the signatures the run's seal
    took stay, so the operator's edit after the crash is a conflict as it was."""
    base = make_base(where)
    before = tree(base)
    state = where / "state"
    borrower = 4_000_013
    give_back = (
        "from gatewayd.runs.workspaces import give_back_base\ngive_back_base(h.directory)\n"
        if dies == "after the give-back"
        else ""
    )
    child = run_child(
        lending_child(borrower, base) + f"store = WorkspaceStore(Path({str(state)!r}))\n"
        f"h = store.open_session({RUN!r}, base, 'overlay', on_end='commit', "
        "keep_for_s=3600, max_delta_bytes=None, before_mount=lend_base)\n"
        "(h.root / 'new.txt').write_text('n\\n')\n"
        # As a run's end does: sealed, its record left for the on-end's one write.
        "h.seal(record_state=False)\n"
        f"{give_back}"
        "os._exit(9)\n"
    )
    assert child.returncode == 9
    store = WorkspaceStore(state)
    assert store.info(RUN).state == "live"
    assert (store.root / RUN / "seal.json").is_file()
    lent = os.stat(base / "src" / "main.py").st_uid
    assert lent == (borrower if dies == "before the give-back" else 0)
    sealed = (store.root / RUN / "seal.json").read_bytes()
    # The operator makes the file the run added, before the next start recovers it.
    (base / "new.txt").write_text("the operator's\n")
    [line] = store.recover()
    assert "its daemon ended during the run; kept until" in line
    info = store.info(RUN)
    # Counted against the base as recovery finds it (the operator's file: modified).
    assert info.state == "kept" and info.counts["modified"] == 1
    assert (store.root / RUN / "seal.json").read_bytes() == sealed, "the run's own seal"
    (base / "new.txt").unlink()
    assert tree(base) == before, "given back, nothing committed"
    assert not (store.root / RUN / "lease.json").exists()
    assert _mounts_under(state) == []
    (base / "new.txt").write_text("the operator's\n")
    with pytest.raises(WorkspaceConflict, match=r"new\.txt"):
        store.commit(RUN)
    (base / "new.txt").unlink()
    assert store.commit(RUN).added == ["new.txt"]


@pytest.mark.parametrize(
    ("dies_in", "outcome"),
    [
        # Before the journal is written: nothing was applied; kept.
        ("write_atomically", "the commit never began; kept until"),
        # After the journal is removed, before the delta: all was applied; committed.
        ("_remove_delta", "the interrupted commit had finished"),
    ],
)
def test_a_commit_killed_with_no_journal_is_told_apart(
    where: Path, dies_in: str, outcome: str
) -> None:
    base = make_base(where)
    state = where / "state"
    store = WorkspaceStore(state)
    handle = open_run(store, base, "overlay")
    run_writes(handle)
    store.end_of_run(RUN)
    child = commit_in_child(state, RUN, f"overlay.{dies_in} = lambda *args: os._exit(9)\n")
    assert child.returncode == 9
    assert store.info(RUN).state == "committing"
    [line] = store.recover()
    assert outcome in line
    if dies_in == "write_atomically":
        assert (base / "README").exists() and store.info(RUN).state == "kept"
        store.commit(RUN)
    else:
        assert store.list() == []
        assert not (handle.directory).exists()
    assert (base / "new.txt").read_text() == "new\n" and not (base / "README").exists()


def test_a_base_replaced_after_the_run_is_never_written(where: Path, kind: str) -> None:
    base, store, _handle = kept_new_file(where, kind)
    # Someone moves the directory away and puts another one, alike, at its path.
    os.rename(base, where / "moved")
    subprocess.run(["cp", "-a", str(where / "moved"), str(base)], check=True)
    (base / "new.txt").unlink(missing_ok=True)
    before = tree(base)
    with pytest.raises(WorkspaceConflict) as caught:
        store.commit(RUN)
    assert "is no longer the directory run" in str(caught.value)
    assert "Discard the session, or put the directory back" in str(caught.value)
    if kind == "host":
        with pytest.raises(WorkspaceConflict, match="the discard would write into another"):
            store.discard(RUN)
        assert tree(base) == before
        assert store.info(RUN).state == "kept"
        os.rename(base, where / "other")
        os.rename(where / "moved", base)
    store.discard(RUN)
    assert store.list() == []
    assert not (base / "new.txt").exists()


def test_a_sessions_record_holds_every_field_as_asdict_would() -> None:
    # meta.json is read back by other processes and by the next daemon: the record made
    # field by field is the one dataclasses.asdict made, and reads back equal.
    import dataclasses

    from gatewayd.workspace.store import SessionInfo

    info = SessionInfo(
        run_id=RUN,
        mode="overlay",
        base=Path("/tmp/ws"),
        state="kept",
        on_end="keep",
        keep_for_s=KEEP_S,
        keep_until=1.5,
        max_delta_bytes=DELTA_LIMIT,
        created=1.25,
        base_id=(8, 12),
        counts={"added": 1, "removed": 0},
        delta_bytes=3,
        note="a note",
        commit_git_metadata=True,
    )
    expected = dataclasses.asdict(info)
    expected["base"] = "/tmp/ws"
    assert json.loads(info.to_record()) == json.loads(json.dumps(expected))
    assert SessionInfo.from_record(info.to_record()) == info
