"""gatewayd under systemd: the readiness protocol against a real `gatewayd serve` and a
notify socket the test binds (as systemd does), and the unit files checked by
`systemd-analyze verify`. This machine's PID 1 is not systemd, so the unit itself is
not started here."""

from __future__ import annotations

import os
import re
import shlex
import shutil
import signal
import socket
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from gatewayd.sandbox.support import REQUIRED_CAPABILITIES, missing_capabilities
from gatewayd.sdnotify import notify
from tests.livedaemon import BIN

ROOT = Path(__file__).resolve().parents[2]
UNIT = ROOT / "systemd" / "gatewayd.service"
SOCKET_UNIT = ROOT / "systemd" / "gatewayd.socket"


@pytest.fixture
def notify_socket(short_tmp: Path) -> Iterator[socket.socket]:
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    sock.bind(str(short_tmp / "notify"))
    sock.settimeout(30)
    try:
        yield sock
    finally:
        sock.close()


def test_serve_says_ready_once_its_control_socket_answers_and_stopping_on_sigterm(
    short_tmp: Path, notify_socket: socket.socket
) -> None:
    state = short_tmp / "state"
    env = {**os.environ, "NOTIFY_SOCKET": notify_socket.getsockname()}
    proc = subprocess.Popen(
        [str(BIN / "gatewayd"), "serve", "--state-dir", str(state), "--no-os-sandbox"],
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
    )
    try:
        ready = notify_socket.recv(4096).decode()
        assert ready.splitlines()[0] == "READY=1"
        assert f"STATUS=serving; control socket {state / 'control.sock'}" in ready
        # Ready means ready: the control socket accepts at once.
        with socket.socket(socket.AF_UNIX) as client:
            client.connect(str(state / "control.sock"))
        proc.send_signal(signal.SIGTERM)
        assert notify_socket.recv(4096).decode().splitlines()[0] == "STOPPING=1"
        assert proc.wait(timeout=30) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_notify_is_a_no_op_without_systemd_and_says_why_a_bad_socket_fails(
    short_tmp: Path, notify_socket: socket.socket
) -> None:
    assert notify("READY=1", environ={}) is False
    assert notify("READY=1", environ={"NOTIFY_SOCKET": "relative/path"}) is False
    assert notify("READY=1", environ={"NOTIFY_SOCKET": str(short_tmp / "nobody")}) is False
    assert notify("X=1", environ={"NOTIFY_SOCKET": notify_socket.getsockname()}) is True
    assert notify_socket.recv(64) == b"X=1"


def test_notify_reaches_an_abstract_socket(short_tmp: Path) -> None:
    name = f"cogni-test-{os.getpid()}"
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as sock:
        sock.bind("\0" + name)
        assert notify("READY=1", environ={"NOTIFY_SOCKET": "@" + name}) is True
        assert sock.recv(64) == b"READY=1"


@pytest.mark.skipif(shutil.which("systemd-analyze") is None, reason="needs systemd-analyze")
def test_the_unit_passes_systemd_analyze_verify(short_tmp: Path) -> None:
    # verify checks that ExecStart's program exists: point it at this checkout's.
    unit = short_tmp / "gatewayd.service"
    unit.write_text(UNIT.read_text().replace("/opt/gatewayd/venv/bin/", f"{BIN}/"))
    # The service requires its socket unit: verified together, from one directory.
    socket_unit = short_tmp / "gatewayd.socket"
    socket_unit.write_text(SOCKET_UNIT.read_text())
    done = subprocess.run(
        ["systemd-analyze", "verify", "--man=no", str(unit), str(socket_unit)],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    assert "gatewayd.service" not in done.stderr, done.stderr  # no warning about it


# The program the installed unit names, as `make install` puts it: in a virtualenv of
# the system python3 under /opt (the checkout's own .venv may be one the unit's service
# cannot run: its interpreter under /root, say; install-systemd refuses that).
PROGRAM = "/opt/gatewayd/venv/bin/gatewayd"


def stage_program(root: Path) -> None:
    """A stand-in of `make install`'s virtualenv under ``root``: its gatewayd script
    names its bin/python, which links to this host's /usr/bin/python3."""
    program = root / PROGRAM.lstrip("/")
    program.parent.mkdir(parents=True, exist_ok=True)
    program.write_text("#!/opt/gatewayd/venv/bin/python\n")
    program.chmod(0o755)
    python = program.with_name("python")
    if not python.is_symlink():
        python.symlink_to("/usr/bin/python3")


# systemd-analyze security calls an exposure below 5.0 "OK"; the unit must stay there.
EXPOSURE_LIMIT = 5.0


@pytest.mark.skipif(shutil.which("systemd-analyze") is None, reason="needs systemd-analyze")
def test_the_units_exposure_is_below_five(short_tmp: Path) -> None:
    # Offline, from the file; tests/integration/test_systemd_e2e.py asserts the same of
    # the running unit under a real systemd.
    unit = short_tmp / "gatewayd.service"
    unit.write_text(UNIT.read_text().replace("/opt/gatewayd/venv/bin/", f"{BIN}/"))
    (short_tmp / "gatewayd.socket").write_text(SOCKET_UNIT.read_text())
    done = subprocess.run(
        ["systemd-analyze", "security", "--offline=yes", "--no-pager", str(unit)],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    match = re.search(r"Overall exposure level for gatewayd.service: (\d+\.\d+)", done.stdout)
    assert match, done.stdout + done.stderr
    print(f"systemd-analyze security (offline): {match.group(1)}")
    assert float(match.group(1)) < EXPOSURE_LIMIT, done.stdout


def install(root: Path, *extra: str) -> subprocess.CompletedProcess[str]:
    stage_program(root)
    return subprocess.run(
        [
            str(BIN / "gatewayd"),
            "install-systemd",
            "--root",
            str(root),
            "--program",
            PROGRAM,
            *extra,
        ],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )


def test_install_systemd_writes_a_unit_for_this_installation_idempotently(
    short_tmp: Path,
) -> None:
    root = short_tmp / "root"
    first = install(root)
    assert first.returncode == 0, first.stderr
    unit = root / "etc/systemd/system/gatewayd.service"
    config = root / "etc/gatewayd/gatewayd.yaml"
    assert f"ExecStart={PROGRAM} serve" in unit.read_text()
    assert oct(unit.stat().st_mode & 0o777) == "0o644"
    assert oct(config.stat().st_mode & 0o777) == "0o640"
    assert (root / "etc/gatewayd/policies").is_dir()
    sysusers = root / "etc/sysusers.d/gatewayd.conf"
    assert sysusers.read_text().splitlines()[-1].startswith("u gatewayd - ")
    assert f"systemd-sysusers {sysusers}" in first.stdout
    if shutil.which("systemd-sysusers"):  # the file is one systemd-sysusers takes
        dry = subprocess.run(
            ["systemd-sysusers", "--dry-run", str(sysusers)],
            capture_output=True,
            text=True,
            timeout=60,
            check=False,
        )
        assert dry.returncode == 0, dry.stderr
    assert "systemctl enable --now gatewayd" in first.stdout
    if shutil.which("systemd-analyze"):
        # verify looks for ExecStart's program on this host: a copy names the staged one.
        copies = short_tmp / "verify"
        copies.mkdir()
        staged = (copies / unit.name, copies / "gatewayd.socket")
        staged[0].write_text(unit.read_text().replace(PROGRAM, str(root / PROGRAM.lstrip("/"))))
        staged[1].write_text((unit.parent / "gatewayd.socket").read_text())
        verified = subprocess.run(
            ["systemd-analyze", "verify", "--man=no", *map(str, staged)],
            capture_output=True,
            text=True,
            timeout=60,
            check=False,
        )
        assert verified.returncode == 0, verified.stderr
    # The installed starting configuration is one gatewayd accepts.
    from gatewayd.configsources import load_config

    assert load_config(config).models == {}
    # Again: nothing changes, the operator's configuration is kept.
    config.write_text("models: {}\n# mine\n")
    again = install(root)
    assert again.returncode == 0
    assert f"unchanged  {unit}" in again.stdout and f"kept  {config}" in again.stdout
    assert config.read_text() == "models: {}\n# mine\n"


def test_install_systemd_does_not_overwrite_a_changed_unit_without_force(
    short_tmp: Path,
) -> None:
    root = short_tmp / "root"
    assert install(root).returncode == 0
    unit = root / "etc/systemd/system/gatewayd.service"
    unit.write_text(unit.read_text() + "# a local change\n")
    refused = install(root)
    assert refused.returncode == 1
    assert "differs from this version's unit" in refused.stderr and "--force" in refused.stderr
    assert unit.read_text().endswith("# a local change\n")
    forced = install(root, "--force")
    assert forced.returncode == 0 and "# a local change" not in unit.read_text()


def test_install_systemd_refuses_a_program_systemd_could_not_run(short_tmp: Path) -> None:
    from gatewayd.install import InstallError, install_systemd

    plain = short_tmp / "not-executable"
    plain.write_text("")
    with pytest.raises(InstallError, match="is not an executable gatewayd program"):
        install_systemd(short_tmp / "root", program=plain)
    spaced = short_tmp / "with space"
    spaced.mkdir()
    (spaced / "gatewayd").write_text("#!/bin/sh\n")
    (spaced / "gatewayd").chmod(0o755)
    with pytest.raises(InstallError, match="white space"):
        install_systemd(short_tmp / "root", program=spaced / "gatewayd")
    assert not (short_tmp / "root").exists()  # nothing written


# --- gatewayd as a system user with ambient capabilities ----------------------------------

CAPSH = shutil.which("capsh")
AMBIENT = ",".join(name.lower() for name in REQUIRED_CAPABILITIES)


def _cannot_run_unprivileged() -> str | None:
    if os.geteuid() != 0 or CAPSH is None or not os.path.exists("/usr/bin/bwrap"):
        return "needs root, capsh (libcap2-bin) and bubblewrap"
    missing = missing_capabilities()
    if missing:
        return f"this machine's bounding set lacks {', '.join(missing)}"
    return None


def as_system_user(uid: int, command: str, caps: str = AMBIENT) -> subprocess.CompletedProcess[str]:
    """``command`` (a shell line) as ``uid``, not root, holding ``caps`` as ambient
    capabilities: what systemd's User= with AmbientCapabilities= gives gatewayd."""
    return subprocess.run(
        [CAPSH or "capsh", f"--inh={caps}", "--keep=1", f"--gid={uid}", "--groups=",
         f"--uid={uid}", f"--addamb={caps}", "--", "-c", command],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
        env={**os.environ, "LITELLM_LOCAL_MODEL_COST_MAP": "True"},
    )  # fmt: skip


@pytest.mark.skipif(_cannot_run_unprivileged() is not None, reason=str(_cannot_run_unprivileged()))
def test_a_non_root_gatewayd_with_ambient_capabilities_runs_sandboxes_that_hold_none(
    short_tmp: Path,
) -> None:
    uid = 1_990_000_000 + os.getpid() % 10_000
    short_tmp.chmod(0o711)
    state, ws = short_tmp / "state", short_tmp / "ws"
    state.mkdir()
    os.chown(state, uid, uid)
    state.chmod(0o711)
    ws.mkdir()
    (ws / "notes.md").write_text("hi\n")
    inside = (
        "grep -E '^Cap(Inh|Prm|Eff|Bnd|Amb)' /proc/self/status; "
        'cogni-tool exec fs.read \'{"path": "notes.md"}\' && '
        "mkdir -m 700 /workspace/kept && echo s > /workspace/kept/f && chmod 500 /workspace/kept"
    )
    command = (
        f"id -u; {BIN / 'gatewayd'} run --state-dir {state} --netns-prefix cgu{os.getpid()}- "
        f"--sandbox-uids {uid + 100}+16 --policy {ROOT / 'policies/examples/demo.yaml'} "
        # Mode host: what the run made is looked for (and its owner) in the workspace.
        f"--workspace {ws} --workspace-mode host -- sh -c {shlex.quote(inside)}"
    )
    done = as_system_user(uid, command)
    assert done.returncode == 0, done.stdout + done.stderr
    lines = done.stdout.splitlines()
    assert lines[0] == str(uid)  # gatewayd itself is not root
    caps = {line.split(":")[0]: line.split()[1] for line in lines if line.startswith("Cap")}
    assert caps == dict.fromkeys(("CapInh", "CapPrm", "CapEff", "CapBnd", "CapAmb"), "0" * 16)
    assert '"content": "hi\\n"' in done.stdout  # the gateway served the sandbox's call
    # The lease was given back: what the run's uid made is the workspace owner's again.
    assert (ws / "kept").stat().st_uid == ws.stat().st_uid == 0
    assert (state / "audit" / "audit.jsonl").stat().st_uid == uid


@pytest.mark.skipif(_cannot_run_unprivileged() is not None, reason=str(_cannot_run_unprivileged()))
def test_a_gatewayd_missing_a_capability_says_which_and_runs_nothing(short_tmp: Path) -> None:
    uid = 1_990_010_000 + os.getpid() % 10_000
    short_tmp.chmod(0o711)
    state, ws = short_tmp / "state", short_tmp / "ws"
    state.mkdir()
    os.chown(state, uid, uid)
    ws.mkdir()
    without_ptrace = AMBIENT.replace("cap_sys_ptrace,", "")
    done = as_system_user(
        uid,
        f"{BIN / 'gatewayd'} run --state-dir {state} --netns-prefix cgv{os.getpid()}- "
        f"--policy {ROOT / 'policies/examples/demo.yaml'} --workspace {ws} -- true",
        caps=without_ptrace,
    )
    assert done.returncode != 0
    assert "gatewayd lacks CAP_SYS_PTRACE" in done.stderr and "docs/operations.md" in done.stderr


def test_the_units_capabilities_are_exactly_what_gatewayds_probe_requires() -> None:
    lines = dict(
        line.split("=", 1)
        for line in UNIT.read_text().splitlines()
        if "=" in line and line[0] != "#"
    )
    wanted = set(REQUIRED_CAPABILITIES)
    assert set(lines["AmbientCapabilities"].split()) == wanted
    assert set(lines["CapabilityBoundingSet"].split()) == wanted
    assert lines["User"] == "gatewayd" and lines["NoNewPrivileges"] == "yes"
