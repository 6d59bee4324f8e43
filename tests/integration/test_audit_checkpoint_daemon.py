"""A real `gatewayd serve` signs its audit tree's checkpoints: at start, within a second
after new entries, at a run's end and at stop; a configured key inside the audit
directory stops the start; and a `kill -9` between an entry and its checkpoint loses
neither: the next start signs a checkpoint that covers the entry and is consistent with
the one before the crash (proved with `gatewayd audit prove --consistency` and checked
with `verify-proof`, as a witness or a reviewer would)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from gatewayd.audit.checkpoint import Checkpoint, parse_checkpoint
from gatewayd.audit.checkpointer import checkpoint_path, read_history
from gatewayd.audit.note import Verifier, generate_key, open_note
from gatewayd.audit.query import read_log
from tests.conftest import OPEN_POLICY, write_policy
from tests.livedaemon import LiveDaemon, start_daemon

BIN = Path(sys.executable).parent
GATEWAYD = str(BIN / "gatewayd")
# The promise is one second; a loaded test machine gets some slack on top.
CHECKPOINT_WITHIN_S = 1.0
SLACK_S = 2.0
KILL_ATTEMPTS = 5


def latest(daemon: LiveDaemon, vkey: str) -> Checkpoint | None:
    try:
        note = checkpoint_path(daemon.audit_path).read_text()
    except FileNotFoundError:
        return None
    text, _ = open_note(note, [Verifier.from_string(vkey)])
    return parse_checkpoint(text)


def wait_for_size(daemon: LiveDaemon, vkey: str, size: int, within_s: float) -> float:
    """Seconds until the latest checkpoint covers ``size`` entries."""
    started = time.monotonic()
    while (found := latest(daemon, vkey)) is None or found.size < size:
        assert time.monotonic() - started < within_s, (
            f"no checkpoint of {size} entries within {within_s} s (latest: {found})"
        )
        time.sleep(0.01)
    return time.monotonic() - started


def last_seq(daemon: LiveDaemon) -> int:
    return max(int(r.entry["seq"]) for r in read_log(daemon.audit_path) if r.entry is not None)


def gatewayd(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [GATEWAYD, *args], capture_output=True, text=True, timeout=60, check=False
    )


@pytest.fixture
def key(short_tmp: Path, monkeypatch: pytest.MonkeyPatch) -> str:
    """A checkpoint key outside the state directory, given to the daemons the test
    starts through GATEWAYD_AUDIT_CHECKPOINT_KEY; returns the verifier key."""
    skey, vkey = generate_key("it.example/gatewayd-audit")
    path = short_tmp / "keys" / "checkpoint.key"
    path.parent.mkdir()
    path.write_text(skey + "\n")
    path.chmod(0o600)
    monkeypatch.setenv("GATEWAYD_AUDIT_CHECKPOINT_KEY", str(path))
    return vkey


def test_a_daemon_checkpoints_on_time_and_survives_a_kill_9_between_entry_and_checkpoint(
    short_tmp: Path, key: str
) -> None:
    (short_tmp / "ws" / "docs").mkdir(parents=True)
    policy = write_policy(short_tmp, OPEN_POLICY)
    state = short_tmp / "state"
    daemon = start_daemon(state)
    try:
        wait_for_size(daemon, key, last_seq(daemon), SLACK_S)  # at start
        run = daemon.create_run(short_tmp / "ws", policy)
        waited = wait_for_size(daemon, key, last_seq(daemon), CHECKPOINT_WITHIN_S + SLACK_S)
        print(f"checkpoint {waited:.3f} s after run_created")
        status, _ = daemon.control("DELETE", f"/v1/runs/{run['runId']}")
        assert status == 200
        ended = [
            r.entry["seq"]
            for r in read_log(daemon.audit_path)
            if r.entry is not None and r.entry.get("event") == "run_ended"
        ]
        waited = wait_for_size(daemon, key, ended[-1], SLACK_S)
        print(f"checkpoint {waited:.3f} s after run_ended")
        # `gatewayd audit checkpoint` beside the live daemon: the same series, in turn
        on_demand = gatewayd(
            "audit",
            "checkpoint",
            "--key",
            os.environ["GATEWAYD_AUDIT_CHECKPOINT_KEY"],
            str(daemon.audit_path),
        )
        assert on_demand.returncode == 0, on_demand.stderr
        assert on_demand.stdout.startswith("it.example/gatewayd-audit\n")
        # kill -9 right after an entry is durable (the control answer waits for it),
        # before the checkpointer's next look; tried again if it was quicker than us
        for _attempt in range(KILL_ATTEMPTS):
            daemon.create_run(short_tmp / "ws", policy)
            os.kill(daemon.proc.pid, signal.SIGKILL)
            daemon.proc.wait()
            before = latest(daemon, key)
            assert before is not None
            if before.size < last_seq(daemon):
                break
            daemon = start_daemon(state)
        else:
            pytest.fail("the checkpoint always came before the kill")
        crashed_at = last_seq(daemon)
        daemon = start_daemon(state)
        wait_for_size(daemon, key, crashed_at + 1, SLACK_S)
        after = latest(daemon, key)
        assert after is not None
        assert after.size > crashed_at  # the entry the crash left unsigned, and more
        # consistent with the checkpoint before the crash: as a witness would check it
        proof = gatewayd(
            "audit",
            "prove",
            "--key",
            key,
            "--consistency",
            str(before.size),
            str(after.size),
            str(daemon.audit_path),
        )
        assert proof.returncode == 0, proof.stderr
        bundle = short_tmp / "consistency.json"
        bundle.write_text(proof.stdout)
        checked = gatewayd("audit", "verify-proof", "--key", key, str(bundle))
        assert checked.returncode == 0, checked.stdout
        assert f"extends its checkpoint of size {before.size}" in checked.stdout
    finally:
        daemon.stop()
    # at stop: the final checkpoint covers audit_close
    final = latest(daemon, key)
    assert final is not None
    assert final.size == last_seq(daemon)
    verified = gatewayd(
        "audit",
        "verify",
        "--checkpoint",
        str(checkpoint_path(daemon.audit_path)),
        "--key",
        key,
        str(daemon.audit_path),
    )
    assert verified.returncode == 0, verified.stdout + verified.stderr
    sizes = [size for size, _ in read_history(daemon.audit_path)]
    assert sizes == sorted(sizes)
    assert json.loads(daemon.audit_path.read_bytes().splitlines()[-1])["event"] == "audit_close"


def test_a_key_inside_the_audit_directory_stops_the_start(
    short_tmp: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    skey, _ = generate_key("it.example/gatewayd-audit")
    state = short_tmp / "state"
    inside = state / "audit" / "checkpoint.key"
    inside.parent.mkdir(parents=True)
    inside.write_text(skey)
    inside.chmod(0o600)
    monkeypatch.setenv("GATEWAYD_AUDIT_CHECKPOINT_KEY", str(inside))
    with pytest.raises(RuntimeError, match="inside the audit directory") as caught:
        start_daemon(state)
    assert skey not in str(caught.value)


def test_a_rewritten_history_is_refused_once_in_the_audit_log_and_calls_go_on(
    short_tmp: Path, key: str
) -> None:
    from tests.unit.test_audit_checkpoints import change_detail, rewrite

    (short_tmp / "ws" / "docs").mkdir(parents=True)
    policy = write_policy(short_tmp, OPEN_POLICY)
    state = short_tmp / "state"
    daemon = start_daemon(state)
    try:
        daemon.create_run(short_tmp / "ws", policy)
    finally:
        daemon.stop()
    signed = latest(daemon, key)
    assert signed is not None
    rewrite(daemon.audit_path, change_detail(2))  # as root would: log and head together
    daemon = start_daemon(state)
    try:
        daemon.create_run(short_tmp / "ws", policy)  # calls go on
        daemon.create_run(short_tmp / "ws", policy)
    finally:
        daemon.stop()
    refusals = [
        r.entry
        for r in read_log(daemon.audit_path)
        if r.entry is not None and r.entry.get("event") == "audit_checkpoint_failed"
    ]
    assert len(refusals) == 1, refusals  # once per reason, not per attempt
    reason = refusals[0]["detail"]["reason"]
    assert "refusing to sign a checkpoint" in reason
    assert f"not an extension of checkpoint {signed.size}" in reason
    assert "gatewayd audit verify --checkpoint" in reason
    assert latest(daemon, key) == signed  # nothing signed over the forgery
