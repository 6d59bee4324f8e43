"""gatewayd's record of the workspaces that hold apps: written atomically and under a
lock, read strictly (a damaged or hostile record fails closed with a message naming the
file and the fix), and what counts as a workspace holding apps."""

from __future__ import annotations

import json
import os
import threading
from pathlib import Path

import pytest

from gatewayd.apps import workspaces as record
from gatewayd.apps.workspaces import (
    APPS_RECORD_FILE,
    MAX_RECORD_BYTES,
    AppsRecordError,
    holds_apps,
    record_workspace,
    recorded_workspaces,
)
from gatewayd.protocol import ErrorCode


@pytest.fixture
def state(tmp_path: Path) -> Path:
    path = tmp_path / "state"
    path.mkdir()
    return path


def workspace(tmp_path: Path, name: str) -> Path:
    path = tmp_path / name
    path.mkdir(parents=True, exist_ok=True)
    return path


def test_no_record_means_no_workspace_holds_apps(state: Path) -> None:
    assert recorded_workspaces(state) == ()


def test_a_workspace_is_recorded_once_in_order_and_durably(state: Path, tmp_path: Path) -> None:
    a, b = workspace(tmp_path, "a"), workspace(tmp_path, "b")
    assert record_workspace(state, a) is True
    assert record_workspace(state, b) is True
    assert record_workspace(state, a) is False  # already there: nothing written
    assert recorded_workspaces(state) == (a, b)
    written = json.loads((state / APPS_RECORD_FILE).read_text())
    assert written == {"version": 1, "workspaces": [str(a), str(b)]}
    assert oct((state / APPS_RECORD_FILE).stat().st_mode & 0o777) == oct(0o600)
    # No temporary file is left beside it.
    assert sorted(p.name for p in state.iterdir()) == [
        "apps-workspaces.json",
        "apps-workspaces.lock",
    ]


def test_a_removed_workspace_is_dropped_when_another_is_recorded(
    state: Path, tmp_path: Path
) -> None:
    gone, kept, new = (workspace(tmp_path, n) for n in ("gone", "kept", "new"))
    record_workspace(state, gone)
    record_workspace(state, kept)
    gone.rmdir()
    assert recorded_workspaces(state) == (gone, kept)  # reading drops nothing
    record_workspace(state, new)
    assert recorded_workspaces(state) == (kept, new)


@pytest.mark.parametrize(
    ("given", "problem"),
    [
        ("relative/ws", "is not an absolute path"),
        ("//double/slash", "is not an absolute path"),
        ("/a/../b", "is not a normalized path"),
        ("/", "is the root directory"),
        ("/a\0b", "holds a NUL byte"),
        ("/" + "x" * 5000, "is longer than a path may be"),
    ],
)
def test_only_a_real_absolute_path_is_recorded(state: Path, given: str, problem: str) -> None:
    with pytest.raises(AppsRecordError) as caught:
        record_workspace(state, Path(given))
    assert problem in str(caught.value)
    assert not (state / APPS_RECORD_FILE).exists()


def _refused(state: Path, content: bytes) -> str:
    (state / APPS_RECORD_FILE).write_bytes(content)
    with pytest.raises(AppsRecordError) as caught:
        recorded_workspaces(state)
    message = str(caught.value)
    assert message.startswith(f"the apps record {state / APPS_RECORD_FILE} cannot be used: ")
    assert "no run starts until it is mended" in message
    assert '{"version": 1, "workspaces": ["/path/to/workspace"]}' in message
    assert caught.value.code is ErrorCode.INTERNAL  # gatewayd's own state is at fault
    return message


@pytest.mark.parametrize(
    ("content", "why"),
    [
        (b"", "it is not JSON"),
        (b"{not json", "it is not JSON"),
        (b"\xff\xfe", "it is not JSON"),
        (b"[]", 'exactly "version" and "workspaces"'),
        (b'{"workspaces": []}', 'exactly "version" and "workspaces"'),
        (b'{"version": 1, "workspaces": [], "extra": 1}', 'exactly "version" and "workspaces"'),
        (b'{"version": 2, "workspaces": []}', "its version is 2, not 1"),
        (b'{"version": "1", "workspaces": []}', "its version is '1', not 1"),
        (b'{"version": 1, "workspaces": "/ws"}', '"workspaces" is not a list'),
        (b'{"version": 1, "workspaces": [7]}', "entry 0 is not a string"),
        (b'{"version": 1, "workspaces": ["/ok", "rel"]}', "entry 1 is not an absolute path"),
        (b'{"version": 1, "workspaces": ["/a/../etc"]}', "entry 0 is not a normalized path"),
        (b'{"version": 1, "workspaces": ["/a/./b"]}', "entry 0 is not a normalized path"),
        (b'{"version": 1, "workspaces": ["/a//b"]}', "entry 0 is not a normalized path"),
        (b'{"version": 1, "workspaces": ["/a/b/"]}', "entry 0 is not a normalized path"),
        (b'{"version": 1, "workspaces": ["/"]}', "entry 0 is the root directory"),
        (b'{"version": 1, "workspaces": ["/a\\u0000b"]}', "entry 0 holds a NUL byte"),
        (b'{"version": 1, "workspaces": ["/a\\ud800"]}', "entry 0 is not a valid file name"),
    ],
)
def test_a_damaged_or_hostile_record_fails_closed(state: Path, content: bytes, why: str) -> None:
    assert why in _refused(state, content)


def test_a_record_with_too_many_entries_or_bytes_fails_closed(state: Path) -> None:
    many = [f"/w/{i}" for i in range(record.MAX_RECORDED_WORKSPACES + 1)]
    assert "it lists more than 4096 workspaces" in _refused(
        state, json.dumps({"version": 1, "workspaces": many}).encode()
    )
    assert f"is larger than {MAX_RECORD_BYTES} bytes" in _refused(
        state, b" " * (MAX_RECORD_BYTES + 1)
    )


def test_a_record_that_is_no_regular_file_fails_closed_without_blocking(state: Path) -> None:
    os.mkfifo(state / APPS_RECORD_FILE)  # reading a FIFO would wait for a writer
    with pytest.raises(AppsRecordError, match="must be a regular file, not a FIFO"):
        recorded_workspaces(state)
    os.unlink(state / APPS_RECORD_FILE)
    (state / APPS_RECORD_FILE).mkdir()
    with pytest.raises(AppsRecordError, match="must be a regular file, not a directory"):
        recorded_workspaces(state)


def test_recording_into_a_damaged_record_fails_and_leaves_it_for_the_operator(
    state: Path, tmp_path: Path
) -> None:
    (state / APPS_RECORD_FILE).write_text("garbage")
    with pytest.raises(AppsRecordError, match="it is not JSON"):
        record_workspace(state, workspace(tmp_path, "a"))
    assert (state / APPS_RECORD_FILE).read_text() == "garbage"


def test_a_full_record_refuses_another_workspace_and_says_what_to_do(
    state: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(record, "MAX_RECORDED_WORKSPACES", 2)
    record_workspace(state, workspace(tmp_path, "a"))
    record_workspace(state, workspace(tmp_path, "b"))
    with pytest.raises(AppsRecordError) as caught:
        record_workspace(state, workspace(tmp_path, "c"))
    assert "already lists 2 workspaces" in str(caught.value)
    assert "remove entries of workspaces that no longer hold apps" in str(caught.value)


def test_a_missing_state_directory_is_named(tmp_path: Path) -> None:
    with pytest.raises(AppsRecordError, match=r"cannot open the apps record's lock .*missing"):
        record_workspace(tmp_path / "missing", workspace(tmp_path, "a"))


def test_concurrent_writers_lose_no_entry(state: Path, tmp_path: Path) -> None:
    spaces = [workspace(tmp_path, f"w{i}") for i in range(16)]
    errors: list[BaseException] = []

    def add(path: Path) -> None:
        try:
            record_workspace(state, path)
        except BaseException as exc:  # pragma: no cover - reported below
            errors.append(exc)

    threads = [threading.Thread(target=add, args=(path,)) for path in spaces]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert errors == []
    assert sorted(recorded_workspaces(state)) == sorted(spaces)


def test_a_writer_stuck_holding_the_lock_is_reported_not_waited_for_forever(
    state: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import fcntl

    monkeypatch.setattr(record, "RECORD_LOCK_WAIT_S", 0.1)
    fd = os.open(state / record.APPS_RECORD_LOCK, os.O_RDWR | os.O_CREAT, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        with pytest.raises(AppsRecordError, match=r"has held .* for more than 0.1 s"):
            record_workspace(state, workspace(tmp_path, "a"))
    finally:
        os.close(fd)


# --- what holds apps --------------------------------------------------------------------


def test_a_workspace_holds_apps_when_a_folder_in_apps_has_an_app_md(tmp_path: Path) -> None:
    ws = workspace(tmp_path, "ws")
    assert holds_apps(ws) is False  # no apps folder
    (ws / "apps").mkdir()
    assert holds_apps(ws) is False  # an empty one (a run's cover point)
    (ws / "apps" / "notes").mkdir()
    (ws / "apps" / "README.md").write_text("not an app\n")
    assert holds_apps(ws) is False  # a folder without a manifest
    (ws / "apps" / "notes" / "APP.md").write_text("broken, but an app's all the same\n")
    assert holds_apps(ws) is True


def test_an_apps_symlink_or_a_missing_workspace_holds_nothing(tmp_path: Path) -> None:
    elsewhere = workspace(tmp_path, "elsewhere")
    (elsewhere / "x").mkdir()
    (elsewhere / "x" / "APP.md").write_text("x\n")
    ws = workspace(tmp_path, "ws")
    (ws / "apps").symlink_to(elsewhere)  # a run refuses such a folder at its start
    assert holds_apps(ws) is False
    assert holds_apps(tmp_path / "nowhere") is False


def test_a_folder_of_very_many_names_counts_as_holding_apps(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(record, "MAX_APPS_LOOKED_AT", 3)
    ws = workspace(tmp_path, "ws")
    for i in range(5):
        (ws / "apps" / f"n{i}").mkdir(parents=True)
    assert holds_apps(ws) is True  # bounded work, and the safe answer


def test_a_failed_write_leaves_the_old_record_and_says_so(
    state: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    a = workspace(tmp_path, "a")
    record_workspace(state, a)

    def full(path: Path, data: bytes, mode: int = 0o600) -> None:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(record, "write_atomically", full)
    b = workspace(tmp_path, "b")
    with pytest.raises(AppsRecordError) as caught:
        record_workspace(state, b)
    assert str(caught.value) == (
        f"cannot write the apps record {state / APPS_RECORD_FILE}: No space left on device; "
        f"the workspace {b} is not recorded"
    )
    assert recorded_workspaces(state) == (a,)
