"""What a run's start and end do meanwhile, in a real daemon with the OS sandbox: the
flush of ``run_created`` runs while the run's tools are made and its socket is opened
(the start returns once it is durable), and that of ``run_ended`` while the run's
directory is deleted (each asked for when recorded, not when waited for); an overlay
run's uid is recorded in its directory while its session opens, a
record that cannot be written refuses the start at the lease's step and leaves nothing;
and the start's hand-offs to worker threads are the ones that wait for something.
"""

from __future__ import annotations

import errno
import json
import os
import re
import shutil
import tempfile
import threading
import time
from collections.abc import Awaitable, Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import trio

from gatewayd.audit import AuditWriteError
from gatewayd.daemon import Daemon, open_daemon
from gatewayd.error_codes import ErrorCode
from gatewayd.exitstatus import EXIT_FAILED
from gatewayd.policy.model import load_policy_text
from gatewayd.policy.workspace_section import WorkspaceModeName
from gatewayd.runs import Grant, Run, RunRequest
from gatewayd.runs.lifecycle import EndedWhileStarting
from gatewayd.runs.model import ChildKind, ChildSpec, MadeFor
from gatewayd.runs.oneshot import attached_run
from gatewayd.sandbox.lease import LEASE_FILE, read_lease
from gatewayd.sandbox.netns import NETNS_RUN_DIR
from gatewayd.sandbox.passthrough import Passthrough
from gatewayd.sandbox.session import RunSandbox, SandboxUnavailable, SandboxView
from gatewayd.sandbox.uids import pids_of_uid
from gatewayd.workspace import store as store_module
from tests.integration.test_run_sandbox import MARK, PY, _unavailable
from tests.integration.test_run_start import sandboxed_config, sandboxed_request, start

pytestmark = pytest.mark.skipif(_unavailable() is not None, reason=str(_unavailable()))

# No audit entry is ever due on its own in these tests: only a waiter, an ask
# (flush_soon) or the log's close makes the flusher write.
NEVER_DUE_S = 3600.0
# A bound on "soon" for what takes milliseconds: generous for a loaded CI box.
PATIENCE_S = 20.0


@pytest.fixture
def base() -> Iterator[Path]:
    path = Path(tempfile.mkdtemp(prefix="cg-rm-", dir="/tmp"))
    path.chmod(0o711)  # the sandbox's uid passes through to its workspace and socket
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


def _run_events(daemon: Daemon, run_id: str, event: str) -> list[dict[str, Any]]:
    """The audit log's ``event`` entries of ``run_id``, as written to disk so far."""
    return [
        entry
        for entry in map(json.loads, daemon.audit.path.read_text().splitlines())
        if entry.get("runId") == run_id and entry.get("event") == event
    ]


def _durable_event(daemon: Daemon, run_id: str, event: str) -> bool:
    """Is ``event`` of ``run_id`` on disk and durable?"""
    entries = _run_events(daemon, run_id, event)
    return bool(entries) and entries[0]["seq"] <= daemon.audit.durable_seq


def _hold_audit_flushes(
    daemon: Daemon, monkeypatch: pytest.MonkeyPatch, *, fail_from: int | None = None
) -> tuple[threading.Event, threading.Event]:
    """(held, release): the audit log's flushes wait in the flusher thread until
    released (``held`` set once one waits); from its ``fail_from``-th on (None: none),
    a flush's fdatasync then fails as a dying disk's does (EIO)."""
    held, release = threading.Event(), threading.Event()
    fdatasync = os.fdatasync
    count = 0

    def stub(fd: int) -> None:
        nonlocal count
        if fd != daemon.audit.fileno():
            fdatasync(fd)
            return
        count += 1
        if not release.is_set():
            held.set()
            release.wait(PATIENCE_S)
        if fail_from is not None and count >= fail_from:
            raise OSError(errno.EIO, os.strerror(errno.EIO))
        fdatasync(fd)

    monkeypatch.setattr(os, "fdatasync", stub)
    return held, release


async def test_run_created_is_flushed_while_the_runs_tools_are_made(base: Path) -> None:
    async with open_daemon(sandboxed_config(base, "overlay"), preload=True) as daemon:
        daemon.audit._sync_delay_s = NEVER_DUE_S  # only waiters and asks flush
        make_tools = daemon.runs.run_tools
        assert make_tools is not None
        flushed_first: list[bool] = []

        async def run_tools(run: Run) -> None:
            # Recorded, and not waited for yet (the start waits after this hook): only
            # an ask made when they were recorded writes them meanwhile.
            recorded = daemon.audit.last_seq
            with trio.move_on_after(PATIENCE_S):
                while daemon.audit.durable_seq < recorded:
                    await trio.sleep(0.001)
            flushed_first.append(daemon.audit.durable_seq >= recorded)
            await make_tools(run)

        daemon.runs.run_tools = run_tools
        run = await start(daemon, base, "ws")
        assert flushed_first == [True]
        assert _durable_event(daemon, run.run_id, "run_created")
        assert _durable_event(daemon, run.run_id, "workspace_opened")
        await daemon.runs.end(run.run_id)


async def test_the_runs_socket_is_opened_while_its_creation_is_flushed_and_the_start_waits(
    base: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    async with open_daemon(sandboxed_config(base, "overlay"), preload=True) as daemon:
        runs_dir = daemon.config.state_dir / "runs"
        # The audit log's next flush (run_created's) waits until released.
        held, release = _hold_audit_flushes(daemon, monkeypatch)
        started: list[Run] = []
        listening: list[bool] = []

        async def start_run() -> None:
            started.append(await start(daemon, base, "ws"))

        try:
            async with trio.open_nursery() as nursery:
                nursery.start_soon(start_run)
                with trio.move_on_after(PATIENCE_S):
                    while not (held.is_set() and list(runs_dir.glob("*/gateway.sock"))):
                        await trio.sleep(0.001)
                listening.append(bool(list(runs_dir.glob("*/gateway.sock"))))
                assert started == [], "the start returned before its entries were durable"
                release.set()
        finally:
            release.set()
        assert listening == [True]
        [run] = started
        assert _durable_event(daemon, run.run_id, "workspace_opened")
        await daemon.runs.end(run.run_id)


async def _end_while_its_creation_is_flushed(
    daemon: Daemon, monkeypatch: pytest.MonkeyPatch, starting: Callable[[], Awaitable[Run]]
) -> tuple[Run, RunSandbox, EndedWhileStarting]:
    """Start a run with ``starting`` while the audit's flushes are held; once it is made
    (its sandbox and namespace too), end it as the daemon stopping does, then let the
    flushes go. Returns the run, its sandbox and the error its start raised, checked to
    say so."""
    held, release = _hold_audit_flushes(daemon, monkeypatch)
    before = set(daemon.registry.all())
    outcome: list[BaseException | Run] = []

    async def start_it() -> None:
        try:
            outcome.append(await starting())
        except Exception as exc:
            outcome.append(exc)

    try:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(start_it)
            with trio.fail_after(PATIENCE_S):
                while not (held.is_set() and len(daemon.registry.all()) > len(before)):
                    await trio.sleep(0.001)
            [run] = [made for made in daemon.registry.all() if made not in before]
            sandbox = run.sandbox
            assert sandbox is not None  # made before its creation is recorded
            assert sandbox.netns.path.exists()
            nursery.start_soon(daemon.runs.end, run.run_id, "daemon_stopping")
            await trio.sleep(0.2)  # the end is under way, the flush still held
            release.set()
    finally:
        release.set()
    monkeypatch.undo()
    [error] = outcome
    assert isinstance(error, EndedWhileStarting), error
    assert str(error) == (
        f"run {run.run_id} was ended (daemon_stopping) before its start finished, "
        "so no command of it ran; start it again"
    )
    return run, sandbox, error


@pytest.mark.parametrize("mode", ["host", "overlay"])
async def test_a_start_ended_while_its_creation_is_flushed_says_so_and_leaves_nothing(
    base: Path, monkeypatch: pytest.MonkeyPatch, mode: WorkspaceModeName
) -> None:
    # The start waits for its creation's flush (its caller holds no run yet); an end
    # meanwhile (the daemon stopping, an operator's DELETE of the listed run) ends it.
    async with open_daemon(sandboxed_config(base, mode), preload=True) as daemon:
        run, sandbox, error = await _end_while_its_creation_is_flushed(
            daemon, monkeypatch, lambda: start(daemon, base, "ws")
        )
        uid, netns = sandbox.user.uid, sandbox.netns.path
        assert error.code is ErrorCode.INTERNAL
        assert run.end_reason == "daemon_stopping"
        ended = _run_events(daemon, run.run_id, "run_ended")
        assert [entry["detail"]["reason"] for entry in ended] == ["daemon_stopping"]
        assert _durable_event(daemon, run.run_id, "run_ended")
        assert daemon.registry.all() == []
        assert not run.socket_path.exists()
        assert not run.directory.exists()
        assert pids_of_uid(uid) == []
        assert not netns.exists()
        # The daemon goes on: the next start is served.
        again = await start(daemon, base, "ws")
        await daemon.runs.end(again.run_id)


CHILD_POLICY = """
version: 1
name: child-probe
tools: {allow: [time.now]}
"""


async def test_a_child_run_ended_while_its_creation_is_flushed_is_not_handed_over(
    base: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A child run (an app's invocation, an MCP server's instance) with no services:
    # ended while its start waits for its creation's flush, its maker is told so, as a
    # run's caller is, instead of getting a run already ending.
    async with open_daemon(sandboxed_config(base, "overlay"), preload=True) as daemon:
        parent = await start(daemon, base, "ws")
        spec = ChildSpec(
            parent_run_id=parent.run_id,
            made_for=MadeFor(kind=ChildKind.APP, name="probe"),
            request=RunRequest(
                workspacePath=str(parent.spec.workspace),
                policy="child-probe",
                actorId="tester",
                tenantId="t1",
                grant=Grant(allowSandbox=True),
            ),
            workspace=parent.spec.workspace,
            policy=load_policy_text(CHILD_POLICY, "a test"),
            source="a test",
            grants=(),
        )
        view = SandboxView(workspace_read_only=True, gateway_socket=False)
        child, sandbox, _ = await _end_while_its_creation_is_flushed(
            daemon, monkeypatch, lambda: daemon.runs.start_child(spec, view=view)
        )
        uid = sandbox.user.uid
        ended = _run_events(daemon, child.run_id, "run_ended")
        assert [entry["detail"]["reason"] for entry in ended] == ["daemon_stopping"]
        assert daemon.registry.all() == [parent]
        assert not child.directory.exists()
        assert pids_of_uid(uid) == []
        await daemon.runs.end(parent.run_id)


async def test_run_ended_is_flushed_while_the_runs_directory_is_deleted(
    base: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    async with open_daemon(sandboxed_config(base, "overlay"), preload=True) as daemon:
        daemon.audit._sync_delay_s = NEVER_DUE_S  # only waiters and asks flush
        run = await start(daemon, base, "ws")
        delete = daemon.registry.delete_directory
        flushed_first: list[bool] = []

        async def delete_directory(deleted: Run) -> None:
            # The end records run_ended and waits for this deletion before its own wait
            # for the entry: its flush is written meanwhile only if it was asked for.
            with trio.move_on_after(PATIENCE_S):
                while not _durable_event(daemon, deleted.run_id, "run_ended"):
                    await trio.sleep(0.001)
            flushed_first.append(_durable_event(daemon, deleted.run_id, "run_ended"))
            await delete(deleted)

        monkeypatch.setattr(daemon.registry, "delete_directory", delete_directory)
        await daemon.runs.end(run.run_id)
        assert flushed_first == [True]


async def test_an_overlay_runs_uid_is_recorded_in_its_directory_while_its_session_opens(
    base: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    config = sandboxed_config(base, "overlay")
    open_session = store_module.WorkspaceStore.open_session
    recorded_meanwhile: list[bool] = []

    def open_then_look(self: Any, run_id: str, *args: Any, **kwargs: Any) -> Any:
        handle = open_session(self, run_id, *args, **kwargs)
        # In this worker thread, before the start goes on: the record comes from another.
        record = config.state_dir.resolve() / "runs" / run_id / LEASE_FILE
        deadline = time.monotonic() + PATIENCE_S
        while not record.exists() and time.monotonic() < deadline:
            time.sleep(0.001)
        recorded_meanwhile.append(record.exists())
        return handle

    monkeypatch.setattr(store_module.WorkspaceStore, "open_session", open_then_look)
    async with open_daemon(config, preload=True) as daemon:
        run = await start(daemon, base, "ws")
        assert recorded_meanwhile == [True]
        assert run.sandbox is not None
        lease = read_lease(run.directory)
        # The record names the run's uid, and lends nothing: the base was lent for the
        # session, before its mount (the session's own record).
        assert lease is not None and lease.trees == ()
        assert (lease.uid, lease.gid) == (run.sandbox.user.uid, run.sandbox.user.gid)
        assert lease == run.sandbox.lease
        await daemon.runs.end(run.run_id)


async def test_a_uid_record_that_cannot_be_written_refuses_the_start_and_leaves_nothing(
    base: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from gatewayd.sandbox import session as session_module

    def full_disk(*args: Any) -> Any:
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    config = sandboxed_config(base, "overlay")
    (base / "ws").mkdir()
    (base / "ws" / "notes.md").write_text("hello\n")
    async with open_daemon(config, preload=True) as daemon:
        prefix = daemon.config.resolved_netns_prefix
        monkeypatch.setattr(session_module, "record_uid", full_disk)
        with pytest.raises(SandboxUnavailable, match="No space left on device"):
            await start(daemon, base, "ws")
        monkeypatch.undo()
        assert daemon.runs.uid_pool.in_use == 0
        assert not list(NETNS_RUN_DIR.glob(f"{prefix}*"))
        assert os.stat(base / "ws").st_uid == 0 and os.stat(base / "ws" / "notes.md").st_uid == 0
        assert list((daemon.config.state_dir / "runs").iterdir()) == []
        refused = [
            json.loads(line)
            for line in daemon.audit.path.read_text().splitlines()
            if '"run_refused"' in line
        ]
        assert [entry["errorCode"] for entry in refused] == ["internal"]
        # The next start is not held up by anything the refused one left.
        run = await start(daemon, base, "ws")
        await daemon.runs.end(run.run_id)


async def test_a_starts_hand_offs_are_the_ones_that_wait_for_something(
    base: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # One hand-off for the apps folder's checks and the lease (not one each); none for
    # binding the run's socket (one short system call) nor for the pins of MCP servers
    # when none is declared.
    handed: list[str] = []
    real_run_sync = trio.to_thread.run_sync

    async def run_sync(fn: Any, *args: Any, **kwargs: Any) -> Any:
        handed.append(getattr(fn, "__qualname__", repr(fn)))
        return await real_run_sync(fn, *args, **kwargs)

    async with open_daemon(sandboxed_config(base, "overlay"), preload=True) as daemon:
        monkeypatch.setattr(trio.to_thread, "run_sync", run_sync)
        run = await start(daemon, base, "ws")
        monkeypatch.undo()
        assert [name for name in handed if "RunSandbox.open" in name] == [
            "RunSandbox.open.<locals>.check_apps_folders_then_lend"
        ], handed
        assert not [name for name in handed if "bind" in name or "McpTools" in name], handed
        assert sorted(handed) == sorted(
            [
                "NamespaceAhead.make.<locals>.<lambda>",
                "record_uid",
                "RunManager._open_workspace.<locals>.open_session",
                "RunSandbox.open.<locals>.check_apps_folders_then_lend",
                "discover_apps",
            ]
        ), handed
        await daemon.runs.end(run.run_id)


# --- an attached run: its command's gate waits for the run's creation too ---------------


async def _attached(daemon: Daemon, workspace: Path, say: Callable[[str], None]) -> int | None:
    """An attached ``gatewayd run`` of MARK, as the control socket's route runs it."""
    null = os.open(os.devnull, os.O_RDWR)
    try:
        return await attached_run(
            daemon.runs,
            sandboxed_request(workspace),
            [PY, "-c", MARK],
            Passthrough(stdin=null, stdout=null, stderr=null),
            say,
            env_values={},
            audit_path=str(daemon.audit.path),
            store_options="",
            stop=trio.CancelScope(),
        )
    finally:
        os.close(null)


def _started_run(line: str) -> str | None:
    match = re.fullmatch(r"gatewayd: run ([0-9a-f]{32}) started .*", line)
    return match[1] if match else None


def _not_started_run(line: str) -> str | None:
    match = re.fullmatch(r"gatewayd: run ([0-9a-f]{32}) was not started: .*", line)
    return match[1] if match else None


async def _until_its_exec_is_recorded(daemon: Daemon, held: threading.Event) -> Run:
    """The attached run, once its creation's flush is held and its ``exec_started`` is
    recorded after it (its start returned, its command's sandbox is being built)."""
    with trio.fail_after(PATIENCE_S):
        while True:
            runs = daemon.registry.all()
            created = runs[0].created_seq if runs else None
            if held.is_set() and created is not None and daemon.audit.last_seq > created:
                return runs[0]
            await trio.sleep(0.001)


Meanwhile = Callable[[trio.Nursery, Run], Awaitable[None]]


async def _attached_while_held(
    daemon: Daemon,
    ws: Path,
    held: threading.Event,
    release: threading.Event,
    meanwhile: Meanwhile | None = None,
) -> tuple[int | None, Run, list[str]]:
    """An attached run of MARK while the audit log's flushes are held: ``meanwhile``
    runs once its ``exec_started`` is recorded, then they are released. Returns its exit
    status, the run and the lines said to its client."""
    said: list[str] = []
    status: list[int | None] = []

    async def attach() -> None:
        status.append(await _attached(daemon, ws, said.append))

    try:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(attach)
            run = await _until_its_exec_is_recorded(daemon, held)
            if meanwhile is not None:
                await meanwhile(nursery, run)
            release.set()
    finally:
        release.set()
    [done] = status
    return done, run, said


async def test_an_attached_runs_command_is_prepared_while_its_creation_is_flushed(
    base: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    async with open_daemon(sandboxed_config(base, "host"), preload=True) as daemon:
        # The audit log's next flush (run_created's) waits until released.
        held, release = _hold_audit_flushes(daemon, monkeypatch)
        ws = base / "ws"
        said: list[tuple[str, bool]] = []

        def say(line: str) -> None:
            run_id = _started_run(line)
            said.append(
                (line, run_id is not None and _durable_event(daemon, run_id, "run_created"))
            )

        status: list[int | None] = []
        meanwhile: list[tuple[bool, bool, bool]] = []

        async def attach() -> None:
            status.append(await _attached(daemon, ws, say))

        try:
            async with trio.open_nursery() as nursery:
                nursery.start_soon(attach)
                with trio.move_on_after(PATIENCE_S):
                    while True:
                        runs = daemon.registry.all()
                        created = runs[0].created_seq if runs else None
                        if (
                            held.is_set()
                            and created is not None
                            and daemon.audit.last_seq > created
                        ):
                            break  # the run's exec_started is recorded: its start returned
                        await trio.sleep(0.001)
                await trio.sleep(0.3)  # bwrap builds the sandbox meanwhile, then waits
                meanwhile.append(
                    (
                        daemon.audit.last_seq > (created or daemon.audit.last_seq),
                        daemon.audit.durable_seq < (created or 0),
                        (ws / "ran").exists() or bool(said),
                    )
                )
                release.set()
        finally:
            release.set()
        # The command was under way before the run's creation was durable; neither it
        # nor the run's "started" line came before that.
        assert meanwhile == [(True, True, False)]
        assert status == [0]
        assert (ws / "ran").read_text() == "ran"
        assert said and _started_run(said[0][0]) is not None and said[0][1] is True


async def test_an_attached_run_whose_creation_is_not_made_durable_runs_nothing(
    base: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    async with open_daemon(sandboxed_config(base, "host"), preload=True) as daemon:
        ws = base / "ws"
        uids: list[int] = []

        async def failing(seq: int) -> None:
            runs = daemon.registry.all()
            uids.extend(r.sandbox.user.uid for r in runs if r.sandbox is not None)
            await trio.sleep(0.3)  # bwrap builds the whole sandbox meanwhile, then blocks
            raise AuditWriteError("the disk went away")

        monkeypatch.setattr(daemon.audit, "durable", failing)
        said: list[str] = []
        status = await _attached(daemon, ws, said.append)
        monkeypatch.undo()
        assert status == EXIT_FAILED
        assert not (ws / "ran").exists()
        assert uids and all(pids_of_uid(uid) == [] for uid in set(uids))
        assert said and _started_run(said[0]) is not None  # the run's id, for the operator
        assert (
            "gatewayd: the audit log cannot be written (the disk went away), so the command "
            f"was not started (exit {EXIT_FAILED}); fix the audit log"
        ) in said, said
        assert not any("exit status is not passed on" in line for line in said), said
        with trio.fail_after(PATIENCE_S):
            while daemon.registry.all():
                await trio.sleep(0.01)
        # The log is back: the next attached run runs.
        assert await _attached(daemon, ws, said.append) == 0
        assert (ws / "ran").exists()


async def test_an_attached_run_whose_creation_cannot_be_written_is_never_said_to_have_started(
    base: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The disk fails the creation's own flush (not a stand-in for durable): the flusher
    # fails the log and wakes every waiter at once, the run's start and its command's gate.
    async with open_daemon(sandboxed_config(base, "host"), preload=True) as daemon:
        held, release = _hold_audit_flushes(daemon, monkeypatch, fail_from=1)
        ws = base / "ws"
        uids: list[int] = []

        async def meanwhile(_: trio.Nursery, run: Run) -> None:
            assert run.sandbox is not None
            uids.append(run.sandbox.user.uid)
            await trio.sleep(0.3)  # bwrap builds the sandbox meanwhile, then waits

        status, run, said = await _attached_while_held(daemon, ws, held, release, meanwhile)
        monkeypatch.undo()
        [uid] = uids
        assert daemon.audit.failed
        assert status == EXIT_FAILED
        assert not (ws / "ran").exists()
        assert pids_of_uid(uid) == []
        assert not [line for line in said if _started_run(line) is not None], said
        assert said and _not_started_run(said[0]) == run.run_id, said
        assert "Input/output error" in said[0], said


async def test_an_attached_run_ended_while_its_creation_is_flushed_keeps_its_end_reason(
    base: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Its caller holds the run before the creation is durable: an end meanwhile (the
    # daemon stopping, an operator's DELETE) is that end, not a failed start.
    async with open_daemon(sandboxed_config(base, "host"), preload=True) as daemon:
        # The audit log's next flush (run_created's) waits until released.
        held, release = _hold_audit_flushes(daemon, monkeypatch)

        async def meanwhile(nursery: trio.Nursery, run: Run) -> None:
            nursery.start_soon(daemon.runs.end, run.run_id, "daemon_stopping")
            await trio.sleep(0.3)

        ws = base / "ws"
        status, run, _ = await _attached_while_held(daemon, ws, held, release, meanwhile)
        monkeypatch.undo()
        assert status == EXIT_FAILED
        assert not (ws / "ran").exists()
        [ended] = _run_events(daemon, run.run_id, "run_ended")
        assert _durable_event(daemon, run.run_id, "run_created")
        assert ended["detail"]["reason"] == "daemon_stopping", ended
        assert run.end_reason == "daemon_stopping"


async def test_an_attached_run_whose_creation_is_durable_is_said_to_have_started_whatever_fails_next(
    base: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The creation's flush is written; the next one (its command's exec_started) fails:
    # the run is on the record, and the operator is told so, then why nothing ran.
    async with open_daemon(sandboxed_config(base, "host"), preload=True) as daemon:
        # The first flush waits (exec_started is recorded meanwhile: not in it), then
        # is written; the next one fails.
        held, release = _hold_audit_flushes(daemon, monkeypatch, fail_from=2)
        ws = base / "ws"
        status, run, said = await _attached_while_held(daemon, ws, held, release)
        monkeypatch.undo()
        assert daemon.audit.failed
        assert status == EXIT_FAILED
        assert not (ws / "ran").exists()
        assert _durable_event(daemon, run.run_id, "run_created")
        assert said and _started_run(said[0]) == run.run_id, said
        assert not [line for line in said if _not_started_run(line) is not None], said
