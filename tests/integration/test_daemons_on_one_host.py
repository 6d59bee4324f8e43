"""Two gatewayd daemons on one host cannot break each other.

A live `gatewayd serve` holds a sandboxed run (its own uid, a real network namespace, its
workspace lent). A second daemon (`gatewayd run`, `serve` or `agent run`, or one in this
process) either starts beside it without touching it (another state directory, default
settings: its own derived prefix and uids), or is refused before it opens or sweeps
anything, with a message naming the live daemon and the setting to change. The first
daemon's run is then shown to be whole by what it can still do: a new command in its
sandbox (which joins the pinned namespace) makes a gateway call.

The registry's own refusals (a directory others could write, a live entry that cannot
be read, a start stuck holding the lock, an unprivileged daemon) are shown on real
directories, flocks and processes.

A live daemon's control socket and audit log are its alone: a second `serve` given them
(as they are, through a symbolic link, a linked directory or a relative path) is refused
before it touches anything, and the first one's socket and log files are as they were;
a control socket path something else holds is neither taken nor removed.
"""

from __future__ import annotations

import fcntl
import json
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import textwrap
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from gatewayd.config import GatewaydConfig
from gatewayd.daemon import open_daemon
from gatewayd.sandbox.daemons import (
    DAEMONS_DIR,
    DaemonClash,
    DaemonRegistryError,
    DaemonShare,
    live_daemons,
    register_daemon,
)
from gatewayd.sandbox.netns import NETNS_RUN_DIR
from gatewayd.sandbox.uids import UidRange
from tests.livedaemon import LiveDaemon, start_daemon

GATEWAYD = str(Path(sys.executable).parent / "gatewayd")
PY = "/usr/bin/python3"
# A refused start ends within a second or two (imports, then the registry says no); one
# that is not refused would run `serve` for ever: this bounds the test, not gatewayd.
REFUSAL_WAIT_S = 60
# A one-shot run that starts (a sandbox, one call, teardown).
ONE_SHOT_WAIT_S = 120

POLICY = """
version: 1
name: sandboxed
tools:
  allow: [time.now, fs.read]
filesystem:
  paths:
    workspace: {root: ., mode: rw}
limits: {calls_per_second: 1000, burst: 1000}
sandbox: {timeout_s: 30, cpu_s: 20, max_processes: 48, max_output_bytes: 65536}
"""


def _unavailable() -> str | None:
    if os.geteuid() != 0:
        return "sandboxed runs and the host's registry of daemons need root"
    if not os.path.exists("/usr/bin/bwrap") or not os.path.exists(PY):
        return "needs bubblewrap at /usr/bin/bwrap and the system python3"
    return None


pytestmark = pytest.mark.skipif(_unavailable() is not None, reason=str(_unavailable()))


@pytest.fixture
def base() -> Iterator[Path]:
    path = Path(tempfile.mkdtemp(prefix="cg-dh-", dir="/tmp"))
    path.chmod(0o711)  # the sandbox's uid passes through to its workspace and socket
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


def random_uids(count: int = 64) -> UidRange:
    """A range clear of other tests' (each test daemon takes a random 1024-aligned one)."""
    return UidRange(1_700_000_000 + secrets.randbelow(50_000) * 1024, count)


def random_prefix() -> str:
    return f"cgd{secrets.token_hex(4)}-"


def workspace(home: Path) -> tuple[Path, Path]:
    """A workspace with a note, and the sandboxed POLICY, under ``home``."""
    home.mkdir(parents=True, exist_ok=True)
    home.chmod(0o711)
    ws = home / "ws"
    ws.mkdir(exist_ok=True)
    (ws / "notes.md").write_text("hello\n")
    policy = home / "policy.yaml"
    policy.write_text(textwrap.dedent(POLICY))
    return ws, policy


class Holder:
    """The first daemon: a live `gatewayd serve` with one live sandboxed run."""

    def __init__(self, home: Path, *options: str) -> None:
        self.home = home
        ws, policy = workspace(home)
        self.daemon = start_daemon(home / "state", *options, sandbox=True, random_ids=False)
        self.run_id: str = self.daemon.create_run(ws, policy)["runId"]

    @property
    def state(self) -> Path:
        return self.daemon.state

    @property
    def run_dir(self) -> Path:
        return self.state / "runs" / self.run_id

    def netns(self) -> Path:
        """The run's pinned namespace, whatever its prefix: the one name ending in the id."""
        [found] = [p for p in NETNS_RUN_DIR.iterdir() if p.name.endswith(self.run_id)]
        return found

    def call_from_inside(self) -> dict[str, object]:
        """A new command in the run's sandbox (it joins the run's pinned namespace) that
        makes a gateway call; its result."""
        status, answer = self.daemon.control(
            "POST",
            f"/v1/runs/{self.run_id}/exec",
            {"command": ["cogni-tool", "exec", "fs.read", '{"path": "notes.md"}']},
        )
        assert status == 200, answer
        result: dict[str, object] = answer["result"]
        return result

    def assert_whole(self, netns: Path) -> None:
        """The run, its directory, lease and namespace are as they were, and it works."""
        assert self.daemon.alive()
        assert self.run_dir.is_dir() and (self.run_dir / "lease.json").is_file()
        assert netns.exists() and self.netns() == netns
        result = self.call_from_inside()
        assert result["exitCode"] == 0, result
        assert "hello" in str(result["stdout"]), result


@pytest.fixture
def holder(base: Path) -> Iterator[Holder]:
    first = Holder(base / "a")
    try:
        yield first
    finally:
        first.daemon.stop()


@pytest.fixture
def explicit_holder(base: Path) -> Iterator[tuple[Holder, str, UidRange]]:
    """A first daemon with an explicit prefix and uid range."""
    prefix, uids = random_prefix(), random_uids()
    first = Holder(
        base / "a", "--netns-prefix", prefix, "--sandbox-uids", f"{uids.base}+{uids.count}"
    )
    try:
        yield first, prefix, uids
    finally:
        first.daemon.stop()


def one_shot(
    home: Path,
    *options: str,
    command: tuple[str, ...] = ("cogni-tool", "exec", "fs.read", '{"path": "notes.md"}'),
    env: dict[str, str] | None = None,
    timeout: float = ONE_SHOT_WAIT_S,
) -> subprocess.CompletedProcess[str]:
    """`gatewayd run` with its own workspace under ``home``; ``options`` say the rest."""
    ws, policy = workspace(home)
    return subprocess.run(
        [
            GATEWAYD,
            "run",
            *options,
            "--workspace",
            str(ws),
            "--policy",
            str(policy),
            "--",
            *command,
        ],
        capture_output=True,
        text=True,
        timeout=timeout,
        env={**os.environ, "LITELLM_LOCAL_MODEL_COST_MAP": "True", **(env or {})},
    )


def assert_refused(done: subprocess.CompletedProcess[str], first: Holder, *names: str) -> None:
    """Refused with exit 1 and a message naming the live daemon and ``names``."""
    assert done.returncode == 1, done.stdout + done.stderr
    message = done.stderr
    assert "gatewayd: refused to start: another gatewayd is running on this host" in message
    assert f"(pid {first.daemon.proc.pid}, state directory {first.state.resolve()})" in message
    assert "This daemon did not start and touched nothing" in message
    for name in names:
        assert name in message, message
    assert "Traceback" not in message


# --- a second daemon with default settings starts beside the first --------------------


def test_a_second_daemon_with_default_settings_and_its_own_state_dir_leaves_the_first_alone(
    base: Path, holder: Holder
) -> None:
    netns = holder.netns()
    # The case that broke: a one-shot `gatewayd run`, every setting left to its default
    # but the state directory, beside a live `serve` whose settings are default too.
    done = one_shot(base / "b", "--state-dir", str(base / "b" / "state"))
    assert done.returncode == 0, done.stderr
    assert "hello" in done.stdout and "1 calls, 1 allowed" in done.stderr  # its own call
    holder.assert_whole(netns)
    # And a second `serve`, live beside the first the whole time.
    second = Holder(base / "c")
    try:
        assert second.netns() != netns
        holder.assert_whole(netns)
        second.assert_whole(second.netns())
        shares = {s.state_dir: s for s in live_daemons()}
        mine, theirs = shares[holder.state.resolve()], shares[second.state.resolve()]
        assert mine.netns_prefix != theirs.netns_prefix
        assert mine.uids is not None and theirs.uids is not None
        assert not mine.uids.overlaps(theirs.uids)
    finally:
        second.daemon.stop()
    holder.assert_whole(netns)


# --- the same state directory: refused, whatever else differs ---------------------------


@pytest.mark.parametrize("own_audit_and_ids", [False, True], ids=["defaults", "own-audit-and-ids"])
@pytest.mark.parametrize("command", ["run", "serve", "agent run"])
def test_a_second_daemon_on_the_same_state_dir_is_refused_or_serves_through_it_touching_nothing(
    base: Path, holder: Holder, command: str, own_audit_and_ids: bool
) -> None:
    netns = holder.netns()
    lease = (holder.run_dir / "lease.json").read_bytes()
    leased_uid = os.stat(base / "a" / "ws").st_uid
    other_audit = base / "b" / "audit" / "audit.jsonl"
    options = ["--state-dir", str(holder.state)]
    if own_audit_and_ids:
        # Only the state directory is shared: the audit log's lock cannot stop this one,
        # and neither prefix nor uids clash.
        uids = random_uids()
        options += ["--audit", str(other_audit), "--netns-prefix", random_prefix()]
        options += ["--sandbox-uids", f"{uids.base}+{uids.count}"]
    ws, policy = workspace(base / "b")
    if command == "run":
        argv = [GATEWAYD, "run", *options, "--workspace", str(ws), "--policy", str(policy)]
        argv += ["--", "true"]
    elif command == "serve":
        argv = [GATEWAYD, "serve", *options, "--control-socket", str(base / "b" / "c.sock")]
    else:
        argv = [GATEWAYD, "agent", "run", *options, "--repo", f"file://{base}/none.git"]
        argv += ["--sha", "a" * 40, "--task", "anything", "--model", "none"]
    done = subprocess.run(argv, capture_output=True, text=True, timeout=REFUSAL_WAIT_S)
    if command == "run" and not own_audit_and_ids:
        # No second daemon at all: the state directory's own serves the one-shot run
        # (attached, docs/sandbox.md), on its own uid and namespace.
        assert done.returncode == 0, done.stderr
        assert "started" in done.stderr and "ended: exit 0" in done.stderr
    else:
        assert_refused(done, holder, "--state-dir (state_dir)", "is its state directory")
    assert not other_audit.exists() and not (base / "b" / "c.sock").exists()
    assert (holder.run_dir / "lease.json").read_bytes() == lease
    assert os.stat(base / "a" / "ws").st_uid == leased_uid != 0  # still lent
    holder.assert_whole(netns)


def test_a_state_dir_inside_a_live_daemons_is_refused(base: Path, holder: Holder) -> None:
    netns = holder.netns()
    # Inside the first's runs/: its start would sweep, and the first's restart would
    # sweep it.
    nested = holder.state / "runs" / "x"
    done = one_shot(base / "b", "--state-dir", str(nested), "--netns-prefix", random_prefix())
    assert_refused(done, holder, f"overlaps its state directory {holder.state.resolve()}")
    assert not nested.exists()
    holder.assert_whole(netns)


# --- the same explicit prefix, or overlapping uids: refused ---------------------------


@pytest.mark.parametrize("given_by", ["option", "variable", "file"])
def test_a_second_daemon_with_the_same_explicit_prefix_is_refused(
    base: Path, explicit_holder: tuple[Holder, str, UidRange], given_by: str
) -> None:
    first, prefix, _ = explicit_holder
    netns = first.netns()
    assert netns.name == prefix + first.run_id
    uids = random_uids()
    options = ["--state-dir", str(base / "b" / "state"), "--sandbox-uids", f"{uids.base}+64"]
    env: dict[str, str] = {}
    if given_by == "option":
        options += ["--netns-prefix", prefix]
    elif given_by == "variable":
        env["GATEWAYD_NETNS_PREFIX"] = prefix
    else:
        (base / "b").mkdir(parents=True, exist_ok=True)
        config = base / "b" / "gatewayd.yaml"
        config.write_text(f"netns_prefix: {prefix}\n")
        options += ["--config", str(config)]
    done = one_shot(base / "b", *options, env=env, timeout=REFUSAL_WAIT_S)
    assert_refused(
        done, first, f"both use the network-namespace prefix {prefix!r}", "--netns-prefix"
    )
    assert not (base / "b" / "state").exists()
    first.assert_whole(netns)


@pytest.mark.parametrize(
    ("offset", "count"),
    [(0, 64), (16, 16), (-32, 64), (32, 64), (-64, 256), (63, 1), (-8, 9)],
    ids=["same", "inside", "straddling-below", "straddling-above", "around", "last", "first"],
)
def test_a_second_daemon_whose_uids_overlap_is_refused(
    base: Path, explicit_holder: tuple[Holder, str, UidRange], offset: int, count: int
) -> None:
    first, _, uids = explicit_holder
    netns = first.netns()
    theirs = UidRange(uids.base + offset, count)
    done = one_shot(
        base / "b",
        "--state-dir",
        str(base / "b" / "state"),
        "--netns-prefix",
        random_prefix(),
        "--sandbox-uids",
        f"{theirs.base}+{theirs.count}",
        timeout=REFUSAL_WAIT_S,
    )
    assert_refused(
        done,
        first,
        f"this daemon's sandbox uids {theirs.describe()} overlap its {uids.describe()}",
        "--sandbox-uids (sandbox_uids)",
    )
    first.assert_whole(netns)


@pytest.mark.parametrize("side", ["below", "above"])
def test_an_adjacent_uid_range_is_not_an_overlap(
    base: Path, explicit_holder: tuple[Holder, str, UidRange], side: str
) -> None:
    first, _, uids = explicit_holder
    netns = first.netns()
    theirs = UidRange(uids.base - 8, 8) if side == "below" else UidRange(uids.base + 64, 8)
    done = one_shot(
        base / "b",
        "--state-dir",
        str(base / "b" / "state"),
        "--netns-prefix",
        random_prefix(),
        "--sandbox-uids",
        f"{theirs.base}+{theirs.count}",
    )
    assert done.returncode == 0, done.stderr
    first.assert_whole(netns)


# --- a dead daemon's entry ---------------------------------------------------------------


def _entry_of(daemon: LiveDaemon) -> Path:
    """The registry file of the live ``daemon`` (by its pid and state directory)."""
    found = []
    for path in DAEMONS_DIR.glob("*.json"):
        with open(path, "rb") as entry:
            data = json.load(entry)
        if data["pid"] == daemon.proc.pid and data["stateDir"] == str(daemon.state.resolve()):
            found.append(path)
    [path] = found
    return path


def test_a_daemon_killed_with_sigkill_does_not_block_the_next_start_and_its_entry_goes(
    base: Path,
) -> None:
    prefix, uids = random_prefix(), random_uids()
    options = ("--netns-prefix", prefix, "--sandbox-uids", f"{uids.base}+{uids.count}")
    first = Holder(base / "a", *options)
    killed_pid = first.daemon.proc.pid
    try:
        entry = _entry_of(first.daemon)
        first.daemon.proc.send_signal(signal.SIGKILL)
        first.daemon.proc.wait()
    finally:
        first.daemon.stop()
    assert entry.exists()  # left behind, but nobody holds its lock any more
    with open(entry, "rb") as left:
        fcntl.flock(left, fcntl.LOCK_EX | fcntl.LOCK_NB)
    # The same state directory, prefix and uids: all the dead daemon's, all free again.
    second = start_daemon(first.state, *options, sandbox=True, random_ids=False)
    try:
        assert not entry.exists()
        assert _entry_of(second).exists()
        assert not first.run_dir.exists()  # and its start swept the dead one's run
        lines = second.log_path.read_text().splitlines()
        logged = [json.loads(line) for line in lines if line.startswith("{")]
        notes = [line for line in logged if line.get("event") == "dead_daemons_unregistered"]
        # Any daemon's start sweeps the host's dead entries: another test's daemon,
        # started meanwhile, may have been the one (its log says so); else this one.
        assert len(notes) <= 1, notes
        for note in notes:
            assert [d["pid"] for d in note["daemons"]] == [killed_pid]
        assert killed_pid not in {s.pid for s in live_daemons()}
    finally:
        second.stop()
    # A clean stop takes its entry away.
    assert second.proc.pid not in {s.pid for s in live_daemons()}
    assert not any(
        json.loads(p.read_text())["pid"] == second.proc.pid for p in DAEMONS_DIR.glob("*.json")
    )


# --- two starts at once ------------------------------------------------------------------


def test_of_daemons_started_at_once_on_one_state_dir_exactly_one_runs(base: Path) -> None:
    state = base / "state"
    starts = [
        subprocess.Popen(
            [GATEWAYD, "serve", "--no-os-sandbox", "--state-dir", str(state)],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            text=True,
        )
        for _ in range(3)
    ]
    try:
        deadline = time.monotonic() + REFUSAL_WAIT_S  # a bound on the test, not a figure
        while sum(proc.poll() is not None for proc in starts) < 2:
            assert time.monotonic() < deadline, "fewer than two of three starts were refused"
            time.sleep(0.05)
        [serving] = [proc for proc in starts if proc.poll() is None]
        for proc in starts:
            if proc is not serving:
                err = proc.communicate()[1]
                assert proc.returncode == 1, err
                assert "refused to start: another gatewayd is running on this host" in err
                assert f"(pid {serving.pid}, state directory {state})" in err
                assert f"is its state directory {state}" in err
    finally:
        for proc in starts:
            proc.send_signal(signal.SIGTERM)
            proc.communicate(timeout=30)
    assert serving.returncode == 0


# --- in-process daemons -----------------------------------------------------------------


async def test_an_in_process_daemon_on_a_live_ones_state_dir_raises_before_opening_anything(
    base: Path,
) -> None:
    """Daemons of one process register like any others; a daemon without the OS sandbox
    still registers its state directory (its start sweeps run directories there)."""
    first = GatewaydConfig(state_dir=base / "state", policy_dirs=(base,), os_sandbox=False)
    other_audit = base / "other" / "audit.jsonl"
    second = GatewaydConfig(
        state_dir=base / "state", audit_path=other_audit, policy_dirs=(base,), os_sandbox=False
    )
    async with open_daemon(first, preload=True) as daemon:
        with pytest.raises(DaemonClash) as refused:
            async with open_daemon(second, preload=True):
                pass
        assert refused.value.other.pid == os.getpid()
        assert "--state-dir (state_dir)" in str(refused.value)
        assert not other_audit.exists()
        assert daemon.config.state_dir.is_dir()
    # Once the first has ended, the same state directory is free.
    async with open_daemon(second, preload=True):
        assert other_audit.exists()


# --- the registry refuses what it cannot trust -------------------------------------------


def share(base: Path, name: str = "state") -> DaemonShare:
    return DaemonShare(
        state_dir=base / name,
        agent_dir=base / f"{name}-agent",
        netns_prefix=random_prefix(),
        uids=random_uids(),
    )


def test_a_registry_others_could_write_is_refused(base: Path) -> None:
    registry = base / "registry" / "daemons"
    registry.parent.mkdir()
    registry.mkdir(mode=0o700)
    registry.chmod(0o733)
    with pytest.raises(DaemonRegistryError, match=r"writable by its group or others") as caught:
        register_daemon(share(base), directory=registry)
    assert f"`chmod go-w {registry}`" in str(caught.value)
    registry.chmod(0o700)
    registry.parent.chmod(0o777)  # the directory holding it, too: it could be swapped
    with pytest.raises(DaemonRegistryError, match=r"mode 0777"):
        register_daemon(share(base), directory=registry)
    registry.parent.chmod(0o755)
    os.chown(registry, 65534, 65534)
    with pytest.raises(DaemonRegistryError, match=r"belongs to uid 65534") as caught:
        register_daemon(share(base), directory=registry)
    assert f"`chown root:root {registry}`" in str(caught.value)
    assert list(registry.iterdir()) == []  # no entry was made in any of them


def test_a_registry_that_is_a_symlink_is_refused(base: Path) -> None:
    real = base / "real"
    real.mkdir(mode=0o700)
    (base / "registry").mkdir()
    (base / "registry" / "daemons").symlink_to(real)
    link = base / "registry" / "daemons"
    with pytest.raises(DaemonRegistryError, match=r"is a symbolic link") as caught:
        register_daemon(share(base), directory=link)
    assert f"remove {link} (gatewayd makes it again)" in str(caught.value)
    assert list(real.iterdir()) == []
    link.unlink()
    link.write_text("")
    with pytest.raises(DaemonRegistryError, match=r"is not a directory"):
        register_daemon(share(base), directory=link)


def test_a_live_entry_that_cannot_be_read_refuses_the_start(base: Path) -> None:
    registry = base / "registry" / "daemons"
    held = register_daemon(share(base, "first"), directory=registry)
    garbage = registry / "999-0badc0de.json"
    garbage.write_text('{"pid": "not a number"')
    with open(garbage, "rb") as locked:
        fcntl.flock(locked, fcntl.LOCK_EX)  # as a live daemon would hold it
        with pytest.raises(DaemonRegistryError, match=r"cannot read") as caught:
            register_daemon(share(base, "second"), directory=registry)
        assert str(garbage) in str(caught.value) and "`fuser -v" in str(caught.value)
    # Nobody holds it now: stale, removed, and the start goes on.
    second = register_daemon(share(base, "second"), directory=registry)
    assert not garbage.exists()
    assert sorted(p.name for p in registry.iterdir()) == sorted([held.path.name, second.path.name])
    second.release()
    held.release()
    held.release()  # idempotent
    assert list(registry.iterdir()) == []


def test_a_start_stuck_holding_the_registry_is_named_after_the_timeout(base: Path) -> None:
    registry = base / "registry" / "daemons"
    register_daemon(share(base, "first"), directory=registry).release()
    stuck = os.open(registry, os.O_RDONLY | os.O_DIRECTORY)
    try:
        fcntl.flock(stuck, fcntl.LOCK_EX)
        with pytest.raises(DaemonRegistryError, match=r"held the registry") as caught:
            register_daemon(share(base), directory=registry, lock_timeout_s=0.05)
        assert "for over 0.05 s" in str(caught.value)
        assert f"`fuser -v {registry}`" in str(caught.value)
    finally:
        os.close(stuck)
    assert list(registry.iterdir()) == []


def test_a_daemon_that_cannot_use_the_registry_does_not_start(base: Path) -> None:
    if shutil.which("setpriv") is None:
        pytest.skip("setpriv (util-linux) is needed to act as an unprivileged user")
    register_daemon(share(base), directory=DAEMONS_DIR).release()  # it exists, root's
    base.chmod(0o755)
    ws, policy = workspace(base / "b")
    policy.write_text(textwrap.dedent(POLICY) + "require_os_sandbox: false\n")
    argv = ["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups", GATEWAYD, "run"]
    argv += ["--no-os-sandbox", "--state-dir", str(base / "b" / "state")]
    argv += ["--workspace", str(ws), "--policy", str(policy), "--", "true"]
    done = subprocess.run(
        argv,
        capture_output=True,
        text=True,
        timeout=REFUSAL_WAIT_S,
        env={**os.environ, "LITELLM_LOCAL_MODEL_COST_MAP": "True"},
    )
    assert done.returncode == 1, done.stderr
    assert (
        f"gatewayd: refused to start: the host's registry of gatewayd daemons ({DAEMONS_DIR}) "
        "cannot be opened: Permission denied"
    ) in done.stderr
    assert "run gatewayd as root or with the systemd unit's capabilities" in done.stderr
    assert not (base / "b" / "state").exists()


@pytest.mark.parametrize("link", ["same path", "hard link"])
def test_a_second_daemon_on_a_live_daemons_audit_log_is_refused_without_a_traceback(
    base: Path, link: str
) -> None:
    """By the registry, naming the setting; a hard link (another name, the same file)
    the registry cannot see through is refused by the log's own lock."""
    audit = base / "shared-audit.jsonl"
    (base / "a").mkdir()
    first = start_daemon(base / "a" / "state", "--audit", str(audit))
    try:
        given = audit
        if link == "hard link":
            given = base / "another-name.jsonl"
            os.link(audit, given)
        (base / "ws").mkdir()
        options = ["--state-dir", str(base / "b" / "state"), "--audit", str(given)]
        options += ["--policy", "demo", "--workspace", str(base / "ws")]
        second = subprocess.run(
            [GATEWAYD, "run", "--no-os-sandbox", *options, "--", "true"],
            capture_output=True,
            text=True,
            timeout=REFUSAL_WAIT_S,
        )
        assert second.returncode == 1, second.stderr
        if link == "same path":
            assert second.stderr.startswith(
                "gatewayd: refused to start: another gatewayd is running on this host"
            )
            assert f"this daemon's audit log {audit} is its audit log" in second.stderr
            assert "give this daemon another --audit (audit_path)" in second.stderr
        else:
            assert second.stderr.startswith("gatewayd: refused to start: audit log ")
            assert "is locked by another process (another gatewayd?)" in second.stderr
        assert "Traceback" not in second.stderr
        assert first.control("GET", "/v1/health")[0] == 200
    finally:
        first.stop()


def test_a_workspace_another_daemons_live_run_holds_is_not_lent_again(
    base: Path, holder: Holder
) -> None:
    netns = holder.netns()
    lease = json.loads((holder.run_dir / "lease.json").read_text())
    ws = holder.home / "ws"
    # Another daemon (its own state directory, prefix and uids) asked for the same tree:
    # lending it would record the first run's uid as the owner to give it back to.
    done = one_shot(holder.home, "--state-dir", str(base / "b" / "state"))
    assert done.returncode == 1, done.stderr
    assert f"is owned by sandbox uid {lease['uid']}: another live run holds it" in done.stderr
    assert os.stat(ws).st_uid == lease["uid"]
    assert os.stat(ws / "notes.md").st_uid == lease["uid"]
    holder.assert_whole(netns)


# --- a live daemon's control socket and audit log are its alone ----------------------------

# Small enough that the first daemon's log has rotated once it serves (a closed segment).
SMALL_AUDIT_BYTES = "600"


@pytest.fixture(scope="module")
def serving() -> Iterator[LiveDaemon]:
    """A live `gatewayd serve` whose audit log has a closed segment and a head file,
    started once for the tests that start a second daemon beside it: each of those is
    refused having touched nothing (each test checks the first's log files, socket and
    health), so the next test finds the first as it was."""
    home = Path(tempfile.mkdtemp(prefix="cg-dh-", dir="/tmp"))
    home.chmod(0o711)
    (home / "a").mkdir()
    first = start_daemon(home / "a" / "state", "--audit-max-bytes", SMALL_AUDIT_BYTES)
    try:
        yield first
    finally:
        first.stop()
        shutil.rmtree(home, ignore_errors=True)


def log_files(daemon: LiveDaemon) -> dict[str, bytes]:
    """Every file of ``daemon``'s audit log (active, head, closed segments, and the
    files of its Merkle tree's directory): contents."""
    directory = daemon.audit_path.parent
    return {
        str(p.relative_to(directory)): p.read_bytes()
        for p in sorted(directory.rglob("*"))
        if p.is_file()
    }


def serve_beside(
    base: Path, *options: str, cwd: Path | None = None
) -> subprocess.CompletedProcess[str]:
    """A second `gatewayd serve` on ``base/b/state``, given ``options``; one that is not
    refused serves until the wait runs out (which fails the test)."""
    return subprocess.run(
        [GATEWAYD, "serve", "--no-os-sandbox", "--state-dir", str(base / "b" / "state"), *options],
        capture_output=True,
        text=True,
        timeout=REFUSAL_WAIT_S,
        cwd=cwd,
        env={**os.environ, "LITELLM_LOCAL_MODEL_COST_MAP": "True"},
    )


def assert_refused_beside(
    done: subprocess.CompletedProcess[str], base: Path, first: LiveDaemon, *phrases: str
) -> None:
    """Refused by the registry, naming ``first`` and ``phrases``, having touched nothing
    (its state directory, ``serve_beside``'s under ``base``, was not made)."""
    assert done.returncode == 1, done.stdout + done.stderr
    message = done.stderr
    assert "gatewayd: refused to start: another gatewayd is running on this host" in message
    assert f"(pid {first.proc.pid}, state directory {first.state.resolve()})" in message
    for phrase in phrases:
        assert phrase in message, message
    assert "This daemon did not start and touched nothing" in message
    assert "Traceback" not in message
    assert not (base / "b" / "state").exists()


def named(base: Path, target: Path, way: str) -> tuple[str, Path | None]:
    """``target`` as an operator might give it: (the option's text, the cwd it needs)."""
    if way == "as given":
        return str(target), None
    if way == "through a symlink":
        link = base / "link"
        link.symlink_to(target)
        return str(link), None
    if way == "through a symlinked directory":
        alias = base / "alias"
        alias.symlink_to(target.parent)
        return str(alias / target.name), None
    cwd = base / "b"  # relative, with a detour
    cwd.mkdir(exist_ok=True)
    return os.path.join("..", "b", os.path.relpath(target, cwd)), cwd


WAYS = ["as given", "through a symlink", "through a symlinked directory", "relative with .."]


@pytest.mark.parametrize("way", WAYS)
def test_a_second_daemon_on_a_live_daemons_control_socket_is_refused_whatever_the_path(
    base: Path, serving: LiveDaemon, way: str
) -> None:
    """It would have taken the socket (its operators' requests) and removed it when it
    stopped, leaving the first daemon unreachable."""
    socket_path = serving.control_socket
    before = os.stat(socket_path)
    given, cwd = named(base, socket_path, way)
    done = serve_beside(base, "--control-socket", given, cwd=cwd)
    assert_refused_beside(
        done,
        base,
        serving,
        f"this daemon's control socket {socket_path.resolve()} is its control socket",
        "give this daemon another --control-socket (control_socket)",
    )
    assert os.stat(socket_path).st_ino == before.st_ino
    assert serving.control("GET", "/v1/health")[0] == 200


def _segment(daemon: LiveDaemon) -> Path:
    return daemon.audit_path.with_name(daemon.audit_path.name + ".000001")


@pytest.mark.parametrize(
    ("option", "target", "way", "says"),
    [
        ("--control-socket", "active", "as given", "which the socket would replace"),
        ("--control-socket", "segment", "through a symlink", "which the socket would replace"),
        ("--control-socket", "head", "relative with ..", "which the socket would replace"),
        ("--audit", "active", "through a symlinked directory", "or shares a file with it"),
        ("--audit", "segment", "as given", "or shares a file with it"),
        ("--audit", "head", "through a symlink", "or shares a file with it"),
        ("--audit", "socket", "relative with ..", "would be written at its control socket"),
    ],
)
def test_a_second_daemon_may_not_use_a_file_of_a_live_daemons_audit_log(
    base: Path, serving: LiveDaemon, option: str, target: str, way: str, says: str
) -> None:
    """Neither as its control socket (bound there, it would replace the log's file) nor
    as its own audit log (it would write into the closed segment, which no lock
    guards), nor an audit log at the live daemon's control socket."""
    files = {
        "active": serving.audit_path,
        "segment": _segment(serving),
        "head": serving.audit_path.with_name(serving.audit_path.name + ".head"),
        "socket": serving.control_socket,
    }
    assert files["segment"].is_file() and files["head"].is_file()  # the log has rotated
    before = log_files(serving)
    given, cwd = named(base, files[target], way)
    done = serve_beside(base, option, given, cwd=cwd)
    setting = "--audit (audit_path)" if option == "--audit" else "--control-socket (control_socket)"
    assert_refused_beside(done, base, serving, says, f"give this daemon another {setting}")
    assert log_files(serving) == before
    assert serving.control("GET", "/v1/health")[0] == 200


def test_a_state_dir_whose_runs_hold_a_live_daemons_audit_log_is_refused(base: Path) -> None:
    """A start removes the directories in its state directory's runs/: there, another
    daemon's audit log (or control socket) would go with them."""
    audit = base / "b" / "state" / "runs" / "x" / "audit.jsonl"
    (base / "a").mkdir()
    first = start_daemon(base / "a" / "state", "--audit", str(audit))
    try:
        before = audit.read_bytes()
        done = serve_beside(base, "--control-socket", str(base / "b.sock"))
        assert done.returncode == 1, done.stdout + done.stderr
        assert f"its audit log {audit} lies in a directory of this daemon's" in done.stderr
        assert "give this daemon another --state-dir (state_dir)" in done.stderr
        assert audit.read_bytes() == before
        assert not (base / "b.sock").exists()
        assert first.control("GET", "/v1/health")[0] == 200
    finally:
        first.stop()


@pytest.mark.parametrize("held_by", ["a listener", "a regular file", "a directory"])
def test_a_control_socket_path_something_else_holds_is_neither_taken_nor_removed(
    base: Path, held_by: str
) -> None:
    """No daemon registered there: the socket is asked whether something listens, and
    anything but a socket nobody listens on is left alone. Such a stale socket (a
    crashed daemon's) is still replaced."""
    path = base / "control.sock"
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        if held_by == "a listener":
            listener.bind(str(path))
            listener.listen()
            says = f"something listens on the control socket {path}"
        elif held_by == "a regular file":
            path.write_text("an operator's file\n")
            says = f"the control socket path {path} is a regular file, not a socket"
        else:
            path.mkdir()
            says = f"the control socket path {path} is a directory, not a socket"
        done = serve_beside(base, "--control-socket", str(path))
        assert done.returncode == 1, done.stdout + done.stderr
        assert done.stderr.startswith(f"gatewayd: refused to start: {says}"), done.stderr
        assert "give this daemon another --control-socket (control_socket)" in done.stderr
        assert "Traceback" not in done.stderr
        if held_by == "a listener":
            with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as client:
                client.connect(str(path))  # still the listener's
        elif held_by == "a regular file":
            assert path.read_text() == "an operator's file\n"
        else:
            assert path.is_dir()
    finally:
        listener.close()
    # A socket nobody listens on: replaced, served, and removed at a clean stop.
    stale = base / "c" / "state" / "control.sock"
    stale.parent.mkdir(parents=True)
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as dead:
        dead.bind(str(stale))
    daemon = start_daemon(stale.parent)
    assert daemon.stop() == 0
    assert not stale.exists()


async def test_a_control_socket_replaced_under_a_daemon_is_not_removed_at_its_stop(
    base: Path,
) -> None:
    """A stop removes the path only while it is still the socket this daemon bound."""
    config = GatewaydConfig(state_dir=base / "state", policy_dirs=(base,), os_sandbox=False)
    path = base / "control.sock"
    async with open_daemon(
        config, preload=True, control_socket=path
    ):  # serves it, as `gatewayd serve`
        path.rename(base / "moved.sock")
        path.write_text("put here since\n")
    assert path.read_text() == "put here since\n"
