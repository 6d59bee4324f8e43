"""`gatewayd audit ...` as a security reviewer runs it, on real rotated logs: a live
`gatewayd serve --audit-max-bytes` whose log rotates under real calls, `verify` exit
codes for a deleted middle and a deleted oldest segment, `tail -f` following new
entries across rotations, and every error path with its exit status and message."""

from __future__ import annotations

import json
import os
import queue
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest
import trio

from gatewayd.audit import AuditEvent, open_audit_log
from gatewayd.audit.query import read_log
from gatewayd.audit.segments import list_segments
from tests.conftest import OPEN_POLICY, write_policy
from tests.livedaemon import start_daemon

BIN = Path(sys.executable).parent
GATEWAYD = str(BIN / "gatewayd")
COGNI_TOOL = str(BIN / "cogni-tool")
ENV = {**os.environ, "LITELLM_LOCAL_MODEL_COST_MAP": "True"}
# A bound on "soon" for things that take milliseconds (tail polls every 0.2 s).
PATIENCE_S = 15.0


def gatewayd(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [GATEWAYD, *args], capture_output=True, text=True, env=ENV, timeout=60, check=False
    )


async def _marks(path: Path, start: int, count: int, pause_every: int = 0) -> None:
    async with open_audit_log(path, fsync=False, max_bytes=2048) as log:
        for i in range(start, start + count):
            await log.append("event", event=AuditEvent.EGRESS, detail={"i": i, "pad": "x" * 60})
            if pause_every and i % pause_every == 0:
                await trio.sleep(0.05)  # let a follower poll between some rotations


def write_marks(path: Path, start: int, count: int, pause_every: int = 0) -> None:
    trio.run(_marks, path, start, count, pause_every)


def seqs(path: Path) -> list[int]:
    return [r.entry["seq"] for r in read_log(path) if r.entry is not None]


# --- a live daemon rotates under real calls ----------------------------------------------


def test_serve_rotates_its_audit_log_and_the_tools_read_every_segment(short_tmp: Path) -> None:
    tmp_path = short_tmp  # a run's socket path must fit sun_path
    (tmp_path / "ws" / "docs").mkdir(parents=True)
    policy = write_policy(tmp_path, OPEN_POLICY)
    daemon = start_daemon(tmp_path / "state", "--audit-max-bytes", "2048")
    try:
        run = daemon.create_run(tmp_path / "ws", policy)
        calls = subprocess.run(
            [
                "sh",
                "-c",
                f"for i in 1 2 3 4 5 6; do {COGNI_TOOL} exec time.now '{{}}'; "
                f'{COGNI_TOOL} exec fs.read \'{{"path": "/etc/passwd"}}\'; done; true',
            ],
            env={**ENV, "COGNI_GATEWAY_SOCK": run["socket"], "COGNI_RUN_ID": run["runId"]},
            capture_output=True,
            text=True,
            timeout=60,
            check=False,
        )
        assert calls.returncode == 0, calls.stderr
        status, ended = daemon.control("DELETE", f"/v1/runs/{run['runId']}")
        assert status == 200, ended
    finally:
        assert daemon.stop() == 0
    log = daemon.audit_path
    assert len(list_segments(log)) >= 2  # it rotated, under real writes

    verify = gatewayd("audit", "verify", str(log))
    assert verify.returncode == 0, verify.stdout
    assert verify.stdout.startswith("OK: ") and " segments, chain intact" in verify.stdout

    stats = json.loads(gatewayd("audit", "stats", "--json", str(log)).stdout)
    [mine] = [r for r in stats["runs"] if r["runId"] == run["runId"]]
    run_ended = ended["run"]
    assert (mine["calls"], mine["denied"]) == (run_ended["calls"], run_ended["denied"]) == (12, 6)
    assert stats["deniedByCode"] == {"policy_denied": 6}
    assert (mine["actor"], mine["tenant"], mine["endReason"]) == (
        "tester",
        "t1",
        "ended_by_operator",
    )

    bundle = json.loads(gatewayd("audit", "run", run["runId"], str(log)).stdout)
    assert bundle["ok"] is True and bundle["ended"] is True and "errorCode" not in bundle
    kinds = [e["kind"] for e in bundle["auditLog"]]
    assert kinds.count("call") == 12 and kinds.count("result") == 12


# --- verify: exit status and message ------------------------------------------------------


@pytest.fixture
def rotated(tmp_path: Path) -> Path:
    path = tmp_path / "audit" / "audit.jsonl"
    write_marks(path, 0, 60)
    assert len(list_segments(path)) >= 4
    return path


def test_verify_of_an_intact_rotated_log_exits_0_naming_the_segments(rotated: Path) -> None:
    proc = gatewayd("audit", "verify", str(rotated))
    files = len(list_segments(rotated)) + 1
    assert proc.returncode == 0
    assert proc.stdout.startswith(f"OK: {len(seqs(rotated))} entries in {files} segments")


def test_verify_reports_a_deleted_middle_segment_by_name_and_exits_1(rotated: Path) -> None:
    gone = list_segments(rotated)[2][1]
    gone.unlink()
    proc = gatewayd("audit", "verify", str(rotated))
    assert proc.returncode == 1
    assert proc.stdout.startswith("FAILED: the audit log does not verify")
    assert f"segment {gone.name} is missing" in proc.stdout
    assert "(missing, " in proc.stdout


def test_verify_reports_a_deleted_oldest_segment_as_partial_and_exits_3(rotated: Path) -> None:
    oldest = list_segments(rotated)[0][1]
    oldest.unlink()
    proc = gatewayd("audit", "verify", str(rotated))
    assert proc.returncode == 3, proc.stdout
    assert proc.stdout.startswith("PARTIAL: the log starts at seq ")
    assert f"the last of them {oldest.name}" in proc.stdout


# --- tail ---------------------------------------------------------------------------------


def test_tail_n_reaches_back_across_a_segment_boundary(rotated: Path) -> None:
    active_lines = len(rotated.read_bytes().splitlines())
    want = active_lines + 3
    proc = gatewayd("audit", "tail", "--json", "-n", str(want), str(rotated))
    assert proc.returncode == 0
    got = [json.loads(line)["seq"] for line in proc.stdout.splitlines()]
    assert got == seqs(rotated)[-want:]


def _reader(stream: Any, lines: queue.Queue[str]) -> None:
    for line in stream:
        lines.put(line)


def test_tail_follow_sees_every_new_entry_once_across_rotations(rotated: Path) -> None:
    proc = subprocess.Popen(
        [GATEWAYD, "audit", "tail", "-f", "--json", "-n", "1", str(rotated)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=ENV,
    )
    lines: queue.Queue[str] = queue.Queue()
    threading.Thread(target=_reader, args=(proc.stdout, lines), daemon=True).start()
    try:
        first = json.loads(lines.get(timeout=PATIENCE_S))
        assert first["seq"] == seqs(rotated)[-1]  # -n 1: the last entry, then follow
        before = len(list_segments(rotated))
        # Bursts between pauses: some polls see several rotations at once.
        write_marks(rotated, 60, 80, pause_every=9)
        assert len(list_segments(rotated)) >= before + 3
        last = seqs(rotated)[-1]
        seen = [first["seq"]]
        deadline = time.monotonic() + PATIENCE_S
        while seen[-1] < last and time.monotonic() < deadline:
            seen.append(json.loads(lines.get(timeout=PATIENCE_S))["seq"])
        assert seen == list(range(first["seq"], last + 1))  # each once, in order
        time.sleep(0.5)
        assert lines.empty()  # nothing repeated after the end
    finally:
        proc.terminate()
        proc.wait(timeout=10)


def test_tail_follow_waits_for_a_log_that_does_not_exist_yet(tmp_path: Path) -> None:
    path = tmp_path / "later" / "audit.jsonl"
    proc = subprocess.Popen(
        [GATEWAYD, "audit", "tail", "-f", "--run", "x", str(path)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=ENV,
    )
    lines: queue.Queue[str] = queue.Queue()
    threading.Thread(target=_reader, args=(proc.stdout, lines), daemon=True).start()
    try:
        assert lines.get(timeout=PATIENCE_S).startswith("    SEQ TIME (UTC)")
        lines.get(timeout=PATIENCE_S)  # the rule under the header
        write_marks(path, 0, 3)
        time.sleep(0.6)
        assert lines.empty()  # --run x: none of these are shown
        assert proc.poll() is None  # still following
    finally:
        proc.terminate()
        proc.wait(timeout=10)


# --- error paths ----------------------------------------------------------------------------


@pytest.mark.parametrize("command", ["verify", "show", "export", "stats", "tail"])
def test_a_missing_log_exits_1_saying_where_it_looked(tmp_path: Path, command: str) -> None:
    proc = gatewayd("audit", command, str(tmp_path / "nothing.jsonl"))
    assert proc.returncode == 1 and proc.stdout == ""
    assert f"no audit log at {tmp_path / 'nothing.jsonl'}" in proc.stderr
    assert "nothing.jsonl.NNNNNN" in proc.stderr


@pytest.mark.parametrize("command", ["verify", "show", "stats"])
def test_a_log_that_cannot_be_read_exits_1_with_the_os_reason(tmp_path: Path, command: str) -> None:
    proc = gatewayd("audit", command, str(tmp_path))
    assert proc.returncode == 1
    assert f"cannot read the audit log {tmp_path}: Is a directory" in proc.stderr


@pytest.mark.parametrize("command", ["verify", "show", "export", "stats", "tail"])
@pytest.mark.parametrize("suffix", ["/", "//", "/x"])
def test_a_log_path_through_a_file_exits_1_with_the_os_reason(
    rotated: Path, command: str, suffix: str
) -> None:
    # "audit.jsonl/" names a directory: its segments' listing fails, said as the log's.
    proc = gatewayd("audit", command, f"{rotated}{suffix}")
    assert proc.returncode == 1, proc
    assert "Traceback" not in proc.stderr
    assert "cannot read the audit log" in proc.stderr and "Not a directory" in proc.stderr


def test_a_bad_time_exits_2_with_the_accepted_forms(rotated: Path) -> None:
    proc = gatewayd("audit", "export", "--until", "noon", str(rotated))
    assert proc.returncode == 2 and proc.stdout == ""
    assert "argument --until: not an ISO 8601 time: 'noon'" in proc.stderr


def test_an_unknown_run_exits_1_and_says_how_to_find_runs(rotated: Path) -> None:
    proc = gatewayd("audit", "run", "0" * 32, str(rotated))
    assert proc.returncode == 1 and proc.stdout == ""
    assert f"no run '{'0' * 32}' in it" in proc.stderr
    assert "gatewayd audit stats" in proc.stderr


def test_bad_audit_max_bytes_is_refused_before_serve_starts(tmp_path: Path) -> None:
    proc = gatewayd("serve", "--state-dir", str(tmp_path), "--audit-max-bytes", "-5")
    assert proc.returncode == 2
    assert "argument --audit-max-bytes: -5 is below 0" in proc.stderr
    assert not (tmp_path / "audit").exists()


def test_a_copied_log_directory_verifies_the_same(rotated: Path, tmp_path: Path) -> None:
    # Backups copy the directory: segments travel with the active file and its head.
    copy = tmp_path / "backup"
    shutil.copytree(rotated.parent, copy)
    proc = gatewayd("audit", "verify", str(copy / rotated.name))
    assert proc.returncode == 0, proc.stdout
