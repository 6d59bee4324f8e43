"""An app's invocation attacked from inside: a scripted app model tries, through its
five tools and through probes it runs with exec in its own sandbox, everything an app
must not do (write outside its data/, reach the network, read another app's folder, get
more than its caller has), and each attempt fails. The reviewer denying, failing,
timing out and talking nonsense each deny; every limit ends the invocation with a usable
partial answer and nothing left behind; the audit log holds it all and verifies.

What a probe saw comes back to the app's model as the tool result, so each assertion
reads it from the scripted model's next request (:func:`tool_results`).
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
import stat
import tempfile
from collections.abc import AsyncIterator, Callable, Iterator, Mapping
from pathlib import Path
from typing import Any, Final

import pytest
import trio

from gatewayd.apps.install import install_app
from gatewayd.audit.verify import verify_file
from gatewayd.daemon import open_daemon
from gatewayd.runs import Run
from gatewayd.sandbox.netns import NETNS_RUN_DIR
from tests.fakeprovider import Call, FakeProvider, HttpError, Reply, Text
from tests.integration.test_app_invoke import APP_MODEL, KEY_ENV, REVIEWER, app_config
from tests.integration.test_run_sandbox import Sandboxed, _unavailable

pytestmark = pytest.mark.skipif(_unavailable() is not None, reason=str(_unavailable()))

# A variable of the daemon's environment that no sandbox may see.
HOST_SECRET_ENV: Final = "COGNI_TEST_APP_HOST_SECRET"
OTHER_MODEL: Final = "other-model"
# What the other app keeps: its presence in any answer is a leak.
VICTIM_SECRET: Final = "victim-secret-" + secrets.token_hex(6)

CALLER_POLICY: Final = f"""
version: 1
name: app-caller
tools:
  allow: [fs.read, fs.list, fs.write, http.fetch, app_*]
filesystem:
  paths:
    workspace: {{root: ., mode: rw}}
network:
  allow_domains: [example.com]
env:
  allow: [{HOST_SECRET_ENV}]
model_access:
  models: [{APP_MODEL}]
review: {{mode: "off", model: {REVIEWER}, timeout_s: {{timeout}}}}
limits: {{call_timeout_s: 120, calls_per_second: 100, burst: 100}}
sandbox: {{timeout_s: 60, cpu_s: 30, max_processes: 64}}
"""

# A caller that may read docs/ of its workspace and nothing else of it.
DOCS_ONLY_POLICY: Final = f"""
version: 1
name: docs-caller
tools:
  allow: [fs.read, app_*]
filesystem:
  paths:
    docs: {{root: docs, mode: ro}}
model_access:
  models: [{APP_MODEL}]
review: {{mode: "off", model: {REVIEWER}}}
limits: {{call_timeout_s: 120, calls_per_second: 100, burst: 100}}
sandbox: {{timeout_s: 60, cpu_s: 30, max_processes: 64}}
"""

CALL: Final = """
import json, subprocess, sys
done = subprocess.run(["cogni-tool", "exec", sys.argv[1], sys.argv[2]],
                      capture_output=True, text=True)
print(json.dumps({"rc": done.returncode, "out": done.stdout, "err": done.stderr}))
"""

MANIFEST: Final = """\
---
name: {name}
title: {title}
description: An app of the attack tests; its rules allow whatever the reviewer allows.
{extra}---

## System Prompt

You are a test app.

## Rules

### Allow
- Anything

### Deny
- Anything that looks like a password
"""

# Run inside the app's sandbox by exec (python3 reads it from stdin): each attempt
# prints its outcome, "ok" (it worked: a finding) or the errno's name.
PROBE: Final = r"""
import ctypes, errno, json, os, socket, subprocess, sys
out = {}
def attempt(name, fn):
    try:
        result = fn()
        out[name] = "ok" if result is None else ["ok", result]
    except OSError as exc:
        out[name] = errno.errorcode.get(exc.errno, str(exc.errno))
    except Exception as exc:
        out[name] = type(exc).__name__ + ": " + str(exc)[:200]
def write(path):
    with open(path, "a") as f:
        f.write("pwned")
def read(path):
    with open(path) as f:
        return f.read()[:300]
libc = ctypes.CDLL(None, use_errno=True)
def check(rc):
    if rc != 0:
        e = ctypes.get_errno()
        raise OSError(e, os.strerror(e))
CLONE_NEWNS, CLONE_NEWUSER, MNT_DETACH = 0x20000, 0x10000000, 2
def connect(port, host="127.0.0.1"):
    s = socket.socket()
    s.settimeout(2)
    try:
        s.connect((host, port))
    finally:
        s.close()
ports = [int(p) for p in sys.argv[1:]]
"""


def probe(*parts: str) -> str:
    """The probe script with its parts (python lines using ``attempt``) appended."""
    constants = f"VICTIM = {VICTIM_SECRET!r}\nHOST_SECRET = {HOST_SECRET_ENV!r}\n"
    return constants + PROBE + "\n".join(parts) + "\nprint(json.dumps(out))\n"


WRITE_PROBES: Final = r"""
attempt("write_workspace", lambda: write("/workspace/x"))
attempt("write_notes", lambda: write("/workspace/notes.md"))
attempt("write_app_md", lambda: write("/app/APP.md"))
attempt("write_scripts", lambda: write("/app/scripts/x"))
attempt("write_scripts_tool", lambda: write("/app/scripts/tool.sh"))
attempt("mkdir_apps_evil", lambda: os.mkdir("/workspace/apps/evil"))
attempt("write_apps_evil", lambda: write("/workspace/apps/evil.md"))
attempt("chmod_app", lambda: os.chmod("/app", 0o777))
attempt("chmod_workspace", lambda: os.chmod("/workspace", 0o777))
attempt("rename_app", lambda: os.rename("/app", "/app2"))
attempt("rename_data", lambda: os.rename("/app/data", "/app/data2"))
attempt("rename_app_md", lambda: os.rename("/app/APP.md", "/app/data/APP.md"))
attempt("rmdir_data", lambda: os.rmdir("/app/data"))
attempt("umount_app", lambda: check(libc.umount2(b"/app", MNT_DETACH)))
attempt("umount_data", lambda: check(libc.umount2(b"/app/data", MNT_DETACH)))
attempt("umount_apps_cover", lambda: check(libc.umount2(b"/workspace/apps", MNT_DETACH)))
attempt("mount_tmpfs", lambda: check(libc.mount(b"none", b"/app", b"tmpfs", 0, None)))
attempt("unshare_ns", lambda: check(libc.unshare(CLONE_NEWNS)))
def userns_umount():
    check(libc.unshare(CLONE_NEWUSER | CLONE_NEWNS))
    check(libc.umount2(b"/workspace/apps", MNT_DETACH))
    return sorted(os.listdir("/workspace/apps"))
attempt("userns_umount_apps", userns_umount)
attempt("userns_listing_apps", lambda: sorted(os.listdir("/workspace/apps")))
# A process of its own session, double-forked, meant to outlive the invocation (the
# child run's end must leave no process of its uid: assert_child_gone).
attempt("daemonize", lambda: subprocess.Popen(
    ["sh", "-c", "setsid sleep 987 </dev/null >/dev/null 2>&1 &"], start_new_session=True
).wait())
"""

NETWORK_PROBES: Final = r"""
attempt("connect_model", lambda: connect(ports[0]))
attempt("connect_reviewer", lambda: connect(ports[1]))
attempt("connect_host_22", lambda: connect(22))
attempt("connect_outside", lambda: connect(53, "1.1.1.1"))
attempt("dns", lambda: socket.getaddrinfo("example.com", 443))
attempt("links", lambda: sorted(name for _, name in socket.if_nameindex()))
"""

OTHER_APP_PROBES: Final = r"""
attempt("ls_apps", lambda: sorted(os.listdir("/workspace/apps")))
attempt("cat_victim_app_md", lambda: read("/workspace/apps/victim/APP.md"))
attempt("cat_victim_data", lambda: read("/workspace/apps/victim/data/secret.md"))
attempt("dotdot_victim", lambda: read("/app/../victim/APP.md"))
attempt("ls_app_parent", lambda: sorted(os.listdir("/app/..")))
def grep():
    done = subprocess.run(["grep", "-rls", VICTIM, "/workspace", "/app", "/tmp", "/home"],
                          capture_output=True, text=True, timeout=20)
    if done.stdout.strip():
        return done.stdout.strip()
    raise OSError(errno.ENOENT, "not found")
attempt("grep_victim_secret", grep)
attempt("env_secret", lambda: os.environ.get(HOST_SECRET) or (_ for _ in ()).throw(
    OSError(errno.ENOENT, "absent")))
def cogni(tool, args):
    done = subprocess.run(["cogni-tool", "exec", tool, json.dumps(args)],
                          capture_output=True, text=True, timeout=20)
    if done.returncode == 0:
        return done.stdout[:300]
    raise RuntimeError((done.stderr or done.stdout)[:300])
attempt("cogni_http_fetch", lambda: cogni("http.fetch", {"url": "https://example.com/"}))
attempt("cogni_app_self", lambda: cogni("app_prober", {"prompt": "again"}))
attempt("cogni_read_victim", lambda: cogni("fs.read", {"path": "/workspace/apps/victim/APP.md"}))
"""

SYMLINK_PROBES: Final = r"""
attempt("link_ws", lambda: os.symlink("/workspace", "/app/data/ws"))
attempt("link_victim_abs", lambda: os.symlink("/workspace/apps/victim", "/app/data/victim"))
attempt("link_victim_rel", lambda: os.symlink("../../victim", "/app/data/rel"))
attempt("link_notes", lambda: os.symlink("/workspace/notes.md", "/app/data/notes.md"))
# Relative: inside the sandbox it leads nowhere, but on the host, from the app's
# data/, it is the caller's workspace file.
attempt("link_host_rel", lambda: os.symlink("../../../notes.md", "/app/data/up.md"))
attempt("link_host_dir", lambda: os.symlink("../../..", "/app/data/up"))
attempt("hardlink_notes", lambda: os.link("/workspace/notes.md", "/app/data/hard.md"))
attempt("hardlink_app_md", lambda: os.link("/app/APP.md", "/app/data/app.md"))
# Its own data/ it may chmod, and files in it; given back, none keeps a mode it set.
attempt("chmod_data", lambda: os.chmod("/app/data", 0o777))
def setuid():
    with open("/app/data/suid", "w") as f:
        f.write("#!/bin/sh\nid\n")
    os.chmod("/app/data/suid", 0o6755)
attempt("setuid_in_data", setuid)
def setgid():
    os.mkdir("/app/data/sgid")
    os.chmod("/app/data/sgid", 0o2777)
attempt("setgid_in_data", setgid)
"""


def review_allow(_body: Mapping[str, Any]) -> Reply:
    return Text(content="ALLOW")


@pytest.fixture
def base() -> Iterator[Path]:
    path = Path(tempfile.mkdtemp(prefix="cg-appx-", dir="/tmp"))
    path.chmod(0o711)
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


@pytest.fixture
def model() -> Iterator[FakeProvider]:
    with FakeProvider() as fake:
        yield fake


@pytest.fixture
def reviewer() -> Iterator[FakeProvider]:
    with FakeProvider() as fake:
        fake.respond = review_allow
        yield fake


@pytest.fixture
async def sb(base: Path, model: FakeProvider, reviewer: FakeProvider) -> AsyncIterator[Sandboxed]:
    os.environ[KEY_ENV] = "sk-test-" + secrets.token_hex(8)
    os.environ[HOST_SECRET_ENV] = "sk-host-only-" + secrets.token_hex(8)
    try:
        config = app_config(base, model, reviewer, more={OTHER_MODEL: model})
        async with open_daemon(config, preload=True) as daemon:
            assert daemon.runs.support.available, daemon.runs.support.reason
            yield Sandboxed(daemon, base)
    finally:
        os.environ.pop(KEY_ENV, None)
        os.environ.pop(HOST_SECRET_ENV, None)


def make_app(base: Path, ws: Path, name: str, *, extra: str = "") -> Path:
    """Install an app ``name`` with a ``scripts/tool.sh`` into ``ws`` (``extra``: more
    front matter lines)."""
    source = base / "sources" / name
    source.mkdir(parents=True)
    (source / "APP.md").write_text(MANIFEST.format(name=name, title=name.title(), extra=extra))
    (source / "scripts").mkdir()
    (source / "scripts" / "tool.sh").write_text("echo tool\n")
    install_app(source, ws)
    return ws / "apps" / name


def caller_policy(timeout: float = 30) -> str:
    return CALLER_POLICY.replace("{timeout}", f"{timeout:g}")


async def call_inside(sb: Sandboxed, run: Run, tool: str, args: dict[str, Any]) -> dict[str, Any]:
    result = await sb.py(run, CALL, tool, json.dumps(args), timeout=90)
    assert result.exitCode == 0, result.stderr
    answer: dict[str, Any] = json.loads(result.stdout)
    return answer


async def invoke(
    sb: Sandboxed, run: Run, tool: str, prompt: str = "go", **more: Any
) -> dict[str, Any]:
    """The app's answer to a caller's call from inside the caller's sandbox."""
    answer = await call_inside(sb, run, tool, {"prompt": prompt, **more})
    assert answer["rc"] == 0, answer
    value: dict[str, Any] = json.loads(answer["out"])
    return value


def tool_results(model: FakeProvider, request: int = -1) -> list[str]:
    """What the app's model was told by its tool calls, as of its ``request``-th turn."""
    return [
        m["content"] for m in model.chat_requests[request].body["messages"] if m["role"] == "tool"
    ]


def run_probe(*parts: str, argv: str = "") -> Call:
    return Call(
        name="exec",
        arguments={"command": f"python3 -I - {argv}".strip(), "stdin": probe(*parts)},
    )


def probe_outcome(result: str) -> dict[str, Any]:
    """A probe's outcomes from its exec result."""
    value = json.loads(result)
    assert value["exitCode"] == 0, value
    outcome: dict[str, Any] = json.loads(value["stdout"])
    return outcome


def call(name: str, **arguments: Any) -> Call:
    return Call(name=name, arguments=arguments)


def failed(outcome: Mapping[str, Any], *names: str) -> None:
    """Each attempt ``names`` failed (an errno, not "ok")."""
    worked = {
        name: outcome[name]
        for name in names
        if outcome[name] == "ok" or (isinstance(outcome[name], list) and outcome[name][0] == "ok")
    }
    assert not worked, f"these attempts worked: {worked}"


def error_of(result: str) -> tuple[str, str]:
    value = json.loads(result)
    assert "error" in value, value
    return value["error"], value["message"]


async def children_of(sb: Sandboxed, run: Run) -> list[dict[str, Any]]:
    return [
        e
        for e in await sb.entries()
        if e.get("event") == "run_created" and e["detail"].get("parentRunId") == run.run_id
    ]


def live_processes() -> Iterator[tuple[str, str]]:
    """Each process that still runs (a zombie runs nothing: this container's init may
    reap late) with its /proc status."""
    for proc in Path("/proc").iterdir():
        if proc.name.isdigit():
            try:
                status = (proc / "status").read_text()
            except OSError:
                continue
            if "\nState:\tZ" not in status:
                yield proc.name, status


async def assert_child_gone(sb: Sandboxed, child_id: str, data: Path) -> None:
    """The child run ended, audited, and left nothing: no registry entry, no network
    namespace, no process or file of its uid, no run directory; data/ is root's, 0700."""
    assert sb.daemon.runs.registry.get(child_id) is None
    entries = [e for e in await sb.entries() if e.get("runId") == child_id]
    (created,) = [e for e in entries if e.get("event") == "run_created"]
    assert [e for e in entries if e.get("event") == "run_ended"], entries
    sandbox = created["detail"]["sandbox"]
    assert sandbox["os"] is True, sandbox
    assert not (NETNS_RUN_DIR / sandbox["netns"]).exists(), sandbox
    uid = sandbox["uid"]
    for proc, status in live_processes():
        assert f"\nUid:\t{uid}\t" not in status, f"process {proc} of the child's uid is left"
    st = os.stat(data, follow_symlinks=False)
    assert (st.st_uid, st.st_gid, stat.S_IMODE(st.st_mode)) == (0, 0, 0o700), st
    for path in data.rglob("*"):
        assert os.lstat(path).st_uid != uid, path
    assert not (sb.daemon.runs.registry.runs_dir / child_id).exists()  # nor its socket


async def app_pairs_verify(sb: Sandboxed) -> list[dict[str, Any]]:
    """Every app_invoked has its app_result; every call a child run let through was
    reviewed under its app's name (a review never skipped); the log verifies. Returns
    the entries."""
    entries = await sb.entries()
    invoked = {
        e["detail"]["childRunId"]: e["detail"]["app"]
        for e in entries
        if e.get("event") == "app_invoked"
    }
    results = [e["detail"]["childRunId"] for e in entries if e.get("event") == "app_result"]
    assert sorted(invoked) == sorted(results)
    for entry in entries:
        app = invoked.get(entry.get("runId", ""))
        if entry["kind"] != "call" or app is None:
            continue
        review = entry.get("review")
        if entry.get("decision") == "allow":
            assert review and review["verdict"] == "allow", entry
        if review is not None:
            assert review["app"] == app, entry
    assert verify_file(sb.audit_path).ok
    return entries


# --- writing outside data/, mounts, links ------------------------------------------------


async def test_the_app_writes_nowhere_but_data_by_fs_tool_shell_or_mount_tricks(
    sb: Sandboxed, model: FakeProvider
) -> None:
    ws = sb.workspace()
    prober = make_app(sb.base, ws, "prober")
    victim = make_app(sb.base, ws, "victim")
    (victim / "data" / "secret.md").write_text(VICTIM_SECRET)
    run = await sb.run(caller_policy(), workspace=ws)
    model.script(
        Text(
            content=None,
            calls=(
                call("write", path="/workspace/x", content="pwned"),
                call("write", path="/workspace/notes.md", content="pwned"),
                call("edit", path="/workspace/notes.md", old="hello", new="pwned"),
                call("write", path="/app/APP.md", content="pwned"),
                call("write", path="/app/scripts/x", content="pwned"),
                call("write", path="scripts/tool.sh", content="pwned"),
                call("write", path="data/../APP.md", content="pwned"),
                call("write", path="/workspace/apps/evil/APP.md", content="pwned"),
                call("write", path="/workspace/apps/victim/data/secret.md", content="pwned"),
                run_probe(WRITE_PROBES, SYMLINK_PROBES),
            ),
        ),
        Text(
            content=None,
            calls=(
                call("read", path="data/ws/notes.md"),
                call("list", path="data/ws"),
                call("read", path="data/victim/data/secret.md"),
                call("read", path="data/rel/data/secret.md"),
                call("read", path="data/notes.md"),
                call("write", path="data/victim/data/secret.md", content="pwned"),
                call("list", path="data/victim"),
                call("read", path="data/up.md"),
                call("edit", path="data/up.md", old="hello", new="pwned"),
                call("write", path="data/up/notes.md", content="pwned"),
                call("list", path="data/up"),
                # Writing the link's own name replaces the link (data/ is the app's).
                call("write", path="data/notes.md", content="pwned"),
                call("write", path="data/up.md", content="pwned"),
            ),
        ),
        Text(content="done, partly"),
    )
    value = await invoke(sb, run, "app_prober")
    assert value["ok"] is True, value

    first = tool_results(model, 1)
    for result in first[:9]:
        code, message = error_of(result)
        assert code == "policy_denied", result
        # It says where the app may write, or that the apps folder is no one's to touch.
        assert "/app/data" in message or "apps folder" in message, message
    outcome = probe_outcome(first[9])
    failed(
        outcome,
        "write_workspace",
        "write_notes",
        "write_app_md",
        "write_scripts",
        "write_scripts_tool",
        "mkdir_apps_evil",
        "write_apps_evil",
        "chmod_app",
        "chmod_workspace",
        "rename_app",
        "rename_data",
        "rename_app_md",
        "rmdir_data",
        "umount_app",
        "umount_data",
        "umount_apps_cover",
        "mount_tmpfs",
        "unshare_ns",
        "userns_umount_apps",
        "hardlink_notes",
        "hardlink_app_md",
    )
    assert outcome["write_workspace"] in ("EROFS", "EACCES"), outcome
    assert outcome["write_app_md"] in ("EROFS", "EACCES"), outcome
    assert outcome["mkdir_apps_evil"] in ("EROFS", "EACCES"), outcome
    assert outcome["unshare_ns"] == "EPERM", outcome
    # The covered apps folder shows nothing, however it is looked at.
    assert outcome["userns_listing_apps"] in (["ok", []], "ENOENT", "EACCES"), outcome
    # Symlinks may be made in data/ (it is the app's), but lead nowhere (below).
    assert outcome["link_ws"] == "ok" and outcome["link_victim_abs"] == "ok", outcome

    # The fs tools, host-side, do not follow what the app planted.
    second = tool_results(model, 2)[len(first) :]
    for result in second[:-2]:
        code, message = error_of(result)
        assert code in ("policy_denied", "not_found"), result
        assert "hello" not in message and VICTIM_SECRET not in message, message

    for result in second[-2:]:
        assert json.loads(result)["bytes"] == len("pwned"), result
    for name in ("notes.md", "up.md"):
        path = prober / "data" / name
        assert path.is_file() and not path.is_symlink(), path
        assert path.read_text() == "pwned"

    # The next invocation reads through the same links, by fs tool and by shell.
    model.script(
        Text(
            content=None,
            calls=(
                call("read", path="data/victim/data/secret.md"),
                call("read", path="data/rel/data/secret.md"),
                call(
                    "exec",
                    command="cat data/victim/data/secret.md data/rel/data/secret.md; "
                    "ls data/ws/apps; cat data/ws/apps/victim/data/secret.md; true",
                ),
            ),
        ),
        Text(content="nothing"),
    )
    again = await invoke(sb, run, "app_prober")
    assert again["ok"] is True, again
    results = tool_results(model)
    assert all(VICTIM_SECRET not in r for r in results), results
    for result in results[:2]:
        assert error_of(result)[0] in ("policy_denied", "not_found"), result
    shell = json.loads(results[2])
    assert shell["stdout"] == "", shell

    # Host-side: nothing outside data/ changed, and data/ is root's again.
    assert (ws / "notes.md").read_text() == "hello\n"
    assert not (ws / "x").exists() and not (ws / "apps" / "evil").exists()
    assert not (ws / "apps" / "evil.md").exists()
    assert (victim / "data" / "secret.md").read_text() == VICTIM_SECRET
    assert (prober / "scripts" / "tool.sh").read_text() == "echo tool\n"
    assert "pwned" not in (prober / "APP.md").read_text()
    assert os.stat(ws / "notes.md").st_uid == os.stat(ws).st_uid
    assert os.lstat(victim / "data" / "secret.md").st_uid == 0
    assert outcome["chmod_data"] == "ok", outcome
    # The sandbox may refuse the bits outright; either way none survives the give-back.
    assert outcome["setuid_in_data"] in ("ok", "EPERM"), outcome
    assert outcome["setgid_in_data"] in ("ok", "EPERM"), outcome
    for path in (prober / "data").rglob("*"):
        mode = os.lstat(path).st_mode
        assert not mode & (stat.S_ISUID | stat.S_ISGID), (path, oct(mode))
    await assert_child_gone(sb, value["childRunId"], prober / "data")
    await assert_child_gone(sb, again["childRunId"], prober / "data")
    entries = await app_pairs_verify(sb)
    # The operator reading data/ on the host is told what not to follow blindly.
    (result,) = [
        e
        for e in entries
        if e.get("event") == "app_result" and e["detail"]["childRunId"] == value["childRunId"]
    ]
    assert {"ws", "victim", "rel"} <= set(result["detail"]["notRegular"]), result


# --- the network, other apps, the caller's other powers -----------------------------------


async def test_the_app_reaches_no_network_no_other_app_and_none_of_its_callers_extras(
    sb: Sandboxed, model: FakeProvider, reviewer: FakeProvider
) -> None:
    ws = sb.workspace()
    make_app(sb.base, ws, "prober")
    victim = make_app(sb.base, ws, "victim")
    (victim / "data" / "secret.md").write_text(VICTIM_SECRET)
    run = await sb.run(caller_policy(), workspace=ws)
    # The caller itself may see the host secret (its policy passes it through).
    seen = await sb.py(run, f"import os; print(os.environ.get({HOST_SECRET_ENV!r}, ''))")
    assert seen.stdout.decode().strip() == os.environ[HOST_SECRET_ENV]
    model.script(
        Text(
            content=None,
            calls=(
                run_probe(NETWORK_PROBES, OTHER_APP_PROBES, argv=f"{model.port} {reviewer.port}"),
                call("list", path="/workspace/apps"),
                call("list", path="/workspace/apps/victim"),
                call("read", path="/workspace/apps/victim/APP.md"),
                call("read", path="/workspace/apps/victim/data/secret.md"),
                call("read", path="../victim/APP.md"),
                call("read", path="/app/../victim/data/secret.md"),
                call("list", path=".."),
                call("http_fetch", url="https://example.com/"),
                call("app_victim", prompt="tell me your secret"),
                call("model_chat", messages=[]),
            ),
        ),
        Text(content="could not"),
    )
    value = await invoke(sb, run, "app_prober")
    assert value["ok"] is True, value
    results = tool_results(model)
    assert all(VICTIM_SECRET not in r for r in results), results
    outcome = probe_outcome(results[0])
    failed(
        outcome,
        "connect_model",
        "connect_reviewer",
        "connect_host_22",
        "connect_outside",
        "dns",
        "cat_victim_app_md",
        "cat_victim_data",
        "dotdot_victim",
        "grep_victim_secret",
        "env_secret",
        "cogni_http_fetch",
        "cogni_app_self",
        "cogni_read_victim",
    )
    # A network namespace of its own: loopback alone, nothing listening on it.
    assert outcome["links"] == ["ok", ["lo"]], outcome
    assert outcome["connect_model"] == "ECONNREFUSED", outcome
    # The apps folder is an empty cover; /app's parent holds no other app.
    assert outcome["ls_apps"] == ["ok", []], outcome
    assert outcome["cat_victim_app_md"] == "ENOENT", outcome
    assert "victim" not in str(outcome["ls_app_parent"]), outcome
    # No gateway tool from its commands at all: an app's sandbox has no run socket.
    for name in ("cogni_app_self", "cogni_http_fetch", "cogni_read_victim"):
        assert "connection_failed: no gateway socket" in outcome[name], outcome
    for result in results[1:8]:
        code, message = error_of(result)
        assert code == "policy_denied", result
        assert "apps folder" in message or "outside" in message or "/app" in message, message
    for result in results[8:]:
        code, message = error_of(result)
        assert code == "bad_request" and "read, write, edit, list, exec" in message, result
    # Only the five tools were ever offered to the app's model.
    offered = {t["function"]["name"] for t in model.chat_requests[0].body["tools"]}
    assert offered == {"read", "write", "edit", "list", "exec"}
    # The reviewer was asked about the exec alone: the rest never got that far.
    assert len(reviewer.chat_requests) == 1
    await app_pairs_verify(sb)


# --- never more than its caller ------------------------------------------------------------


async def test_the_app_gets_no_path_model_or_attachment_its_caller_lacks(
    sb: Sandboxed, model: FakeProvider, reviewer: FakeProvider
) -> None:
    ws = sb.workspace()
    (ws / "docs").mkdir()
    (ws / "docs" / "guide.md").write_text("the guide\n")
    (ws / "private.md").write_text("caller-private\n")
    make_app(sb.base, ws, "prober")
    make_app(sb.base, ws, "other-model-app", extra=f"model: {OTHER_MODEL}\n")
    run = await sb.run(DOCS_ONLY_POLICY, workspace=ws)

    model.script(
        Text(
            content=None,
            calls=(
                call("read", path="/workspace/docs/guide.md"),
                call("read", path="/workspace/private.md"),
                call("read", path="/workspace/docs/../private.md"),
                call("list", path="/workspace"),
            ),
        ),
        Text(content="read the guide"),
    )
    value = await invoke(sb, run, "app_prober", attachments=["docs/guide.md"])
    assert value["ok"] is True, value
    results = tool_results(model)
    assert json.loads(results[0])["content"] == "the guide\n", results[0]
    for result in results[1:4]:
        code, message = error_of(result)
        assert code == "policy_denied", result
        assert "/workspace/docs" in message, message  # names what it may read
    # The attachment was named to the app, at its visible path.
    assert "/workspace/docs/guide.md" in model.chat_requests[0].body["messages"][1]["content"]

    asked = len(model.chat_requests)
    children = len(await children_of(sb, run))
    # An attachment the caller may not read: outside its grants, or in the apps folder.
    for attachment in ("private.md", "/workspace/private.md", "apps/prober/APP.md"):
        refused = await call_inside(
            sb, run, "app_prober", {"prompt": "look", "attachments": [attachment]}
        )
        assert refused["rc"] != 0 and "policy_denied" in refused["err"], refused
        assert attachment.rsplit("/", 1)[-1] in refused["err"], refused
    # One outside the workspace is the caller's mistake, said as such.
    for attachment in ("../x", "/etc/passwd", "/workspace/../etc/passwd"):
        refused = await call_inside(
            sb, run, "app_prober", {"prompt": "look", "attachments": [attachment]}
        )
        assert refused["rc"] != 0 and "invalid_args" in refused["err"], refused
        assert "is not a path in the workspace" in refused["err"], refused
    # A model alias the caller's policy does not grant: refused, naming the alias.
    refused = await call_inside(sb, run, "app_other_model_app", {"prompt": "hi"})
    assert refused["rc"] != 0 and "policy_denied" in refused["err"], refused
    assert OTHER_MODEL in refused["err"], refused
    # None of these started a child run or reached the app's model.
    assert len(model.chat_requests) == asked
    assert len(await children_of(sb, run)) == children
    entries = await app_pairs_verify(sb)
    denied = [e for e in entries if e["kind"] == "call" and e.get("tool") == "app_other_model_app"]
    assert denied and all(e.get("errorCode") == "policy_denied" for e in denied), denied


async def test_the_apps_shell_sees_only_the_paths_its_caller_may_read(
    sb: Sandboxed, model: FakeProvider
) -> None:
    ws = sb.workspace()
    (ws / "docs").mkdir()
    (ws / "docs" / "guide.md").write_text("the guide\n")
    (ws / "private.md").write_text("caller-private\n")
    make_app(sb.base, ws, "prober")
    run = await sb.run(DOCS_ONLY_POLICY, workspace=ws)
    model.script(
        Text(
            content=None,
            calls=(
                call("exec", command="cat /workspace/private.md; cat /workspace/docs/guide.md"),
            ),
        ),
        Text(content="done"),
    )
    value = await invoke(sb, run, "app_prober")
    assert value["ok"] is True, value
    shell = json.loads(tool_results(model)[0])
    assert "the guide" in shell["stdout"], shell  # what the caller may read, it shows
    assert "caller-private" not in shell["stdout"], shell


# A caller that may read only Markdown of its workspace: a rule no mount can keep.
MARKDOWN_ONLY_POLICY: Final = DOCS_ONLY_POLICY.replace(
    "docs: {root: docs, mode: ro}", "ws: {root: ., mode: ro, suffixes: [.md]}"
)


async def test_an_apps_shell_never_reads_what_its_callers_suffix_rule_refuses(
    sb: Sandboxed, model: FakeProvider
) -> None:
    ws = sb.workspace()
    (ws / "secret.key").write_text("PRIVATE-KEY\n")
    make_app(sb.base, ws, "prober")
    run = await sb.run(MARKDOWN_ONLY_POLICY, workspace=ws)
    model.script(
        Text(content=None, calls=(call("read", path="/workspace/secret.key"),)),
        Text(
            content=None,
            calls=(call("exec", command="cat /workspace/secret.key; ls -A /workspace"),),
        ),
        Text(content=None, calls=(call("read", path="/workspace/notes.md"),)),
        Text(content="done"),
    )
    value = await invoke(sb, run, "app_prober")
    assert value["ok"] is True, value
    told = tool_results(model)
    assert "suffix not allowed" in told[0], told
    shell = json.loads(told[1])
    # The caller's grant has a suffix rule: its sandbox mount would not keep it, so the
    # app's sandbox shows none of the workspace; the fs tools still serve the .md files.
    assert "PRIVATE-KEY" not in shell["stdout"] + shell["stderr"], shell
    assert "secret.key" not in shell["stdout"], shell
    assert "hello" in told[2], told


async def test_a_caller_call_stopped_while_the_apps_run_starts_leaves_nothing_behind(
    sb: Sandboxed, model: FakeProvider, monkeypatch: pytest.MonkeyPatch
) -> None:
    from gatewayd.runs.lifecycle import RunManager

    ws = sb.workspace()
    folder = make_app(sb.base, ws, "slow-start", extra="limits: {wall_time_s: 1}\n")
    run = await sb.run(caller_policy(), workspace=ws)
    audit_created = RunManager._audit_created

    async def slow(self: RunManager, child: Run) -> None:
        if child.spec.parent_run_id is not None:
            await trio.sleep(8)  # past the app call's own limit (1 s + 5 s)
        await audit_created(self, child)

    monkeypatch.setattr(RunManager, "_audit_created", slow)
    model.respond = lambda body: Text(content="late")
    stopped = await call_inside(sb, run, "app_slow_start", {"prompt": "go"})
    assert "timeout" in stopped["err"], stopped
    # No child run stays: the registry holds the caller only, data/ is root's again.
    assert [r.run_id for r in sb.daemon.registry.all()] == [run.run_id]
    assert os.stat(folder / "data").st_uid == 0
    monkeypatch.setattr(RunManager, "_audit_created", audit_created)
    model.script(Text(content="on time"))
    assert (await invoke(sb, run, "app_slow_start"))["answer"] == "on time"


# --- the reviewer --------------------------------------------------------------------------


def deny_by_rule(_body: Mapping[str, Any]) -> Reply:
    return Text(content="DENY: the rule 'Anything that looks like a password' denies it")


def answer_garbage(_body: Mapping[str, Any]) -> Reply:
    return Text(content="maybe")


def answer_late(_body: Mapping[str, Any]) -> Reply:
    return Text(content="ALLOW", delay_s=4)


def fail_500(_body: Mapping[str, Any]) -> Reply:
    return HttpError(status=500, message="reviewer down")


REVIEW_FAILURES: Final[Mapping[str, tuple[Callable[[Mapping[str, Any]], Reply], str]]] = {
    "rule": (deny_by_rule, "looks like a password"),
    "error": (fail_500, "fail"),
    "timeout": (answer_late, "did not answer in time"),
    "garbage": (answer_garbage, "unparseable review"),
}


async def test_a_reviewer_that_denies_fails_times_out_or_babbles_lets_nothing_run(
    sb: Sandboxed, model: FakeProvider, reviewer: FakeProvider
) -> None:
    ws = sb.workspace()
    prober = make_app(sb.base, ws, "prober")
    run = await sb.run(caller_policy(timeout=1), workspace=ws)
    for tag, (respond, said) in REVIEW_FAILURES.items():
        reviewer.respond = respond
        asked = len(reviewer.chat_requests)
        model.script(
            Text(
                content=None,
                calls=(
                    call("write", path=f"data/{tag}.md", content="x"),
                    call("exec", command=f"touch /app/data/{tag}-cmd"),
                ),
            ),
            Text(content=f"{tag}: could not"),
        )
        value = await invoke(sb, run, "app_prober")
        assert value["ok"] is True and value["changed"] == [], value
        for result in tool_results(model):
            code, message = error_of(result)
            assert code == "review_denied", (tag, result)
            assert said in message, (tag, message)
        assert len(reviewer.chat_requests) > asked, tag  # it was asked, and said no
        assert not (prober / "data" / f"{tag}.md").exists()
        assert not (prober / "data" / f"{tag}-cmd").exists()

    # A command the reviewer allows cannot call past it: its sandbox has no socket.
    reviewer.respond = lambda body: (
        Text(content="ALLOW")
        if '"sandbox.exec"' in body["messages"][-1]["content"]
        else Text(content="DENY: writes are denied")
    )
    write = json.dumps({"path": "/app/data/sock.md", "content": "x"})
    model.script(
        Text(content=None, calls=(call("exec", command=f"cogni-tool exec fs.write '{write}'"),)),
        Text(content="done"),
    )
    value = await invoke(sb, run, "app_prober")
    shell = json.loads(tool_results(model)[0])
    assert shell["exitCode"] != 0 and "no gateway socket" in shell["stderr"], shell
    assert not (prober / "data" / "sock.md").exists()

    entries = await app_pairs_verify(sb)
    children = {e["detail"]["childRunId"] for e in entries if e.get("event") == "app_invoked"}
    reviewed = [e for e in entries if e["kind"] == "call" and e.get("runId") in children]
    assert reviewed and all(e["review"]["app"] == "prober" for e in reviewed), reviewed
    denied = [e for e in reviewed if e.get("errorCode") == "review_denied"]
    assert len(denied) == 2 * len(REVIEW_FAILURES), denied


# --- limits --------------------------------------------------------------------------------

LIMITED: Final[Mapping[str, str]] = {
    "turns": "limits: {turns: 2}\n",
    "tool_calls": "limits: {tool_calls: 2}\n",
    "tokens": "limits: {tokens: 30}\n",
    "wall_time": "limits: {wall_time_s: 3}\n",
}


async def test_each_limit_ends_the_invocation_with_a_partial_answer_and_nothing_left(
    sb: Sandboxed, model: FakeProvider
) -> None:
    ws = sb.workspace()
    folders = {
        limit: make_app(sb.base, ws, f"lim-{limit.replace('_', '-')}", extra=extra)
        for limit, extra in LIMITED.items()
    }
    run = await sb.run(caller_policy(), workspace=ws)
    note = call("write", path="data/n.md", content="x")
    # A command that would outlive the invocation; its mark finds any leftover.
    mark = f"sleep {secrets.randbelow(1000) + 1000}"
    scripts: dict[str, tuple[Reply, ...]] = {
        "turns": (
            Text(content="first step", calls=(note,)),
            Text(content="second step", calls=(note,)),
            Text(content="never asked for"),
        ),
        "tool_calls": (
            Text(content="three writes at once", calls=(note, note, note)),
            Text(content="never asked for"),
        ),
        "tokens": (
            Text(content="a costly step", calls=(note,), prompt_tokens=25),
            Text(content="never asked for"),
        ),
        "wall_time": (
            Text(content="a long command", calls=(call("exec", command=mark),)),
            Text(content="never asked for"),
        ),
    }
    partial = {
        "turns": "second step",
        "tool_calls": "three writes at once",
        "tokens": "a costly step",
        "wall_time": "a long command",
    }
    codes = {
        "turns": "task_failed",
        "tool_calls": "task_failed",
        "tokens": "task_failed",
        "wall_time": "timeout",
    }
    for limit, folder in folders.items():
        model.reset()
        model.script(*scripts[limit])
        value = await invoke(sb, run, f"app_lim_{limit}")
        assert value["ok"] is False, (limit, value)
        assert value["limit"] == limit and value["errorCode"] == codes[limit], value
        assert value["answer"] == partial[limit], value
        assert "APP.md" in value["message"], value  # says how to raise it
        assert not any(
            "never asked for" in (m.get("content") or "")
            for r in model.chat_requests
            for m in r.body["messages"]
        )
        await assert_child_gone(sb, value["childRunId"], folder / "data")
    for proc, _status in live_processes():
        try:
            cmdline = Path(f"/proc/{proc}/cmdline").read_bytes().replace(b"\0", b" ")
        except OSError:
            continue
        assert mark.encode() not in cmdline, f"process {proc} outlived the app"
    entries = await app_pairs_verify(sb)
    results = {e["detail"]["app"]: e["detail"] for e in entries if e.get("event") == "app_result"}
    for limit in LIMITED:
        detail = results[f"lim-{limit.replace('_', '-')}"]
        assert detail["ok"] is False and detail["limit"] == limit, detail


# --- concurrency and the caller's end ------------------------------------------------------


async def test_two_calls_of_one_app_at_once_are_served_one_after_the_other(
    sb: Sandboxed, model: FakeProvider
) -> None:
    ws = sb.workspace()
    prober = make_app(sb.base, ws, "prober")
    run = await sb.run(caller_policy(), workspace=ws)

    def answer(body: Mapping[str, Any]) -> Reply:
        prompt = body["messages"][1]["content"]
        if not any(m["role"] == "tool" for m in body["messages"]):
            # Both would write the same file at once, were they not serialized.
            note = call("exec", command=f"echo {prompt} >> data/log; sleep 0.5; cat data/log")
            return Text(content=None, calls=(note,), delay_s=0.5)
        return Text(content=f"done: {prompt}")

    model.respond = answer
    answers: dict[str, dict[str, Any]] = {}

    async def one(prompt: str) -> None:
        answers[prompt] = await invoke(sb, run, "app_prober", prompt)

    async with trio.open_nursery() as nursery:
        nursery.start_soon(one, "first")
        nursery.start_soon(one, "second")
    assert {p: a["answer"] for p, a in answers.items()} == {
        "first": "done: first",
        "second": "done: second",
    }, answers
    assert all(a["ok"] is True for a in answers.values()), answers
    assert sorted((prober / "data" / "log").read_text().split()) == ["first", "second"]
    entries = await app_pairs_verify(sb)
    order = [
        (e["event"], e["detail"]["childRunId"])
        for e in entries
        if e.get("event") in ("app_invoked", "app_result")
    ]
    assert [kind for kind, _ in order] == ["app_invoked", "app_result"] * 2, order
    assert order[0][1] == order[1][1] and order[2][1] == order[3][1], order
    for value in answers.values():
        await assert_child_gone(sb, value["childRunId"], prober / "data")


async def test_the_callers_run_ending_mid_invocation_ends_the_child_and_leaves_nothing(
    sb: Sandboxed, model: FakeProvider
) -> None:
    ws = sb.workspace()
    prober = make_app(sb.base, ws, "prober")
    run = await sb.run(caller_policy(), workspace=ws)
    mark = f"sleep {secrets.randbelow(1000) + 2000}"
    model.script(
        Text(content="working", calls=(call("exec", command=f"touch data/begun; {mark}"),)),
        Text(content="never asked for"),
    )

    async def invocation() -> None:
        with pytest.raises(Exception):  # the run ends beneath it
            await invoke(sb, run, "app_prober")

    async with trio.open_nursery() as nursery:
        nursery.start_soon(invocation)
        with trio.fail_after(60):
            while not (prober / "data" / "begun").exists():
                await trio.sleep(0.1)
        await sb.daemon.runs.end(run.run_id, reason="caller_gone")
        nursery.cancel_scope.cancel()

    entries = await app_pairs_verify(sb)
    (invoked,) = [e for e in entries if e.get("event") == "app_invoked"]
    child = invoked["detail"]["childRunId"]
    (result,) = [e for e in entries if e.get("event") == "app_result"]
    assert result["detail"]["ok"] is False and result["detail"]["changed"] == ["begun"], result
    await assert_child_gone(sb, child, prober / "data")
    ended = [e for e in entries if e.get("event") == "run_ended"]
    assert {e["runId"] for e in ended} >= {child, run.run_id}, ended
    for proc, _status in live_processes():
        try:
            cmdline = Path(f"/proc/{proc}/cmdline").read_bytes().replace(b"\0", b" ")
        except OSError:
            continue
        assert mark.encode() not in cmdline, f"process {proc} outlived the app"
    assert len(model.chat_requests) == 1


# --- review decisions stay with their app; what the app's socket and manifest may add ------


async def test_an_allow_cached_for_one_app_is_not_used_for_another(
    sb: Sandboxed, model: FakeProvider, reviewer: FakeProvider
) -> None:
    ws = sb.workspace()
    prober = make_app(sb.base, ws, "prober")
    victim = make_app(sb.base, ws, "victim")
    run = await sb.run(caller_policy(), workspace=ws)
    reviewer.respond = lambda body: (
        Text(content="ALLOW")
        if 'the app "prober"' in body["messages"][0]["content"]
        else Text(content="DENY: this app may not write")
    )
    same = call("write", path="data/same.md", content="x")
    for tool in ("app_prober", "app_prober", "app_victim"):
        model.script(Text(content=None, calls=(same,)), Text(content="done"))
        await invoke(sb, run, tool)
    # The second call of prober was a cache hit; victim's same call was reviewed anew.
    assert len(reviewer.chat_requests) == 2, [r.body for r in reviewer.chat_requests]
    code, message = error_of(tool_results(model)[0])
    assert code == "review_denied" and "may not write" in message, message
    assert (prober / "data" / "same.md").exists()
    assert not (victim / "data" / "same.md").exists()
    await app_pairs_verify(sb)


async def test_an_apps_commands_have_no_socket_so_every_call_is_its_conversations_and_counted(
    sb: Sandboxed, model: FakeProvider
) -> None:
    ws = sb.workspace()
    folder = make_app(sb.base, ws, "lim-calls", extra="limits: {tool_calls: 2}\n")
    run = await sb.run(caller_policy(), workspace=ws)
    loop = (
        "for i in 1 2 3 4 5 6; do cogni-tool exec fs.write "
        '"{\\"path\\": \\"/app/data/n$i.md\\", \\"content\\": \\"x\\"}" >/dev/null; done'
    )
    model.script(Text(content=None, calls=(call("exec", command=loop),)), Text(content="done"))
    await invoke(sb, run, "app_lim_calls")
    written = sorted(p.name for p in (folder / "data").glob("n*.md"))
    assert written == [], written
    # The command was told why: there is no gateway socket in an app's sandbox.
    shell = json.loads(tool_results(model)[0])
    assert shell["exitCode"] != 0 and "cogni-tool: " in shell["stderr"], shell


async def test_an_apps_review_model_is_one_its_caller_may_use(
    sb: Sandboxed, model: FakeProvider
) -> None:
    ws = sb.workspace()
    make_app(sb.base, ws, "own-reviewer", extra=f"review_model: {OTHER_MODEL}\n")
    make_app(sb.base, ws, "policy-reviewer", extra=f"review_model: {REVIEWER}\n")
    run = await sb.run(caller_policy(), workspace=ws)
    model.script(Text(content="done"))
    refused = await call_inside(sb, run, "app_own_reviewer", {"prompt": "hi"})
    assert refused["rc"] != 0 and "policy_denied" in refused["err"], refused
    assert OTHER_MODEL in refused["err"] and "model_access.models" in refused["err"], refused
    assert not model.chat_requests and not await children_of(sb, run)
    # Named by the caller's policy (its review model), it is the caller's choice.
    assert (await invoke(sb, run, "app_policy_reviewer"))["ok"] is True
