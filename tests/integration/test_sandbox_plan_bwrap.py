"""The rendered plan run by the real bwrap, with a python probe proving the view from inside.

The run's network namespace is the launcher's job; here ``--unshare-net`` is added to the
argv (in this test only) so the probe cannot reach anything.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from gatewayd.policy.paths import PathMode
from gatewayd.sandbox.plan import (
    COGNI_TOOL_VISIBLE_DIR,
    ETC_ALLOWLIST,
    PolicyMount,
    SandboxPlan,
    build_plan,
    probe_host_layout,
    render_argv,
)

BWRAP = shutil.which("bwrap")
SANDBOX_PYTHON = "/usr/bin/python3"
pytestmark = pytest.mark.skipif(
    BWRAP is None or not os.path.exists(SANDBOX_PYTHON),
    reason="needs bubblewrap and the system python3",
)
RUN_ID = "run-probe01"

PROBE = r"""
import ctypes, errno, json, os, pwd, shutil, socket, subprocess

CLONE_NEWUSER = 0x10000000
libc = ctypes.CDLL(None, use_errno=True)
nested_userns = "ok" if libc.unshare(CLONE_NEWUSER) == 0 else errno.errorcode[ctypes.get_errno()]

def try_write(path):
    try:
        with open(path, "w") as f:
            f.write("x")
        return "ok"
    except OSError as e:
        return errno.errorcode[e.errno]

environ = open("/proc/self/environ", "rb").read().split(b"\0")
names = sorted(item.split(b"=", 1)[0].decode() for item in environ if item)
conn = socket.socket(socket.AF_UNIX)
conn.connect(os.environ["COGNI_GATEWAY_SOCK"])
conn.close()
print(json.dumps({
    "tmp_at_start": os.listdir("/tmp"),
    "workspace_write": try_write("/workspace/from-sandbox.txt"),
    "ro_policy_write": try_write("/mnt/reference/x"),
    "ro_policy_read": open("/mnt/reference/readme.txt").read(),
    "rw_policy_write": try_write("/mnt/out/result.txt"),
    "tmp_write": try_write("/tmp/scratch"),
    "root_write": try_write("/new-file"),
    "etc_write": try_write("/etc/new-file"),
    "usr_write": try_write("/usr/new-file"),
    "present": {p: os.path.lexists(p) for p in
                ["/etc/shadow", "/etc/gshadow", "/etc/machine-id", "/etc/ssh", "/etc/sudoers",
                 "/root", "/home", "/var", "/etc/resolv.conf"]},
    "run": sorted(os.listdir("/run")),
    "run_cogni": sorted(os.listdir("/run/cogni")),
    "etc": sorted(os.listdir("/etc")),
    "env_names": names,
    "env_path": os.environ["PATH"],
    "which_tool": shutil.which("cogni-tool"),
    "tool_output": subprocess.run(["cogni-tool"], capture_output=True, text=True).stdout,
    "uid": os.getuid(),
    "user": pwd.getpwuid(os.getuid()).pw_name,
    "cwd": os.getcwd(),
    "hostname": socket.gethostname(),
    "pid": os.getpid(),
    "nested_userns": nested_userns,
}))
"""


@pytest.fixture
def world() -> Iterator[dict[str, Path]]:
    """Host directories for one run: workspace, policy paths, state dir with a live socket,
    cogni-tool's directory, and a decoy file in the host's /tmp."""
    base = Path(tempfile.mkdtemp(prefix="cg-plan-", dir="/tmp"))
    dirs = {name: base / name for name in ("ws", "ref", "out", "tool", "state")}
    for path in dirs.values():
        path.mkdir()
    (dirs["ref"] / "readme.txt").write_text("reference text")
    tool = dirs["tool"] / "cogni-tool"
    tool.write_text("#!/bin/sh\necho tool-ok\n")
    tool.chmod(0o755)
    run_dir = dirs["state"] / "runs" / RUN_ID
    run_dir.mkdir(parents=True)
    listener = socket.socket(socket.AF_UNIX)
    listener.bind(str(run_dir / "gateway.sock"))
    listener.listen(4)
    # Another run's socket, which the sandbox must not see.
    (dirs["state"] / "runs" / "run-other").mkdir()
    (dirs["state"] / "runs" / "run-other" / "gateway.sock").write_text("")
    dirs["socket"] = run_dir / "gateway.sock"
    try:
        yield dirs
    finally:
        listener.close()
        shutil.rmtree(base, ignore_errors=True)


def make_plan(world: dict[str, Path]) -> SandboxPlan:
    return build_plan(
        run_id=RUN_ID,
        workspace_host=str(world["ws"]),
        policy_paths=[
            PolicyMount(host=str(world["ref"]), visible="/mnt/reference", mode=PathMode.RO),
            PolicyMount(host=str(world["out"]), visible="/mnt/out", mode=PathMode.RW),
        ],
        gateway_socket_host=str(world["socket"]),
        cogni_tool_host_dir=str(world["tool"]),
        command=[SANDBOX_PYTHON, "-I", "-c", PROBE],
        extra_env_names=[],
        env_values={"LANG": "C.UTF-8", "TERM": "dumb", "SECRET_TOKEN": "hunter2"},
        state_dir=str(world["state"]),
        netns_path=f"/run/netns/cogni-{RUN_ID}",
        layout=probe_host_layout(),
    )


def run_probe(plan: SandboxPlan) -> dict[str, Any]:
    """Run the plan the way a launcher would: generated files on memfds, a daemon env full
    of secrets (which --clearenv must drop), and (test only) no network."""
    fds: dict[str, int] = {}
    try:
        for step in plan.data_steps:
            fd = os.memfd_create("bwrap-data")
            os.write(fd, step.data)
            os.lseek(fd, 0, os.SEEK_SET)
            fds[step.dest] = fd
        argv = render_argv(plan, bwrap=str(BWRAP), data_fds=fds)
        argv.insert(1, "--unshare-net")
        daemon_env = {"PATH": os.environ["PATH"], "SECRET_TOKEN": "hunter2", "HOME": "/root"}
        done = subprocess.run(
            argv,
            env=daemon_env,
            pass_fds=tuple(fds.values()),
            capture_output=True,
            text=True,
            timeout=30,
            check=False,
        )
    finally:
        for fd in fds.values():
            os.close(fd)
    assert done.returncode == 0, done.stderr
    result: dict[str, Any] = json.loads(done.stdout)
    return result


@pytest.fixture
def probe(world: dict[str, Path]) -> dict[str, Any]:
    return run_probe(make_plan(world))


def test_workspace_and_rw_policy_path_are_writable_and_reach_the_host(
    probe: dict[str, Any], world: dict[str, Path]
) -> None:
    assert probe["workspace_write"] == "ok"
    assert (world["ws"] / "from-sandbox.txt").read_text() == "x"
    assert probe["rw_policy_write"] == "ok"
    assert (world["out"] / "result.txt").exists()
    assert probe["cwd"] == "/workspace"


def test_ro_policy_path_is_readable_but_not_writable(
    probe: dict[str, Any], world: dict[str, Path]
) -> None:
    assert probe["ro_policy_read"] == "reference text"
    assert probe["ro_policy_write"] == "EROFS"
    assert not (world["ref"] / "x").exists()


def test_nothing_outside_workspace_and_tmp_is_writable(probe: dict[str, Any]) -> None:
    assert probe["tmp_write"] == "ok"
    assert probe["root_write"] == "EROFS"
    assert probe["etc_write"] == "EROFS"
    assert probe["usr_write"] == "EROFS"


def test_host_secrets_and_private_trees_are_absent(probe: dict[str, Any]) -> None:
    assert probe["present"] == dict.fromkeys(probe["present"], False)
    assert set(probe["etc"]) <= {*ETC_ALLOWLIST, "ssl", "passwd", "group", "hosts"}


def test_run_holds_only_this_runs_socket_and_it_answers(probe: dict[str, Any]) -> None:
    assert probe["run"] == ["cogni"]
    assert probe["run_cogni"] == ["gateway.sock"]  # the probe connected to it


def test_tmp_is_private_and_starts_empty(probe: dict[str, Any]) -> None:
    assert probe["tmp_at_start"] == []


def test_environment_holds_only_allowlisted_names(probe: dict[str, Any]) -> None:
    # PWD is set by bwrap itself after --chdir; it holds the sandbox's cwd, no host value.
    assert probe["env_names"] == sorted(
        ["PATH", "HOME", "LANG", "TERM", "COGNI_GATEWAY_SOCK", "COGNI_RUN_ID", "PWD"]
    )


def test_cogni_tool_is_first_on_path_and_runs(probe: dict[str, Any]) -> None:
    assert probe["env_path"].split(":")[0] == COGNI_TOOL_VISIBLE_DIR
    assert probe["which_tool"] == f"{COGNI_TOOL_VISIBLE_DIR}/cogni-tool"
    assert probe["tool_output"] == "tool-ok\n"


def test_sandbox_user_is_unprivileged_named_and_in_its_own_pid_and_uts_namespaces(
    probe: dict[str, Any],
) -> None:
    assert probe["uid"] == 1000
    assert probe["user"] == "sandbox"
    assert probe["hostname"] == "cogni-sandbox"
    assert probe["pid"] < 10  # a fresh pid namespace: bwrap's init is pid 1


def test_a_nested_user_namespace_cannot_be_created(probe: dict[str, Any]) -> None:
    # --disable-userns sets user.max_user_namespaces to 0 inside: unshare fails ENOSPC.
    assert probe["nested_userns"] == "ENOSPC"
