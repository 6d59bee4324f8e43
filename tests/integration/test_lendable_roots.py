"""Only what may be lent is lent, and nothing lent loses a bit (invariant
LEND_ONLY_WHAT_IS_LENDABLE), shown with real gatewayd runs.

Runs aimed at system trees never touch the real ones: they run inside a decoy of the
whole host (tests/decoyroot.py: a private mount namespace whose / is an overlay of the
real one), each tree holding a planted root-owned script and set-user-ID and
set-group-ID binaries, and each run's command tries to rewrite the script. Refused, the
decoy's probes are exactly as they were; a regression would show on them, in the decoy.
The lease's round trip is shown on a workspace under /tmp, from inside a real sandbox.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import re
import secrets
import shutil
import stat
import subprocess
import sys
import tempfile
import textwrap
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import pytest

from gatewayd.config import GatewaydConfig, SandboxUids
from gatewayd.daemon import Daemon, open_daemon
from gatewayd.runs import Grant, Run, RunRequest
from gatewayd.sandbox.lease import LeaseError, give_back, lend, read_lease
from gatewayd.sandbox.lendable import LendableRoots, NotLendable, OwnDirectory
from gatewayd.sandbox.limits import HostUser
from gatewayd.sandbox.session import clean_leftovers
from tests.decoyroot import run_in_decoy_root

GATEWAYD = str(Path(sys.executable).parent / "gatewayd")
DEMO = str(Path(__file__).resolve().parents[2] / "policies" / "examples" / "demo.yaml")
PY = "/usr/bin/python3"
SETCAP = "/sbin/setcap"
CAPABILITY_XATTR = "security.capability"
# The system trees a run is aimed at (every one the outside review named, and their
# neighbours): as a workspace and as an rw policy path, each must be refused.
SYSTEM_TREES = (
    "/",
    "/usr",
    "/usr/bin",
    "/usr/lib",
    "/usr/local",
    "/usr/local/lib/probe",
    "/opt",
    "/srv",
    "/etc",
    "/var",
    "/var/lib",
    "/boot",
    "/bin",
    "/sbin",
    "/lib",
    "/root",
    "/mnt",
    "/media",
)
DEGRADED_TREES = ("/", "/etc", "/usr/local/lib/probe")
HINT = "lendable_roots (option --lendable-root, variable GATEWAYD_LENDABLE_ROOTS)"
DEGRADED_POLICY = """
version: 1
name: degraded-demo
tools: {allow: [fs.read, fs.write]}
filesystem:
  paths:
    workspace: {root: ., mode: rw}
require_os_sandbox: false
"""


def _unavailable() -> str | None:
    if os.geteuid() != 0:
        return "lending needs root (chown, mount namespaces, a uid per run)"
    for tool in ("/usr/bin/bwrap", PY, SETCAP, "/usr/bin/unshare", "/usr/sbin/pivot_root"):
        if not os.path.exists(tool):
            return f"needs {tool}"
    return None


pytestmark = pytest.mark.skipif(_unavailable() is not None, reason=str(_unavailable()))


def _fresh_base(prefix: str) -> Path:
    path = Path(tempfile.mkdtemp(prefix=prefix, dir="/tmp"))
    path.chmod(0o711)  # the sandbox's uid passes through to its workspace and socket
    return path


@pytest.fixture
def base() -> Iterator[Path]:
    path = _fresh_base("cg-lend-")
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


def _inside(code: str, **values: Any) -> str:
    """Test code for the decoy: ``values`` become its constants (as JSON)."""
    constants = "".join(f"{name} = json.loads({json.dumps(v)!r})\n" for name, v in values.items())
    header = (
        "import json, os, subprocess, sys\n"
        "from pathlib import Path\n"
        "from tests.decoyroot import ATTACK, plant_probes, snapshot\n"
        "from tests.livedaemon import sandbox_options, start_daemon\n"
    )
    return header + constants + textwrap.dedent(code)


def _assert_refused(result: dict[str, Any], real: str, *, says: str) -> None:
    assert result["rc"] == 1, result
    assert "bad_request" in result["stderr"], result["stderr"]
    assert real in result["stderr"] and says in result["stderr"], result["stderr"]
    assert result["after"] == result["before"], f"the decoy's probes changed: {result}"


# --- every system tree, as a workspace: `gatewayd run` in the decoy ---------------------


@pytest.fixture(scope="module")
def workspace_runs() -> Iterator[dict[str, Any]]:
    path = _fresh_base("cg-lendws-")
    policy = path / "degraded.yaml"
    policy.write_text(textwrap.dedent(DEGRADED_POLICY))
    code = """
    def attempt(tree, state, *options, attack=ATTACK):
        probes = plant_probes(tree)
        before = snapshot(probes)
        proc = subprocess.run(
            [GATEWAYD, "run", "--state-dir", state, "--workspace", tree, *options,
             "--", "sh", "-c", attack],
            capture_output=True, text=True, timeout=120,
        )
        return {"real": os.path.realpath(tree), "rc": proc.returncode,
                "stderr": proc.stderr, "before": before, "after": snapshot(probes)}

    results = {"sandboxed": {}, "degraded": {}}
    for i, tree in enumerate(TREES):
        results["sandboxed"][tree] = attempt(
            tree, f"{BASE}/s{i}", "--policy", DEMO, *sandbox_options()
        )
    for i, tree in enumerate(DEGRADED):
        # A degraded run's command runs on the host in the workspace, as gatewayd.
        results["degraded"][tree] = attempt(
            tree, f"{BASE}/d{i}", "--policy", POLICY, "--no-os-sandbox",
            attack='echo "echo PWNED" > cogni-probe.sh',
        )
    print(json.dumps(results))
    """
    try:
        yield run_in_decoy_root(
            path,
            _inside(
                code,
                TREES=SYSTEM_TREES,
                DEGRADED=DEGRADED_TREES,
                BASE=str(path),
                GATEWAYD=GATEWAYD,
                DEMO=DEMO,
                POLICY=str(policy),
            ),
            trees=SYSTEM_TREES,
        )
    finally:
        shutil.rmtree(path, ignore_errors=True)


@pytest.mark.parametrize("tree", SYSTEM_TREES)
def test_a_system_tree_is_refused_as_a_sandboxed_runs_workspace_and_left_as_it_was(
    workspace_runs: dict[str, Any], tree: str
) -> None:
    result = workspace_runs["sandboxed"][tree]
    _assert_refused(result, result["real"], says=HINT)
    assert "lies under no lendable root" in result["stderr"]


@pytest.mark.parametrize("tree", DEGRADED_TREES)
def test_a_system_tree_is_refused_as_a_degraded_runs_workspace_too(
    workspace_runs: dict[str, Any], tree: str
) -> None:
    # Without a sandbox nothing is lent, but the command and the host-side tools would
    # write the workspace as gatewayd's own user.
    result = workspace_runs["degraded"][tree]
    _assert_refused(result, result["real"], says=HINT)


# --- every system tree, as an rw policy path: the control socket in the decoy ------------


@pytest.fixture(scope="module")
def policy_path_runs() -> Iterator[dict[str, Any]]:
    path = _fresh_base("cg-lendrw-")
    code = """
    daemon = start_daemon(Path(BASE) / "state", sandbox=True)
    try:
        workspace = Path(BASE) / "ws"
        workspace.mkdir()
        results = {}
        for i, tree in enumerate(TREES):
            probes = plant_probes(tree)
            before = snapshot(probes)
            # Seen at /data/target, so the plan's own checks on system destinations
            # do not stop it: only the lendable roots do.
            policy = Path(BASE) / f"rw{i}.yaml"
            policy.write_text(
                "version: 1\\nname: rw-path\\ntools: {allow: [fs.read, fs.write]}\\n"
                "filesystem:\\n  paths:\\n    workspace: {root: ., mode: rw}\\n"
                f"    target: {{root: {json.dumps(tree)}, mount: /data/target, mode: rw}}\\n"
            )
            status, body = daemon.control("POST", "/v1/runs", {
                "workspacePath": str(workspace), "policy": daemon.policy_name(policy),
                "actorId": "tester", "tenantId": "t1", "grant": {"allowSandbox": True},
            })
            if status == 201:  # lent: run the attack in it, as `gatewayd exec` would
                run_id = body["run"]["runId"]
                daemon.control("POST", f"/v1/runs/{run_id}/exec", {
                    "command": ["sh", "-c", "echo 'echo PWNED' > /data/target/cogni-probe.sh"]
                })
                daemon.control("DELETE", f"/v1/runs/{run_id}")
            results[tree] = {"real": os.path.realpath(tree), "status": status, "body": body,
                             "before": before, "after": snapshot(probes)}
        refused = [
            json.loads(line) for line in daemon.audit_path.read_text().splitlines()
            if '"run_refused"' in line
        ]
    finally:
        daemon.stop()
    print(json.dumps({"runs": results, "refused": refused}))
    """
    try:
        yield run_in_decoy_root(
            path, _inside(code, TREES=SYSTEM_TREES, BASE=str(path)), trees=SYSTEM_TREES
        )
    finally:
        shutil.rmtree(path, ignore_errors=True)


@pytest.mark.parametrize("tree", SYSTEM_TREES)
def test_a_system_tree_as_an_rw_policy_path_is_refused_400_audited_and_left_as_it_was(
    policy_path_runs: dict[str, Any], tree: str
) -> None:
    result = policy_path_runs["runs"][tree]
    assert result["status"] == 400, result
    assert result["body"]["errorCode"] == "bad_request", result
    message = result["body"]["message"]
    assert "policy path 'target' (rw)" in message and result["real"] in message, message
    assert HINT in message, message
    assert result["after"] == result["before"], f"the decoy's probes changed: {result}"
    audited = [e for e in policy_path_runs["refused"] if e.get("safeMessage") == message]
    assert audited, "the refusal is not in the audit log"
    assert audited[0]["errorCode"] == "bad_request"


# --- disguises: symlinks, '..', bind mounts; and a configured allowlist ----------------


@pytest.fixture(scope="module")
def disguised_runs() -> Iterator[dict[str, Any]]:
    path = _fresh_base("cg-lenddis-")
    code = """
    base = Path(BASE)
    probes = plant_probes("/usr/local/lib/probe")
    before = snapshot(probes)
    (base / "link").symlink_to("/usr/local/lib/probe")
    for name in ("usrbind", "libbind", "rootbind", "okbind", "data/ws", "ws"):
        (base / name).mkdir(parents=True)
    for source, point in (("/usr", "usrbind"), ("/usr/local/lib", "libbind"),
                          ("/", "rootbind"), (f"{BASE}/data", "okbind")):
        subprocess.run(["mount", "--bind", source, str(base / point)], check=True)
    os.makedirs("/srv/workspaces/ws", exist_ok=True)
    with open("/srv/workspaces/ws/notes.txt", "w") as f:
        f.write("original\\n")
    rw_link = base / "rw-link.yaml"
    rw_link.write_text(
        "version: 1\\nname: rw-link\\ntools: {allow: [fs.read]}\\nfilesystem:\\n  paths:\\n"
        "    workspace: {root: ., mode: rw}\\n"
        f"    target: {{root: {BASE}/link, mount: /data/target, mode: rw}}\\n"
    )

    # Mode host: what the attacks did is looked for in the directories themselves.
    def run(name, workspace, *options, policy=DEMO, attack=ATTACK):
        proc = subprocess.run(
            [GATEWAYD, "run", "--state-dir", f"{BASE}/{name}", "--workspace", workspace,
             "--policy", policy, "--workspace-mode", "host", *sandbox_options(), *options,
             "--", "sh", "-c", attack],
            capture_output=True, text=True, timeout=120,
        )
        return {"rc": proc.returncode, "stderr": proc.stderr, "stdout": proc.stdout}

    results = {
        "symlink": run("s1", f"{BASE}/link"),
        "dotdot": run("s2", f"{BASE}/../../usr/local/lib/probe"),
        "rw_symlink": run("s3", f"{BASE}/ws", policy=str(rw_link)),
        "bind_usr": run("s4", f"{BASE}/usrbind/local/lib/probe"),
        "bind_subdir": run("s5", f"{BASE}/libbind/probe"),
        "bind_root": run("s6", f"{BASE}/rootbind/usr/local/lib/probe"),
        "bind_own_dir": run("s7", f"{BASE}/okbind/ws", attack="echo made > /workspace/x.txt"),
        "allowlisted": run(
            "s8", "/srv/workspaces/ws", "--lendable-root", "/srv/workspaces",
            attack="echo rewritten > /workspace/notes.txt",
        ),
        "allowlist_root_itself": run("s9", "/srv/workspaces", "--lendable-root",
                                     "/srv/workspaces"),
        "allowlist_replaces_defaults": run("s10", f"{BASE}/ws", "--lendable-root",
                                           "/srv/workspaces"),
    }
    notes = os.stat("/srv/workspaces/ws/notes.txt")
    results["allowlisted_after"] = {
        "text": open("/srv/workspaces/ws/notes.txt").read(),
        "owner": [notes.st_uid, notes.st_gid],
    }
    results["own_dir_after"] = os.path.exists(f"{BASE}/data/ws/x.txt")
    results["probes"] = {"before": before, "after": snapshot(probes)}
    print(json.dumps(results))
    """
    try:
        yield run_in_decoy_root(
            path,
            _inside(code, BASE=str(path), GATEWAYD=GATEWAYD, DEMO=DEMO),
            trees=("/usr/local/lib/probe", "/srv/workspaces", str(path)),
        )
    finally:
        shutil.rmtree(path, ignore_errors=True)


@pytest.mark.parametrize("case", ["symlink", "dotdot"])
def test_a_workspace_leading_into_a_system_tree_is_judged_where_it_leads(
    disguised_runs: dict[str, Any], case: str
) -> None:
    result = disguised_runs[case]
    assert result["rc"] == 1, result
    assert "workspace /usr/local/lib/probe lies under no lendable root" in result["stderr"]
    assert disguised_runs["probes"]["after"] == disguised_runs["probes"]["before"]


def test_an_rw_policy_path_through_a_symlink_is_judged_where_it_leads(
    disguised_runs: dict[str, Any],
) -> None:
    result = disguised_runs["rw_symlink"]
    assert result["rc"] == 1, result
    assert (
        "policy path 'target' (rw) /usr/local/lib/probe lies under no lendable root"
        in result["stderr"]
    ), result["stderr"]
    assert disguised_runs["probes"]["after"] == disguised_runs["probes"]["before"]


@pytest.mark.parametrize(
    ("case", "mount", "shows"),
    [
        ("bind_usr", "usrbind", "/usr"),
        ("bind_subdir", "libbind", "/usr"),  # a directory inside a system tree
        ("bind_root", "rootbind", "/"),
    ],
)
def test_a_bind_mount_of_a_system_tree_under_a_lendable_root_is_refused(
    disguised_runs: dict[str, Any], case: str, mount: str, shows: str
) -> None:
    result = disguised_runs[case]
    assert result["rc"] == 1, result
    assert "bad_request" in result["stderr"]
    assert f"/{mount} is a mount that shows the system tree {shows}," in result["stderr"], result
    assert disguised_runs["probes"]["after"] == disguised_runs["probes"]["before"]


def test_a_bind_mount_of_an_ordinary_directory_is_lent_like_any(
    disguised_runs: dict[str, Any],
) -> None:
    result = disguised_runs["bind_own_dir"]
    assert result["rc"] == 0, result
    assert disguised_runs["own_dir_after"]


def test_a_configured_root_lends_what_lies_beneath_it_and_gives_it_back(
    disguised_runs: dict[str, Any],
) -> None:
    result = disguised_runs["allowlisted"]
    assert result["rc"] == 0, result
    assert disguised_runs["allowlisted_after"] == {"text": "rewritten\n", "owner": [0, 0]}


def test_a_configured_root_itself_is_never_lent(disguised_runs: dict[str, Any]) -> None:
    result = disguised_runs["allowlist_root_itself"]
    assert result["rc"] == 1, result
    assert (
        "workspace /srv/workspaces is a lendable root itself; a root is never lent whole"
        in result["stderr"]
    ), result["stderr"]


def test_configured_roots_replace_the_defaults(disguised_runs: dict[str, Any]) -> None:
    result = disguised_runs["allowlist_replaces_defaults"]
    assert result["rc"] == 1, result
    assert "strictly beneath one of: /srv/workspaces." in result["stderr"], result["stderr"]


# --- the configuration: no system tree may be made lendable -----------------------------


@pytest.mark.parametrize(
    ("how", "root", "where", "says"),
    [
        ("option", "/usr/local", "--lendable-root", "/usr/local lies in the system tree /usr"),
        ("option", "/", "--lendable-root", "/ holds the whole system"),
        ("option", "/var", "--lendable-root", "/var holds the system tree /var/lib"),
        ("option", "/srv", "--lendable-root", "/srv itself holds the host's service data"),
        ("variable", "/etc:/home", "GATEWAYD_LENDABLE_ROOTS", "/etc lies in the system tree"),
        ("file", "/opt/workspaces", "FILE", "/opt/workspaces lies in the system tree /opt"),
        ("option", "STATE/ws", "lendable_roots", "lies in gatewayd's own state_dir"),
    ],
)
def test_a_lendable_root_at_above_or_beneath_a_system_tree_is_a_configuration_error(
    base: Path, how: str, root: str, where: str, says: str
) -> None:
    # The workspace is an ordinary one: were the root accepted, the run would go ahead
    # (and touch nothing of the system).
    workspace = base / "ws"
    workspace.mkdir()
    state = base / "state"
    root = root.replace("STATE", str(state))
    env = {k: v for k, v in os.environ.items() if not k.startswith("GATEWAYD_")}
    options: list[str] = []
    if how == "option":
        options = ["--lendable-root", root]
    elif how == "variable":
        env["GATEWAYD_LENDABLE_ROOTS"] = root
    else:
        config = base / "gatewayd.yaml"
        config.write_text(f"lendable_roots: [{root}]\n")
        options = ["--config", str(config)]
        where = str(config)  # the file is named
    proc = subprocess.run(
        [
            *(GATEWAYD, "run", "--state-dir", str(state), "--workspace", str(workspace)),
            *("--policy", DEMO, "--no-os-sandbox", *options, "--", "true"),
        ],
        capture_output=True,
        text=True,
        env=env,
        timeout=60,
    )
    assert proc.returncode == 1, proc
    assert "gatewayd: bad configuration:" in proc.stderr, proc.stderr
    assert f"{where}:" in proc.stderr and says in proc.stderr, proc.stderr
    assert "/srv/workspaces" in proc.stderr and "--lendable-root" in proc.stderr  # what to do
    assert not (state / "audit").exists()  # nothing started


# --- the lease round trip, from inside a real sandbox ------------------------------------


class Lending:
    def __init__(self, daemon: Daemon, base: Path) -> None:
        self.daemon = daemon
        self.base = base

    async def run(self, workspace: Path) -> Run:
        return await self.daemon.runs.start(
            RunRequest(
                workspacePath=str(workspace),
                policy="demo",
                actorId="tester",
                tenantId="t1",
                grant=Grant(allowSandbox=True),
            )
        )


@pytest.fixture
async def lending(base: Path) -> AsyncIterator[Lending]:
    config = GatewaydConfig(
        state_dir=base / "state",
        policy_dirs=(Path(DEMO).parent,),
        netns_prefix=f"cgt{secrets.token_hex(4)}-",
        sandbox_uids=SandboxUids(base=1_700_000_000 + secrets.randbelow(50_000) * 1024, count=64),
    )
    async with open_daemon(config, preload=True) as daemon:
        assert daemon.runs.support.available, daemon.runs.support.reason
        yield Lending(daemon, base)


def _mixed_tree(ws: Path) -> None:
    """Everything a lease must hand back exactly, or never take."""
    ws.mkdir()
    (ws / "plain.txt").write_text("plain\n")
    for name, mode, group in (("setuid", 0o4755, 0), ("setgid", 0o2755, 50), ("both", 0o6711, 0)):
        shutil.copyfile("/bin/true", ws / name)
        os.chown(ws / name, 0, group)
        os.chmod(ws / name, mode)
    shutil.copyfile("/bin/true", ws / "capped")
    subprocess.run([SETCAP, "cap_net_raw+ep", str(ws / "capped")], check=True)
    (ws / "sticky").mkdir()
    os.chmod(ws / "sticky", 0o1777)
    (ws / "shared").mkdir()
    os.chmod(ws / "shared", 0o2775)
    (ws / "shared" / "inner.txt").write_text("inner\n")
    (ws / "linked.txt").write_text("two names\n")
    os.link(ws / "linked.txt", ws / "shared" / "second-name.txt")
    (ws / "theirs.txt").write_text("another user's\n")
    os.chown(ws / "theirs.txt", 4321, 4321)
    (ws / "grouped.txt").write_text("root, staff\n")
    os.chown(ws / "grouped.txt", 0, 50)
    os.mknod(ws / "null", stat.S_IFCHR | 0o600, os.makedev(1, 3))
    os.mkfifo(ws / "fifo", 0o600)
    os.symlink("plain.txt", ws / "link")


def _state(ws: Path) -> dict[str, tuple[Any, ...]]:
    """Every entry's owner, group, whole mode, capabilities and content digest."""
    found: dict[str, tuple[Any, ...]] = {}
    for path in [ws, *sorted(ws.rglob("*"))]:
        st = os.lstat(path)
        caps: bytes | None = None
        digest = None
        if stat.S_ISREG(st.st_mode):
            try:
                caps = os.getxattr(path, CAPABILITY_XATTR)
            except OSError:
                caps = None
            digest = hashlib.sha256(path.read_bytes()).hexdigest()
        found[str(path.relative_to(ws))] = (st.st_uid, st.st_gid, st.st_mode, caps, digest)
    return found


PROBE = r"""
import errno, json, os
out = {}
for name in ("setuid", "setgid", "both", "capped", "linked.txt", "theirs.txt", "null",
             "plain.txt", "grouped.txt", "shared/inner.txt"):
    try:
        os.close(os.open("/workspace/" + name, os.O_WRONLY | os.O_APPEND | os.O_NONBLOCK))
        out[name] = "writable"
    except OSError as e:
        out[name] = errno.errorcode[e.errno]
print(json.dumps(out))
"""


async def test_a_run_leaves_every_owner_mode_bit_and_capability_as_it_found_them(
    lending: Lending, base: Path
) -> None:
    ws = base / "ws"
    _mixed_tree(ws)
    before = _state(ws)
    run = await lending.run(ws)
    assert run.sandbox is not None
    uid = run.sandbox.user.uid
    # What may not be lent stayed its owner's for the run, bits and all.
    for name in ("setuid", "setgid", "both", "capped", "linked.txt", "null", "fifo"):
        assert os.lstat(ws / name).st_uid == 0, name
    assert _state(ws)["capped"][3] is not None
    assert os.lstat(ws / "plain.txt").st_uid == uid  # the rest is lent
    result = await lending.daemon.runs.exec(run.run_id, ["true"], timeout_s=30)
    assert result.exitCode == 0, result.stderr
    probe = await lending.daemon.runs.exec(run.run_id, [PY, "-I", "-c", PROBE], timeout_s=30)
    assert probe.exitCode == 0, probe.stderr
    assert json.loads(probe.stdout) == {
        "setuid": "EACCES",
        "setgid": "EACCES",
        "both": "EACCES",
        "capped": "EACCES",
        "linked.txt": "EACCES",
        "theirs.txt": "EACCES",
        "null": "EACCES",
        "plain.txt": "writable",  # lent: the run writes its workspace
        "grouped.txt": "writable",
        "shared/inner.txt": "writable",
    }
    await lending.daemon.runs.end(run.run_id)
    assert _state(ws) == before


# --- the check itself, and the lease's own ------------------------------------------------


def test_a_tree_beneath_a_root_is_lendable_and_its_identity_is_what_was_checked(
    base: Path,
) -> None:
    ws = base / "ws"
    ws.mkdir()
    st = os.stat(ws)
    assert LendableRoots().require(ws) == (st.st_dev, st.st_ino)


def test_a_configured_root_that_leads_into_a_system_tree_is_no_root(base: Path) -> None:
    # Only read: the check opens the tree O_PATH and looks at it.
    (base / "apps").symlink_to("/usr")
    roots = LendableRoots(configured=(base / "apps",))
    with pytest.raises(NotLendable) as caught:
        roots.require(base / "apps" / "local", what="workspace")
    message = str(caught.value)
    assert "workspace" in message and "(really /usr/local)" in message, message
    assert f"{base}/apps is no root here: /usr lies in the system tree /usr" in message, message
    assert caught.value.code == "bad_request"


def test_an_own_root_must_be_gatewayds_and_closed_to_everyone_else(base: Path) -> None:
    work = base / "work"
    (work / "base").mkdir(parents=True)
    work.chmod(0o700)
    roots = LendableRoots(configured=(), own=(work,))
    roots.require(work / "base")
    work.chmod(0o755)  # anyone could have put something there
    with pytest.raises(NotLendable, match="lies under no lendable root") as caught:
        roots.require(work / "base")
    assert f"gatewayd's own {work} is no root here: it must be a directory of uid 0" in str(
        caught.value
    )


def test_the_lease_refuses_a_tree_beneath_no_root_before_recording_or_chowning(
    base: Path,
) -> None:
    # A caller that skipped the daemon's check still cannot lend: lend() checks again.
    ws = base / "ws"
    ws.mkdir()
    (ws / "notes.txt").write_text("x")
    record = base / "record"
    record.mkdir()
    user = HostUser(uid=4_000_011, gid=4_000_011)
    with pytest.raises(NotLendable, match=r"strictly beneath one of: /home\."):
        lend([ws], user, record, roots=LendableRoots(configured=(Path("/home"),)))
    assert not (record / "lease.json").exists()
    assert os.stat(ws).st_uid == 0 and os.stat(ws / "notes.txt").st_uid == 0


# --- gatewayd's own directories are never lent, however a path or setting is written ----

OWN_RW_POLICY = """
version: 1
name: own-rw
tools: {allow: [fs.read]}
filesystem:
  paths:
    workspace: {root: ., mode: rw}
    target: {root: TARGET, mount: /data/target, mode: rw}
"""
OWN_DEGRADED_POLICY = DEGRADED_POLICY.replace("degraded-demo", "own-degraded")


@dataclasses.dataclass(frozen=True, kw_only=True)
class OwnCase:
    """A daemon's settings, a run's paths, and what the refusal must say."""

    config: dict[str, Any]
    workspace: Path
    says: str
    own: Path  # the directory of gatewayd's the run would have been lent
    attack: str  # what the sandbox would do to it, had it been lent
    policy: str = "demo"


def _own_case(name: str, base: Path) -> OwnCase:
    real = base / "real"
    (base / "lnk").symlink_to(real)
    for directory in (real, base / "x", base / "ws"):
        directory.mkdir()
    forge = "echo FORGED >> {}"
    state_via_link = {"state_dir": base / "lnk" / "state"}
    if name == "state_dir through a symlink":
        return OwnCase(
            config=state_via_link,
            workspace=real,
            says=f"workspace {real} holds gatewayd's own state_dir {real}/state,",
            own=real / "state",
            attack=forge.format("/workspace/state/audit/audit.jsonl"),
        )
    if name == "state_dir through '..'":
        return OwnCase(
            config={"state_dir": base / "x" / ".." / "real" / "state"},
            workspace=real,
            says=f"workspace {real} holds gatewayd's own state_dir {real}/state,",
            own=real / "state",
            attack=forge.format("/workspace/state/audit/audit.jsonl"),
        )
    if name == "workspace through a symlink":
        return OwnCase(
            config={"state_dir": real / "state"},
            workspace=base / "lnk",
            says=f"workspace {real} holds gatewayd's own state_dir {real}/state,",
            own=real / "state",
            attack=forge.format("/workspace/state/audit/audit.jsonl"),
        )
    if name == "agent_dir":
        (real / "agent").mkdir(mode=0o700)
        (real / "agent" / "checkout.txt").write_text("another run's\n")
        return OwnCase(
            config={"state_dir": base / "state", "agent_dir": base / "lnk" / "agent"},
            workspace=real,
            says=f"workspace {real} holds gatewayd's own agent_dir {real}/agent,",
            own=real / "agent",
            attack=forge.format("/workspace/agent/checkout.txt"),
        )
    if name == "audit_path's directory":
        return OwnCase(
            config={"state_dir": base / "state", "audit_path": base / "lnk" / "audit.jsonl"},
            workspace=real,
            says=f"workspace {real} holds gatewayd's own audit_path's directory {real},",
            own=real,
            attack=forge.format("/workspace/audit.jsonl"),
        )
    if name == "control_socket's directory":
        (real / "sock").mkdir()
        return OwnCase(
            config={"state_dir": base / "state", "control_socket": base / "lnk/sock/c.sock"},
            workspace=real,
            says=(f"workspace {real} holds gatewayd's own control_socket's directory {real}/sock,"),
            own=real / "sock",
            attack="mkfifo /workspace/sock/c.sock",  # a stand-in where the socket is
        )
    if name == "a directory in state_dir":
        (real / "state" / "ws").mkdir(parents=True)
        return OwnCase(
            config=state_via_link,
            workspace=real / "state" / "ws",
            says=f"workspace {real}/state/ws lies in gatewayd's own state_dir {real}/state,",
            own=real / "state",
            attack="echo made > /workspace/made",
        )
    if name == "a directory in agent_dir":
        (real / "agent" / "ws").mkdir(parents=True)
        return OwnCase(
            config={"state_dir": base / "state", "agent_dir": base / "lnk" / "agent"},
            workspace=real / "agent" / "ws",
            says=f"workspace {real}/agent/ws lies in gatewayd's own agent_dir {real}/agent,",
            own=real / "agent",
            attack="echo made > /workspace/made",
        )
    if name == "an rw policy path":
        (base / "policies" / "own-rw.yaml").write_text(
            textwrap.dedent(OWN_RW_POLICY).replace("TARGET", str(base / "lnk"))
        )
        return OwnCase(
            config={"state_dir": base / "state", "audit_path": real / "audit.jsonl"},
            workspace=base / "ws",
            says=(
                f"policy path 'target' (rw) {real} holds gatewayd's own audit_path's "
                f"directory {real},"
            ),
            own=real,
            attack=forge.format("/data/target/audit.jsonl"),
            policy="own-rw",
        )
    assert name == "a degraded run's workspace", name
    (base / "policies" / "own-degraded.yaml").write_text(textwrap.dedent(OWN_DEGRADED_POLICY))
    return OwnCase(
        config={**state_via_link, "os_sandbox": False},
        workspace=real,
        says=f"workspace {real} holds gatewayd's own state_dir {real}/state,",
        own=real / "state",
        attack="",  # its host-side tools would write as gatewayd: never started
        policy="own-degraded",
    )


OWN_CASES = (
    "state_dir through a symlink",
    "state_dir through '..'",
    "workspace through a symlink",
    "agent_dir",
    "audit_path's directory",
    "control_socket's directory",
    "a directory in state_dir",
    "a directory in agent_dir",
    "an rw policy path",
    "a degraded run's workspace",
)


def _owners_beneath(tree: Path) -> set[int]:
    return {os.lstat(p).st_uid for p in (tree, *tree.rglob("*"))}


@pytest.mark.parametrize("name", OWN_CASES)
async def test_a_tree_holding_or_in_gatewayds_own_directories_is_refused_on_its_real_path(
    base: Path, name: str
) -> None:
    (base / "policies").mkdir()
    case = _own_case(name, base)
    config = GatewaydConfig(
        policy_dirs=(Path(DEMO).parent, base / "policies"),
        netns_prefix=f"cgt{secrets.token_hex(4)}-",
        sandbox_uids=SandboxUids(base=1_700_000_000 + secrets.randbelow(50_000) * 1024, count=64),
        **case.config,
    )
    # Served where the case names one, as `gatewayd serve` serves its setting's.
    async with open_daemon(config, preload=True, control_socket=config.control_socket) as daemon:
        before = _owners_beneath(case.own)
        log = daemon.config.resolved_audit_path
        request = RunRequest(
            workspacePath=str(case.workspace),
            policy=case.policy,
            actorId="tester",
            tenantId="t1",
            grant=Grant(allowSandbox=True),
        )
        refusal = ""
        try:
            run = await daemon.runs.start(request)
        except NotLendable as exc:
            refusal = str(exc)
        else:  # lent: the attack, from inside the sandbox, as the review showed it
            if case.attack:
                await daemon.runs.exec(run.run_id, ["sh", "-c", case.attack], timeout_s=30)
            await daemon.runs.end(run.run_id)
        text = log.read_text()
    assert "FORGED" not in text.splitlines(), "the sandbox wrote gatewayd's audit log"
    entries = [json.loads(line) for line in text.splitlines()]
    assert case.says in refusal, refusal or "the run started: the tree was lent"
    assert "which a sandbox never writes" in refusal or "is never lent" in refusal, refusal
    assert _owners_beneath(case.own) == before == {0}  # nothing of it was ever chowned
    refused = [e for e in entries if e.get("event") == "run_refused"]
    assert [(e["errorCode"], e["safeMessage"]) for e in refused] == [("bad_request", refusal)]


def test_a_tree_beneath_the_audit_logs_directory_is_lent_like_any(base: Path) -> None:
    # Only the state and agent directories hold other runs' files: beneath the audit
    # log's or the control socket's directory, a tree holds neither of those files.
    logs = base / "logs"
    (logs / "ws").mkdir(parents=True)
    own = OwnDirectory(setting="audit_path's directory", path=logs, private=False)
    st = os.stat(logs / "ws")
    assert LendableRoots(reserved=(own,)).require(logs / "ws") == (st.st_dev, st.st_ino)


def test_an_agent_runs_own_root_in_agent_dir_is_lent_beneath_and_nothing_else_there(
    base: Path,
) -> None:
    agent = base / "agent"
    work = agent / "0123456789abcdef"
    (work / "clone").mkdir(parents=True)
    (agent / "other").mkdir()
    work.chmod(0o700)
    own = OwnDirectory(setting="agent_dir", path=agent, private=True)
    roots = LendableRoots(configured=(), own=(work,), reserved=(own,))
    roots.require(work / "clone")
    with pytest.raises(NotLendable) as caught:
        LendableRoots(own=(work,), reserved=(own,)).require(agent / "other", what="workspace")
    assert str(caught.value) == (
        f"workspace {agent}/other lies in gatewayd's own agent_dir {agent}, which holds "
        "other runs' files and is never lent: use a directory outside gatewayd's own "
        "directories"
    )
    assert caught.value.code == "bad_request"


def test_a_configured_root_leading_into_the_state_directory_is_no_root_at_runtime(
    base: Path,
) -> None:
    # The configuration checks the root when it is read; a symlink made afterwards (or
    # a configuration made in code) is caught where the root is used, on its real path.
    state = base / "state"
    (state / "ws").mkdir(parents=True)
    (base / "srv-ws").symlink_to(state)
    own = OwnDirectory(setting="state_dir", path=state, private=True)
    roots = LendableRoots(configured=(base / "srv-ws",), reserved=(own,))
    with pytest.raises(NotLendable) as caught:
        roots.require(base / "srv-ws" / "ws", what="workspace")
    message = str(caught.value)
    assert f"workspace {base}/srv-ws/ws (really {state}/ws) lies under no lendable root" in message
    assert (
        f"{base}/srv-ws is no root here: {state} lies in gatewayd's own state_dir {state}, "
        "which is never lent"
    ) in message, message


# --- the lease follows the directory it lent, never a path -------------------------------

BORROWER = HostUser(uid=4_000_021, gid=4_000_021)


def _tree(base: Path, name: str = "ws") -> Path:
    ws = base / "homes" / name
    (ws / "sub").mkdir(parents=True)
    (ws / "notes.txt").write_text("notes\n")
    (ws / "sub" / "deep.txt").write_text("deep\n")
    return ws


def _uids(tree: Path) -> set[int]:
    return {os.lstat(p).st_uid for p in (tree, *tree.rglob("*"))}


def _roots(base: Path) -> LendableRoots:
    return LendableRoots(configured=(base / "homes",))


def test_the_lease_lends_only_the_directory_the_sandbox_binds(base: Path) -> None:
    ws = _tree(base)
    other = _tree(base, "other")
    record = base / "record"
    record.mkdir()
    bound = os.stat(other)  # what bwrap would bind: not what the path leads to now
    with pytest.raises(LeaseError) as caught:
        lend([ws], BORROWER, record, roots=_roots(base), pinned={ws: (bound.st_dev, bound.st_ino)})
    now = os.stat(ws)
    assert str(caught.value) == (
        f"{ws} is no longer the directory the run's sandbox binds (device and inode "
        f"{bound.st_dev}:{bound.st_ino}, now {now.st_dev}:{now.st_ino}: it was replaced after "
        "the run was created); nothing was lent"
    )
    assert not (record / "lease.json").exists()
    assert _uids(ws) == _uids(other) == {0}


def test_the_lease_records_the_identity_of_each_directory_lent(base: Path) -> None:
    ws = _tree(base)
    lease = lend([ws], BORROWER, base, roots=_roots(base))
    st = os.stat(ws)
    assert read_lease(base) == lease
    assert [(t.path, t.identity) for t in lease.trees] == [(str(ws), (st.st_dev, st.st_ino))]
    give_back(lease)
    assert _uids(ws) == {0}


def test_a_live_runs_tree_is_given_back_wherever_it_was_moved_and_a_deleted_one_is_done(
    base: Path,
) -> None:
    ws = _tree(base)
    lease = lend([ws], BORROWER, base, roots=_roots(base))
    held = os.open(ws, os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        moved = base / "homes" / "moved"
        ws.rename(moved)
        ws.mkdir()  # something else at the path: never touched
        os.chown(ws, BORROWER.uid, BORROWER.gid)
        assert give_back(lease, held={str(ws): held}) == 4
        assert _uids(moved) == {0}
        assert _uids(ws) == {BORROWER.uid}
        shutil.rmtree(moved)
        assert give_back(lease, held={str(ws): held}) == 0  # deleted: nothing to give back
    finally:
        os.close(held)


def test_a_descriptor_of_another_directory_gives_nothing_back(base: Path) -> None:
    ws = _tree(base)
    other = _tree(base, "other")
    lease = lend([ws], BORROWER, base, roots=_roots(base))
    (tree,) = lease.trees
    os.chown(other / "notes.txt", BORROWER.uid, BORROWER.gid)
    held = os.open(other, os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        with pytest.raises(LeaseError) as caught:
            give_back(lease, held={str(ws): held})
    finally:
        os.close(held)
    st = os.stat(other)
    assert str(caught.value) == (
        f"could not give back: {ws}: the descriptor held is not the directory lent (device "
        f"and inode {st.st_dev}:{st.st_ino}, lent {tree.device}:{tree.inode})"
    )
    assert os.stat(other / "notes.txt").st_uid == BORROWER.uid  # not the lease's tree
    assert _uids(ws) == {BORROWER.uid}
    give_back(lease)
    assert _uids(ws) == {0}


@pytest.mark.parametrize("now", ["another directory", "a symlink to it", "nothing"])
def test_a_crashed_runs_lease_is_kept_when_its_path_no_longer_leads_to_the_tree(
    base: Path, now: str
) -> None:
    runs = base / "state" / "runs"
    run_dir = runs / secrets.token_hex(16)
    run_dir.mkdir(parents=True)
    ws = _tree(base)
    lease = lend([ws], BORROWER, run_dir, roots=_roots(base))
    (tree,) = lease.trees
    moved = base / "homes" / "moved"
    ws.rename(moved)
    if now == "another directory":
        ws.mkdir()
        os.chown(ws, BORROWER.uid, BORROWER.gid)
        st = os.stat(ws)
        why = (
            f"it leads to another directory than the one lent (device and inode "
            f"{st.st_dev}:{st.st_ino}, lent {tree.device}:{tree.inode})"
        )
    elif now == "a symlink to it":
        ws.symlink_to(moved)  # even to the very tree: a symlink is never followed
        why = "it no longer leads to the directory lent (a symlink now)"
    else:
        why = "it no longer leads to the directory lent (No such file or directory)"
    cleaned = clean_leftovers(runs, None)
    assert cleaned["failed"] == [
        f"{run_dir.name}: could not give back: {ws}: {why}; nothing of it was changed, and "
        "the lease record stays so the next start tries again: put the directory lent back "
        f"at {ws}, or, if it was deleted, remove the run's directory under STATE/runs"
    ]
    assert cleaned["leasesReturned"] == [] and cleaned["runDirs"] == []
    assert read_lease(run_dir) == lease
    assert _uids(moved) == {BORROWER.uid}
    if now == "another directory":
        assert _uids(ws) == {BORROWER.uid}  # not the lease's: left as it is
        ws.rmdir()
    else:
        ws.unlink(missing_ok=True)
    moved.rename(ws)  # put back: the next start returns it
    assert clean_leftovers(runs, None) == {
        "leasesReturned": [str(ws)],
        "runDirs": [run_dir.name],
        "netns": [],
    }
    assert _uids(ws) == {0}


def test_a_lease_record_without_the_directorys_identity_is_kept_and_explained(
    base: Path,
) -> None:
    runs = base / "state" / "runs"
    run_dir = runs / secrets.token_hex(16)
    run_dir.mkdir(parents=True)
    ws = _tree(base)
    record = {
        "uid": 4_000_021,
        "gid": 4_000_021,
        "trees": [{"path": str(ws), "ownerUid": 0, "ownerGid": 0}],
    }
    (run_dir / "lease.json").write_text(json.dumps(record))
    cleaned = clean_leftovers(runs, None)
    assert cleaned["failed"] == [
        f"{run_dir.name}: unreadable lease record {run_dir}/lease.json: it has no 'device' "
        "(written by an older gatewayd, or damaged), so nothing of it was given back: "
        f"return its trees to their owners by hand, then remove {run_dir}"
    ]
    assert (run_dir / "lease.json").is_file()


NO_PROC = """
import json, os, sys
from pathlib import Path
from gatewayd.sandbox.lease import LeaseError, give_back, mount_points_under, read_lease
out = {}
try:
    mount_points_under(Path(sys.argv[1]))
    out["mounts"] = "read"
except LeaseError as exc:
    out["mounts"] = str(exc)
try:
    give_back(read_lease(Path(sys.argv[2])))
    out["give_back"] = "given back"
except LeaseError as exc:
    out["give_back"] = str(exc)
print(json.dumps(out))
"""


def test_without_proc_nothing_is_given_back_and_the_lease_says_why(base: Path) -> None:
    # A mount table that cannot be read (no /proc in this mount namespace): mounts inside
    # the tree cannot be told from the tree, and no descriptor can be changed through.
    ws = _tree(base)
    lend([ws], BORROWER, base, roots=_roots(base))
    proc = subprocess.run(
        [
            *("unshare", "-m", "--propagation", "private", "sh", "-c"),
            'mount -t tmpfs none /proc && exec "$0" -I -c "$1" "$2" "$3"',
            *(sys.executable, NO_PROC, str(ws), str(base)),
        ],
        capture_output=True,
        text=True,
        timeout=60,
        env={**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2])},
    )
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout)
    assert out["mounts"] == (
        f"cannot tell the mounts inside {ws} (/proc/self/mountinfo: No such file or "
        "directory); nothing of it was changed"
    )
    assert re.fullmatch(
        re.escape(f"could not give back: {ws}: cannot tell where the tree is (/proc/self/fd/")
        + r"\d+"
        + re.escape(
            ": No such file or directory): gatewayd changes a tree only through "
            "/proc/self/fd, so /proc must be mounted; nothing of it was changed"
        ),
        out["give_back"],
    ), out["give_back"]
    assert _uids(ws) == {BORROWER.uid}
    give_back(read_lease(base) or pytest.fail("no lease"))
    assert _uids(ws) == {0}
