"""tests/systemdbox.py's clean-up, against a fake systemd-box tool: a start that fails
half-way leaves neither its nspawn nor its files, a stop removes what the tool left, and
a pid file naming anything but that box's nspawn never gets a process killed."""

from __future__ import annotations

import os
import subprocess
import time
from pathlib import Path

import pytest

from tests import systemdbox
from tests.systemdbox import Box, BoxUnavailable, start_box, stop_box

# The fake starts a stand-in for nspawn (a process whose argv[0] is systemd-nspawn, in a
# session of its own as the real tool's setsid makes it), records it as the tool does once
# it has exec'd (as the real nspawn has long before the tool reports a failure), says why
# it failed, and exits 1; `stop` fails as the tool does for an unknown box.
# "Exec'd" is argv[0], not a grep of the whole command line: the setsid and bash on the
# way carry the string in their arguments, and a process between two execs shows an empty
# command line, so a pid recorded early could look like no nspawn and never be killed.
FAKE_TOOL = """\
#!/bin/bash
state={state}
case "$1" in
start)
  setsid bash -c 'exec -a systemd-nspawn sleep 60' </dev/null >/dev/null 2>&1 &
  until IFS= read -r -d '' argv0 2>/dev/null </proc/$!/cmdline && [ "$argv0" = systemd-nspawn ]
  do sleep 0.01; done
  echo $! > "$state/$2.nspawn"
  echo "nspawn: Failed to register machine" > "$state/$2.log"
  echo "systemd-box: nspawn exited; log:" >&2
  exit 1;;
stop)
  echo "systemd-box: no box named $2" >&2; exit 2;;
esac
"""


@pytest.fixture
def fake_tool(short_tmp: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    state = short_tmp / "state"
    state.mkdir()
    tool = short_tmp / "systemd-box"
    tool.write_text(FAKE_TOOL.format(state=state))
    monkeypatch.setattr(systemdbox, "TOOL", tool)
    monkeypatch.setattr(systemdbox, "_TOOL_ARGV", ("/bin/bash", str(tool)))
    monkeypatch.setattr(systemdbox, "STATE_DIR", state)
    monkeypatch.setattr(systemdbox, "unavailable_reason", lambda: None)
    return state


def _alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().split()[2] != "Z"
    except OSError:
        return False


def test_a_failed_start_says_why_and_leaves_no_nspawn_and_no_file(fake_tool: Path) -> None:
    with pytest.raises(BoxUnavailable) as failed:
        start_box("t-box")
    message = str(failed.value)
    assert "start t-box failed (exit 1)" in message and "nspawn exited" in message
    assert "Failed to register machine" in message  # the tail of nspawn's log
    assert list(fake_tool.iterdir()) == []


def test_a_failed_start_kills_its_nspawn(fake_tool: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    seen: list[int] = []
    original = systemdbox._remove_failed_start

    def remember(name: str) -> None:
        pid = int((fake_tool / f"{name}.nspawn").read_text())
        recorded = Path(f"/proc/{pid}/cmdline").read_bytes()
        seen.append(pid)
        original(name)
        # Recorded once exec'd, as the real tool's nspawn is by the time it fails.
        assert recorded.startswith(b"systemd-nspawn\0"), recorded

    monkeypatch.setattr(systemdbox, "_remove_failed_start", remember)
    with pytest.raises(BoxUnavailable):
        start_box("t-kill")
    assert seen
    deadline = time.monotonic() + 5  # SIGKILL sent: gone (or a zombie) within moments
    while _alive(seen[0]) and time.monotonic() < deadline:
        time.sleep(0.01)
    assert not _alive(seen[0])


def test_stop_removes_what_the_tool_left_but_kills_only_that_boxs_nspawn(
    fake_tool: Path,
) -> None:
    bystander = subprocess.Popen(["sleep", "60"])
    try:
        (fake_tool / "t-stop.nspawn").write_text(f"{bystander.pid}\n")
        (fake_tool / "t-stop.log").write_text("")
        (fake_tool / "t-stop.init").write_text("1\n")
        (fake_tool / "t-stopper.init").write_text("1\n")  # another box: untouched
        stop_box(Box("t-stop"))
        assert sorted(p.name for p in fake_tool.iterdir()) == ["t-stopper.init"]
        time.sleep(0.1)
        assert bystander.poll() is None  # not an nspawn: never signalled
    finally:
        bystander.kill()
        bystander.wait()


def test_box_names_carry_the_worker_and_the_pid(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PYTEST_XDIST_WORKER", "gw1")
    name = systemdbox.box_name("e2e")
    assert name.endswith(f"-e2e-gw1-{os.getpid()}") and len(name) < 64


def test_boxes_of_a_killed_session_are_stopped_and_live_ones_kept(
    fake_tool: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(systemdbox, "NAME_PREFIX", "t-pre")
    gone = subprocess.Popen(["true"])
    gone.wait()
    for name in (f"t-pre-e2e-gw0-{gone.pid}", f"t-pre-e2e-gw1-{os.getpid()}", "t-other-1"):
        (fake_tool / f"{name}.init").write_text("1\n")
    assert systemdbox.stop_stale_boxes() == [f"t-pre-e2e-gw0-{gone.pid}"]
    left = sorted(p.name for p in fake_tool.iterdir())
    assert left == ["t-other-1.init", f"t-pre-e2e-gw1-{os.getpid()}.init"]
