"""What a run's sandbox awaits after each command (``gatewayd/runs/lifecycle.py``
``_syncer``): the workspace session's sync, in a worker thread when the backend has a
sync of its own, in the trio thread when it keeps the base class's (a check that the
session is open, no I/O), which then costs the command's answer no thread hand-off."""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any, ClassVar

import pytest
import trio

from gatewayd.runs.lifecycle import _syncer
from gatewayd.workspace import WorkspaceError
from gatewayd.workspace.host import HostWorkspace


def session(tmp_path: Path, kind: type[HostWorkspace] = HostWorkspace) -> HostWorkspace:
    base = tmp_path / "ws"
    base.mkdir()
    (base / "a.txt").write_text("a\n")
    return kind.create(base, tmp_path / "state")


async def test_a_session_whose_sync_only_checks_is_synced_in_the_trio_thread(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    opened = session(tmp_path)

    async def no_thread(*args: Any, **kwargs: Any) -> None:
        raise AssertionError("the check was handed to a worker thread")

    monkeypatch.setattr(trio.to_thread, "run_sync", no_thread)
    sync = _syncer(opened)
    await sync()
    opened.close()
    # The check itself stands: a session no longer open fails the command's end.
    with pytest.raises(WorkspaceError, match="already"):
        await sync()


class Recording(HostWorkspace):
    """A backend with a sync of its own (as agentfs has): where each one ran."""

    threads: ClassVar[list[threading.Thread]] = []

    def sync(self) -> None:
        self.threads.append(threading.current_thread())


async def test_a_session_with_a_sync_of_its_own_is_synced_in_a_worker_thread(
    tmp_path: Path,
) -> None:
    opened = session(tmp_path, Recording)
    try:
        await _syncer(opened)()
    finally:
        opened.close()
    assert len(Recording.threads) == 1
    assert Recording.threads[0] is not threading.current_thread()
