"""`gatewayd workspace list|diff|commit|discard` and the control socket's
``/v1/workspaces`` routes, against a real `gatewayd serve` process and, with no daemon,
the command's own in-process daemon: kept sessions (made by the store here, as a run's
end leaves them) listed, diffed, committed and discarded, every refusal's status, code
and message, the audit entries, the daemon's recovery at start and its expiry."""

from __future__ import annotations

import json
import os
import secrets
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from gatewayd.configdefaults import agent_dir_for
from gatewayd.workspace.store import WorkspaceStore, _mounts_under
from tests.conftest import ROOT
from tests.livedaemon import BIN, LiveDaemon, start_daemon

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="overlay mounts need root")


def make_base(where: Path) -> Path:
    base = where / f"base-{secrets.token_hex(4)}"
    (base / "src").mkdir(parents=True)
    (base / "src" / "main.py").write_text("print(1)\n")
    (base / "README").write_text("readme\n")
    return base


def kept_session(
    state: Path,
    base: Path,
    mode: str = "overlay",
    *,
    keep_for_s: int = 3600,
    max_delta_bytes: int | None = None,
) -> str:
    """A session as a run's end leaves it (kept), made by this process's store."""
    run_id = secrets.token_hex(16)
    store = store_of(state)
    handle = store.open_session(
        run_id,
        base,
        mode,  # type: ignore[arg-type]
        on_end="keep",
        keep_for_s=keep_for_s,
        max_delta_bytes=max_delta_bytes,
    )
    (handle.root / "src" / "main.py").write_text("print(2)\n")
    (handle.root / "new.txt").write_text("new\n")
    store.end_of_run(run_id)
    return run_id


def store_of(state: Path) -> WorkspaceStore:
    """The store of the daemon on ``state`` (in its agent directory, beside it)."""
    return WorkspaceStore(Path(agent_dir_for(str(state))))


def audit_events(path: Path, name: str) -> list[dict[str, Any]]:
    entries = [json.loads(line) for line in path.read_text().splitlines() if line]
    return [entry for entry in entries if entry.get("event") == name]


def gatewayd(*args: str, state: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [str(BIN / "gatewayd"), "workspace", *args, "--state-dir", str(state), "--no-os-sandbox"],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=ROOT,
        check=False,
    )


@pytest.fixture(scope="module")
def where(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    path = tmp_path_factory.mktemp("ws")
    yield path
    for point in _mounts_under(path):
        subprocess.run(["umount", "-l", str(point)], check=False)


@pytest.fixture(scope="module")
def daemon(where: Path) -> Iterator[LiveDaemon]:
    live = start_daemon(where / "state")
    try:
        yield live
    finally:
        live.stop()


def test_the_control_socket_lists_diffs_and_commits(daemon: LiveDaemon, where: Path) -> None:
    base = make_base(where)
    run_id = kept_session(daemon.state, base)
    status, listed = daemon.control("GET", "/v1/workspaces")
    assert status == 200 and listed["ok"]
    [info] = [w for w in listed["workspaces"] if w["runId"] == run_id]
    assert info["mode"] == "overlay" and info["state"] == "kept"
    assert info["base"] == str(base) and info["keepUntil"].endswith("Z")
    assert info["counts"]["added"] == 1 and info["counts"]["modified"] == 1
    status, one = daemon.control("GET", f"/v1/workspaces/{run_id}")
    assert status == 200 and one["workspace"] == info
    status, diffed = daemon.control("GET", f"/v1/workspaces/{run_id}/diff")
    assert status == 200
    assert diffed["diff"]["added"] == ["new.txt"]
    assert "+print(2)" in diffed["diff"]["unified"]
    assert (base / "src" / "main.py").read_text() == "print(1)\n"
    status, done = daemon.control("POST", f"/v1/workspaces/{run_id}/commit", {"by": "ops"})
    assert status == 200 and done["committed"]["modified"] == ["src/main.py"]
    assert (base / "src" / "main.py").read_text() == "print(2)\n"
    [entry] = [
        e for e in audit_events(daemon.audit_path, "workspace_committed") if e["runId"] == run_id
    ]
    assert entry["detail"]["by"] == f"ops (uid {os.getuid()})"
    assert entry["detail"]["added"] == 1 and entry["detail"]["base"] == str(base)
    status, gone = daemon.control("GET", f"/v1/workspaces/{run_id}/diff")
    assert status == 404 and gone["errorCode"] == "bad_request"
    assert "committed, discarded or expired" in gone["message"]


def test_the_control_socket_discards(daemon: LiveDaemon, where: Path) -> None:
    base = make_base(where)
    run_id = kept_session(daemon.state, base)
    status, done = daemon.control("POST", f"/v1/workspaces/{run_id}/discard")
    assert status == 200 and done == {"ok": True, "runId": run_id, "discarded": True}
    assert (base / "src" / "main.py").read_text() == "print(1)\n"
    assert not (base / "new.txt").exists()
    [entry] = [
        e for e in audit_events(daemon.audit_path, "workspace_discarded") if e["runId"] == run_id
    ]
    assert entry["detail"]["by"] == f"control socket (uid {os.getuid()})"


def test_control_socket_refusals(daemon: LiveDaemon, where: Path) -> None:
    base = make_base(where)
    unknown = secrets.token_hex(16)
    for method, target in (
        ("GET", f"/v1/workspaces/{unknown}"),
        ("GET", f"/v1/workspaces/{unknown}/diff"),
        ("POST", f"/v1/workspaces/{unknown}/commit"),
        ("POST", f"/v1/workspaces/{unknown}/discard"),
    ):
        status, answer = daemon.control(method, target)
        assert (status, answer["errorCode"]) == (404, "bad_request"), target
        assert f"run {unknown} has no workspace session" in answer["message"]
    for method, target in (
        ("GET", f"/v1/workspaces/{unknown}/commit"),
        ("DELETE", f"/v1/workspaces/{unknown}"),
        ("GET", "/v1/workspaces/../runs"),
        ("GET", "/v1/workspaces/ABC"),
        ("POST", "/v1/workspaces"),
    ):
        status, answer = daemon.control(method, target)
        assert (status, answer["errorCode"]) == (404, "bad_request"), target
        assert "no route" in answer["message"]
    run_id = kept_session(daemon.state, base)
    status, answer = daemon.control("POST", f"/v1/workspaces/{run_id}/commit", {"force": True})
    assert (status, answer["errorCode"]) == (400, "bad_request")
    assert "force" in answer["message"]
    # A conflict: the base changed where the session writes.
    (base / "src" / "main.py").write_text("operator\n")
    status, answer = daemon.control("POST", f"/v1/workspaces/{run_id}/commit")
    assert (status, answer["errorCode"]) == (409, "tool_failed")
    assert "src/main.py" in answer["message"] and "nothing was committed" in answer["message"]
    assert (base / "src" / "main.py").read_text() == "operator\n"
    # Busy: this process holds the session's lock (a live run's).
    live_id = secrets.token_hex(16)
    store = store_of(daemon.state)
    store.open_session(
        live_id, make_base(where), "overlay", on_end="keep", keep_for_s=60, max_delta_bytes=None
    )
    status, answer = daemon.control("POST", f"/v1/workspaces/{live_id}/commit")
    assert (status, answer["errorCode"]) == (409, "tool_failed")
    assert "in use" in answer["message"] and "still live" in answer["message"]
    status, listed = daemon.control("GET", "/v1/workspaces")
    assert {w["runId"]: w["state"] for w in listed["workspaces"]}[live_id] == "live"
    store.end_of_run(live_id)
    store.discard(live_id)
    # A host delta past its limit: limit_exceeded.
    host_id = kept_session(daemon.state, make_base(where), "host", max_delta_bytes=4)
    status, answer = daemon.control("POST", f"/v1/workspaces/{host_id}/commit")
    assert (status, answer["errorCode"]) == (403, "limit_exceeded")
    assert f"gatewayd workspace discard {host_id}" in answer["message"]
    daemon.control("POST", f"/v1/workspaces/{host_id}/discard")
    daemon.control("POST", f"/v1/workspaces/{run_id}/discard")


def test_listing_expires_kept_sessions_past_their_time(daemon: LiveDaemon, where: Path) -> None:
    base = make_base(where)
    run_id = kept_session(daemon.state, base, keep_for_s=1)
    time.sleep(1.1)
    status, listed = daemon.control("GET", "/v1/workspaces")
    assert status == 200 and run_id not in {w["runId"] for w in listed["workspaces"]}
    assert not (base / "new.txt").exists()
    [entry] = [
        e for e in audit_events(daemon.audit_path, "workspace_expired") if e["runId"] == run_id
    ]
    assert entry["detail"]["keptUntil"].endswith("Z") and entry["detail"]["by"] == "expiry"


def test_the_cli_talks_to_the_serving_daemon(daemon: LiveDaemon, where: Path) -> None:
    base = make_base(where)
    run_id = kept_session(daemon.state, base)
    listed = gatewayd("list", state=daemon.state)
    assert listed.returncode == 0, listed.stderr
    assert run_id in listed.stdout and "kept until" in listed.stdout
    assert "1 added 0 removed 1 modified 0 renamed" in listed.stdout
    diffed = gatewayd("diff", run_id, state=daemon.state)
    assert diffed.returncode == 0, diffed.stderr
    assert "+print(2)" in diffed.stdout and (
        f"gatewayd workspace commit --state-dir {daemon.state} {run_id}" in diffed.stdout
    )
    as_json = gatewayd("diff", run_id, "--json", state=daemon.state)
    assert json.loads(as_json.stdout)["diff"]["added"] == ["new.txt"]
    committed = gatewayd("commit", run_id, "--by", "alice", state=daemon.state)
    assert committed.returncode == 0, committed.stderr
    assert "1 added" in committed.stdout
    assert (base / "new.txt").read_text() == "new\n"
    again = gatewayd("commit", run_id, state=daemon.state)
    assert again.returncode == 1
    assert "bad_request" in again.stderr and "gatewayd workspace list" in again.stderr
    bad = gatewayd("discard", "../../etc", state=daemon.state)
    assert bad.returncode == 1 and "is not a run id" in bad.stderr


def test_the_cli_works_on_the_store_when_no_daemon_serves(where: Path) -> None:
    state = where / "alone"
    base = make_base(where)
    kept = kept_session(state, base)
    dropped = kept_session(state, base)
    listed = gatewayd("list", state=state)
    assert listed.returncode == 0, listed.stderr
    assert kept in listed.stdout and dropped in listed.stdout
    conflict = gatewayd("commit", dropped, state=state)
    assert conflict.returncode == 0, conflict.stderr  # nothing changed the base yet
    second = gatewayd("commit", kept, state=state)
    assert second.returncode == 1
    assert "tool_failed" in second.stderr and "src/main.py" in second.stderr
    discarded = gatewayd("discard", kept, state=state)
    assert discarded.returncode == 0, discarded.stderr
    assert "as it was before the run" in discarded.stdout
    assert (
        gatewayd("list", state=state).stdout.strip()
        == "no workspace sessions (none kept, none live)"
    )
    audit = state / "audit" / "audit.jsonl"
    [committed] = audit_events(audit, "workspace_committed")
    assert committed["runId"] == dropped
    assert committed["detail"]["by"].endswith("via gatewayd workspace")
    [entry] = audit_events(audit, "workspace_discarded")
    assert entry["runId"] == kept


def test_a_daemon_start_recovers_a_dead_runs_session(where: Path) -> None:
    state = where / "recovering"
    base = make_base(where)
    run_id = secrets.token_hex(16)
    child = subprocess.run(
        [
            sys.executable,
            "-c",
            "import os\n"
            "from pathlib import Path\n"
            "from gatewayd.workspace.store import WorkspaceStore\n"
            f"h = WorkspaceStore(Path({agent_dir_for(str(state))!r})).open_session({run_id!r}, "
            f"Path({str(base)!r}), 'overlay', on_end='commit', keep_for_s=3600, "
            "max_delta_bytes=1 << 20)\n"
            "(h.root / 'new.txt').write_text('from the dead run\\n')\n"
            "os._exit(9)\n",
        ],
        cwd=ROOT,
        check=False,
    )
    assert child.returncode == 9
    live = start_daemon(state)
    try:
        status, answer = live.control("GET", f"/v1/workspaces/{run_id}")
        assert status == 200
        info = answer["workspace"]
        assert info["state"] == "kept" and info["note"] == "its daemon ended during the run"
        [entry] = audit_events(live.audit_path, "workspace_recovered")
        assert entry["runId"] == run_id and "kept until" in entry["detail"]["what"]
        assert not (base / "new.txt").exists(), "recovery keeps; it never commits"
        status, _ = live.control("POST", f"/v1/workspaces/{run_id}/commit")
        assert status == 200
        assert (base / "new.txt").read_text() == "from the dead run\n"
    finally:
        live.stop()


async def test_the_daemon_expires_kept_sessions_on_its_own(
    short_tmp: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import trio

    import gatewayd.daemon
    from tests.conftest import make_gateway

    # The daemon looks every minute; the test cannot wait that long.
    monkeypatch.setattr(gatewayd.daemon, "EXPIRY_INTERVAL_S", 0.05)
    base = make_base(short_tmp)
    async with make_gateway(short_tmp) as gw:
        run_id = kept_session(gw.daemon.config.state_dir, base, keep_for_s=1)
        with trio.fail_after(10):
            while gw.daemon.workspaces.list():
                await trio.sleep(0.05)
        entries = await gw.audit_entries()
    [entry] = [e for e in entries if e.get("event") == "workspace_expired"]
    assert entry["runId"] == run_id
    assert not (base / "new.txt").exists()


def test_who_committed_carries_the_uid_whatever_name_was_given(where: Path) -> None:
    """``--by`` is a name anyone can type; the audit entry keeps the uid that ran the
    command beside it (once), as the control socket's entries do."""
    state = where / "named"
    base = make_base(where)
    run_id = kept_session(state, base)
    done = gatewayd("commit", run_id, "--by", "alice", state=state)
    assert done.returncode == 0, done.stderr
    dropped = kept_session(state, make_base(where))
    done = gatewayd("discard", dropped, state=state)
    assert done.returncode == 0, done.stderr
    audit = state / "audit" / "audit.jsonl"
    [committed] = audit_events(audit, "workspace_committed")
    assert committed["detail"]["by"] == f"alice (uid {os.getuid()}) via gatewayd workspace"
    [discarded] = audit_events(audit, "workspace_discarded")
    assert discarded["detail"]["by"].count("(uid ") == 1, discarded["detail"]["by"]


def planted_session(state: Path, base: Path, mode: str) -> str:
    """A kept session whose run planted a git hook and a link leading out."""
    (base / ".git" / "hooks").mkdir(parents=True)
    (base / ".git" / "config").write_text("[core]\n")
    run_id = secrets.token_hex(16)
    store = store_of(state)
    handle = store.open_session(
        run_id,
        base,
        mode,  # type: ignore[arg-type]
        on_end="keep",
        keep_for_s=3600,
        max_delta_bytes=None,
    )
    (handle.root / ".git" / "hooks" / "pre-commit").write_text("#!/bin/sh\nid\n")
    os.symlink("/etc/shadow", handle.root / "shadow")
    (handle.root / "src" / "main.py").write_text("print(2)\n")
    store.end_of_run(run_id)
    return run_id


def test_what_a_commit_leaves_out_and_links_out_are_shown_everywhere(
    daemon: LiveDaemon, where: Path
) -> None:
    """The diff marks the hook left out and the link leading out, on the control socket
    and in the CLI; the commit's answer and its audit entry name them."""
    base = make_base(where)
    run_id = planted_session(daemon.state, base, "overlay")
    status, diffed = daemon.control("GET", f"/v1/workspaces/{run_id}/diff")
    assert status == 200 and diffed["mode"] == "overlay"
    [left] = diffed["diff"]["leftOut"]
    assert left["path"] == ".git" and "git metadata" in left["reason"]
    assert diffed["diff"]["linksOut"] == [{"path": "shadow", "target": "/etc/shadow"}]
    assert diffed["diff"]["gitMetadata"] == [".git/hooks/pre-commit"]
    shown = gatewayd("diff", run_id, state=daemon.state)
    assert shown.returncode == 0, shown.stderr
    assert "left out of the commit (never written into the base):\n  .git: git metadata" in (
        shown.stdout
    )
    assert "links leading out of the workspace:\n  shadow -> /etc/shadow" in shown.stdout
    committed = gatewayd("commit", run_id, state=daemon.state)
    assert committed.returncode == 0, committed.stderr
    assert "left out of the commit" in committed.stdout and "  .git: " in committed.stdout
    assert "shadow -> /etc/shadow" in committed.stdout
    assert not (base / ".git" / "hooks" / "pre-commit").exists()
    assert os.readlink(base / "shadow") == "/etc/shadow"
    [entry] = [
        e for e in audit_events(daemon.audit_path, "workspace_committed") if e["runId"] == run_id
    ]
    assert [item["path"] for item in entry["detail"]["leftOut"]] == [".git"]
    assert entry["detail"]["linksOut"] == [{"path": "shadow", "target": "/etc/shadow"}]


def test_a_host_sessions_diff_names_the_git_metadata_already_written(where: Path) -> None:
    state = where / "host-git"
    base = make_base(where)
    run_id = planted_session(state, base, "host")
    shown = gatewayd("diff", run_id, state=state)
    assert shown.returncode == 0, shown.stderr
    assert "git metadata the run wrote into the base itself" in shown.stdout
    assert "  .git/hooks/pre-commit" in shown.stdout
    assert "left out of the commit" not in shown.stdout
    as_json = json.loads(gatewayd("diff", run_id, "--json", state=state).stdout)
    assert as_json["mode"] == "host" and as_json["diff"]["leftOut"] == []
