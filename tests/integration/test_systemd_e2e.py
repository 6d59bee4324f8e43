"""gatewayd as an operator runs it: installed the documented way (``make install``) and
started by a real systemd, in a box (tests/systemdbox.py: systemd as PID 1 in a container
made from this host's /usr), under the very unit that ships.

One box for the module: install, configure, ``systemctl start``. One test then goes
through the phases as subtests (one test: one xdist worker, one install); each phase
makes its own run on its own workspace and leaves the service running, so no phase
depends on what an earlier one did. Everything is observed from outside the daemon, as an operator would:
systemctl, the control socket (curl), ``gatewayd exec`` into the run's OS sandbox where
``cogni-tool`` calls, the journal, ``gatewayd audit verify`` and the audit log itself,
``/proc``, ``/run/netns`` and the mount tables.

Skipped only when the box cannot boot here (not root, no systemd-nspawn, the tool
missing, or nspawn failing); the reason is in the skip message.
"""

from __future__ import annotations

import json
import re
import secrets
import subprocess
import time
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, Final

import pytest
import yaml

from tests.systemdbox import (
    Box,
    BoxCommandFailed,
    BoxUnavailable,
    box_name,
    start_box,
    stop_box,
    stop_stale_boxes,
    unavailable_reason,
)

pytestmark = pytest.mark.skipif(unavailable_reason() is not None, reason=str(unavailable_reason()))

VENV: Final = "/opt/gatewayd/venv"
GATEWAYD: Final = f"{VENV}/bin/gatewayd"
STATE: Final = "/var/lib/gatewayd"
CONTROL_SOCKET: Final = f"{STATE}/control.sock"
AUDIT_LOG: Final = f"{STATE}/audit/audit.jsonl"
POLICY_DIR: Final = "/etc/gatewayd/policies"
# The workspaces live beneath a lendable root outside what the unit hides (ProtectHome,
# PrivateTmp): /home, /tmp and /var/tmp are not the daemon's to see.
WORKSPACES: Final = "/srv/workspaces"
# Outside every route (RFC 5737 TEST-NET-2): a connection attempt proves the way is shut.
OUTSIDE_V4: Final = "198.51.100.1"
# A hardened host's root umask (CIS benchmarks): files root makes are its own only.
ROOT_UMASK_HARDENED: Final = 0o077
# make install builds a wheel and installs it with its dependencies (~40 s here).
INSTALL_TIMEOUT_S: Final = 600.0
# systemd's stop waits up to the unit's TimeoutStopSec (90 s) before SIGKILL.
STOP_TIMEOUT_S: Final = 120.0
# How long the reload phase's caller keeps calling; the three reloads (a few seconds on a
# busy machine) happen inside it.
LOAD_SECONDS: Final = 10.0
# How long the restart test watches the control socket's path around the kill.
WATCH_SECONDS: Final = 6.0

# What the operator adds to the starting configuration `make install` wrote: the site's
# policy directory, and a uid range of its own per box (uids are the kernel's, shared by
# every box on this host, while each box's daemon would derive the same default range
# from the same state directory). The starting file already names the workspace root.
CONFIG_ADDED: Final = """\
policy_dirs: [{policies}]
sandbox_uids: {{base: {base}, count: 64}}
"""
# Far above the ranges gatewayd derives (systemd's container range ends at 1879048191)
# and the test daemons' (tests/livedaemon.py), 64 uids each.
UID_BASE: Final = 1_900_000_000
UID_SLOTS: Final = 40_000

POLICY: Final = """\
version: 1
name: {name}
tools:
  allow: [{tools}]
filesystem:
  paths:
    workspace: {{root: ., mode: ro}}
limits: {{calls_per_second: 100000, burst: 100000, max_concurrent_calls: 64}}
"""

# Calls time.now in a loop from inside the run's sandbox for argv[1] seconds, with
# gatewayd's copy of the client (/opt/cogni-tool there); prints what happened as JSON.
LOAD: Final = """
import json, sys, time
sys.path.insert(0, "/opt/cogni-tool")
from cogni_tool.client import Client, CogniToolError, ToolError
client = Client(timeout=30)
answered, failures = 0, []
end = time.monotonic() + float(sys.argv[1])
while time.monotonic() < end:
    try:
        client.call("time.now")
        answered += 1
    except ToolError as exc:
        failures.append(f"{exc.code}: {exc.safe_message}")
    except CogniToolError as exc:
        failures.append(f"lost: {exc}")
        break
print(json.dumps({"answered": answered, "failures": failures}))
"""

# Watches the control socket's path for argv[1] seconds from the box (the host side): its
# inode every 2 ms, and a health request every 100 ms, whose connect must always succeed
# (a request the crashed daemon had taken may be cut); prints what it saw as JSON.
WATCH: Final = """
import http.client, json, os, socket, sys, time
path = sys.argv[2]
inodes, missing, answers, refused, cut = [], 0, [], [], []
end = time.monotonic() + float(sys.argv[1])
next_request = 0.0
while time.monotonic() < end:
    try:
        inode = os.stat(path).st_ino
        if not inodes or inodes[-1] != inode:
            inodes.append(inode)
    except FileNotFoundError:
        missing += 1
    if time.monotonic() >= next_request:
        next_request = time.monotonic() + 0.1
        conn = http.client.HTTPConnection("gatewayd", timeout=60)
        conn.sock = socket.socket(socket.AF_UNIX)
        conn.sock.settimeout(60)
        try:
            conn.sock.connect(path)
        except OSError as exc:
            refused.append(repr(exc))
            conn.close()
            continue
        try:
            conn.request("GET", "/v1/health")
            answers.append(conn.getresponse().status)
        except (OSError, http.client.HTTPException) as exc:
            cut.append(repr(exc))
        conn.close()
    time.sleep(0.002)
print(json.dumps({"inodes": inodes, "missing": missing, "answers": answers,
                  "refused": refused, "cut": cut}))
"""


def install_gatewayd(box: Box) -> None:
    """Install gatewayd in the box the way docs/operations.md tells an operator to:
    ``make install`` in the checkout, as root (the venv in /opt, the box's own tmpfs).
    Under root's umask 077, as on CIS-hardened hosts: the install must still leave the
    virtualenv readable to the service user (install-systemd refuses it otherwise)."""
    box.sh(f"umask {ROOT_UMASK_HARDENED:03o}; exec make install", timeout=INSTALL_TIMEOUT_S)


@dataclass
class Service:
    """gatewayd.service in a box, seen the way its operator sees it."""

    box: Box
    uid_base: int

    def show(self, *properties: str, unit: str = "gatewayd.service") -> dict[str, str]:
        out = self.box.run("systemctl", "show", "-p", ",".join(properties), unit).stdout
        return dict(line.split("=", 1) for line in out.splitlines() if "=" in line)

    def main_pid(self) -> int:
        return int(self.show("MainPID")["MainPID"])

    def wait_active(self, *, other_than: int = 0, timeout: float = 60.0) -> int:
        """Wait until the service is active (running) with a main pid other than
        ``other_than``; returns that pid."""
        deadline = time.monotonic() + timeout
        while True:
            state = self.show("ActiveState", "SubState", "MainPID")
            pid = int(state["MainPID"])
            if (state["ActiveState"], state["SubState"]) == ("active", "running") and pid not in (
                0,
                other_than,
            ):
                return pid
            if time.monotonic() > deadline:
                raise AssertionError(
                    f"gatewayd not active (running): {state}\n{self.journal_text()}"
                )
            time.sleep(0.1)

    def ensure_running(self) -> None:
        """Start the service again if a phase left it stopped or failed."""
        if self.show("ActiveState")["ActiveState"] != "active":
            self.box.run("systemctl", "reset-failed", "gatewayd", check=False)
            self.box.run("systemctl", "start", "gatewayd", timeout=120)
        self.wait_active()

    def control(self, method: str, target: str, body: Any = None) -> tuple[int, Any]:
        """A request on the control socket with curl, as the docs show it."""
        argv = ["curl", "-sS", "--unix-socket", CONTROL_SOCKET, "-X", method]
        argv += ["-w", "\n%{http_code}", f"http://gatewayd{target}"]
        if body is not None:
            argv += ["-H", "content-type: application/json", "--data-binary", "@-"]
        done = self.box.run(*argv, input=json.dumps(body) if body is not None else None)
        text, _, status = done.stdout.rpartition("\n")
        return int(status), json.loads(text) if text.strip() else None

    def write_policy(self, name: str, tools: str) -> None:
        self.box.write(f"{POLICY_DIR}/{name}.yaml", POLICY.format(name=name, tools=tools))

    def create_run(self, name: str, tools: str = "fs.read, fs.list, time.now") -> dict[str, Any]:
        """A run of policy ``name`` (written with ``tools``) on its own workspace."""
        self.write_policy(name, tools)
        workspace = f"{WORKSPACES}/{name}"
        self.box.write(f"{workspace}/notes.md", f"notes of {name}\n")
        status, data = self.control(
            "POST",
            "/v1/runs",
            {
                "workspacePath": workspace,
                "policy": name,
                "actorId": "alice",
                "tenantId": "acme",
                "grant": {"allowSandbox": True},
            },
        )
        assert status == 201, data
        run: dict[str, Any] = data["run"]
        assert run["osSandbox"] is True and run["degraded"] is None, run
        return run

    def exec(
        self, run_id: str, *argv: str, timeout: float = 60.0
    ) -> subprocess.CompletedProcess[str]:
        """``gatewayd exec RUN -- argv`` in the run's sandbox; its CompletedProcess."""
        return self.box.run(GATEWAYD, "exec", run_id, "--", *argv, check=False, timeout=timeout)

    def audit(self) -> list[dict[str, Any]]:
        return [json.loads(line) for line in self.box.read(AUDIT_LOG).splitlines() if line]

    def verify(self) -> str:
        done = self.box.run(GATEWAYD, "audit", "verify", AUDIT_LOG, check=False)
        assert done.returncode == 0, done.stdout + done.stderr
        return done.stdout

    def wait_for_entry(
        self, match: Callable[[dict[str, Any]], bool], timeout: float = 30.0
    ) -> dict[str, Any]:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            found = [e for e in self.audit() if match(e)]
            if found:
                return found[-1]
            time.sleep(0.1)
        raise AssertionError("no such entry in the audit log")

    def journal(self) -> list[dict[str, Any]]:
        out = self.box.run("journalctl", "-u", "gatewayd", "-o", "json", "--no-pager").stdout
        return [json.loads(line) for line in out.splitlines() if line]

    def journal_text(self) -> str:
        return self.box.run(
            "journalctl", "-u", "gatewayd", "--no-pager", "-n", "40", check=False
        ).stdout

    def sandbox_uid(self, run_id: str) -> int:
        """The run's uid on the host (inside, a user namespace maps it to 1000): the peer
        of a call from its sandbox, as the audit log records it."""
        done = self.exec(run_id, "cogni-tool", "exec", "time.now")
        assert done.returncode == 0, done.stderr
        entry = self.wait_for_entry(lambda e: e.get("runId") == run_id and e["kind"] == "call")
        uid: int = entry["peer"]["uid"]
        return uid

    def leftovers(self, run_id: str, uid: int) -> list[str]:
        """What of the run is still on the box: its directory (socket, lease record), its
        network namespace, mounts naming it (the box's and the service's mount
        namespaces), cgroups naming it, processes of its uid."""
        found = [
            path
            for path in (f"{STATE}/runs/{run_id}", f"{STATE}/runs/{run_id}/gateway.sock")
            if self.box.exists(path)
        ]
        found += [
            f"netns {n}"
            for n in self.box.sh("ls /run/netns 2>/dev/null || true").split()
            if run_id in n
        ]
        tables = [self.box.run("findmnt", "-rn", "-o", "TARGET").stdout]
        pid = self.main_pid()
        if pid:
            tables.append(
                self.box.run(
                    "nsenter", "-t", str(pid), "-m", "findmnt", "-rn", "-o", "TARGET"
                ).stdout
            )
        found += [f"mount {t}" for table in tables for t in table.splitlines() if run_id in t]
        cgroups = self.box.sh(f"find /sys/fs/cgroup -name '*{run_id}*' 2>/dev/null || true")
        found += [f"cgroup {c}" for c in cgroups.split()]
        uids = self.box.run("ps", "-e", "-o", "uid=,pid=,args=").stdout.splitlines()
        found += [f"process {p.strip()}" for p in uids if p.split() and int(p.split()[0]) == uid]
        return found


@pytest.fixture(scope="module")
def service() -> Iterator[Service]:
    stop_stale_boxes()
    try:
        box = start_box(box_name("e2e"))
    except BoxUnavailable as exc:
        pytest.skip(f"no systemd box here: {exc}")
    try:
        install_gatewayd(box)
        uid_base = UID_BASE + secrets.randbelow(UID_SLOTS) * 1024
        config = "/etc/gatewayd/gatewayd.yaml"
        starting = yaml.safe_load(box.read(config))
        assert starting["lendable_roots"] == [WORKSPACES], starting
        box.append(config, CONFIG_ADDED.format(policies=POLICY_DIR, base=uid_base))
        # Made by the install (tmpfiles), not by hand: ReadWritePaths= binds it writable
        # only if it exists at the start; one made later stays read-only to the service.
        box.run("test", "-d", WORKSPACES)
        box.run("mkdir", "-p", POLICY_DIR)
        live = Service(box, uid_base)
        started = box.run("systemctl", "start", "gatewayd", check=False, timeout=120)
        assert started.returncode == 0, started.stderr + live.journal_text()
        live.wait_active()
        yield live
    finally:
        stop_box(box)


def _calls_and_results(log: list[dict[str, Any]], run_id: str) -> tuple[Counter[str], Counter[str]]:
    calls = Counter(
        e["toolCallId"] for e in log if e.get("runId") == run_id and e["kind"] == "call"
    )
    results = Counter(
        e["toolCallId"] for e in log if e.get("runId") == run_id and e["kind"] == "result"
    )
    return calls, results


def installed_into_its_venv_and_started_by_systemd_on_ready(service: Service) -> None:
    state = service.show("ActiveState", "SubState", "Type", "StatusText", "User", "ExecStart")
    assert (state["ActiveState"], state["SubState"], state["Type"]) == (
        "active",
        "running",
        "notify",
    )
    # Type=notify: active only after READY=1, which gatewayd sends once the socket answers.
    assert state["StatusText"].startswith("serving"), state
    assert f"path={GATEWAYD} " in state["ExecStart"], state
    assert state["User"] == "gatewayd"
    pid = service.main_pid()
    assert service.box.run("ps", "-o", "user=", "-p", str(pid)).stdout.strip() == "gatewayd"
    # The venv runs the system interpreter and holds gatewayd itself, not a link back to
    # the checkout (an editable install would need the checkout the unit hides).
    interpreter = service.box.run("readlink", "-f", f"{VENV}/bin/python").stdout.strip()
    assert interpreter.startswith("/usr/bin/python3"), interpreter
    where = service.box.run(
        "setpriv",
        "--reuid=gatewayd",
        "--regid=gatewayd",
        "--clear-groups",
        f"{VENV}/bin/python",
        "-I",  # not the checkout in the working directory
        "-c",
        "import gatewayd, cogni_tool; print(gatewayd.__file__, cogni_tool.__file__)",
    ).stdout.split()
    assert all(p.startswith(f"{VENV}/lib/") for p in where), where
    status, health = service.control("GET", "/v1/health")
    assert status == 200, health


def a_run_over_the_control_socket_with_calls_from_its_os_sandbox(service: Service) -> None:
    run = service.create_run("first")
    run_id = run["runId"]
    read = service.exec(run_id, "cogni-tool", "exec", "fs.read", '{"path": "notes.md"}')
    assert read.returncode == 0, read.stderr
    assert json.loads(read.stdout)["content"] == "notes of first\n"
    write = service.exec(
        run_id, "cogni-tool", "exec", "fs.write", '{"path": "notes.md", "content": "x"}'
    )
    assert write.returncode == 15, write.stderr
    assert "policy_denied" in write.stderr and "'fs.write' is not allowed" in write.stderr
    shadow = service.exec(run_id, "cogni-tool", "exec", "fs.read", '{"path": "/etc/shadow"}')
    assert shadow.returncode == 15 and "outside the readable paths" in shadow.stderr, shadow.stderr
    # The commands run as the run's own uid with no capability, though the service holds
    # nine, and with no way out but the gateway.
    who = service.exec(run_id, "sh", "-c", "id -u; grep CapEff /proc/self/status")
    inside, caps = who.stdout.split("\n", 1)
    assert inside != "0" and caps.split()[1] == "0000000000000000", who.stdout
    uid = service.sandbox_uid(run_id)  # on the host: one of the configured range
    assert service.uid_base <= uid < service.uid_base + 64, uid
    out = service.exec(run_id, "curl", "-sS", "--max-time", "3", f"http://{OUTSIDE_V4}/")
    assert out.returncode not in (0, 28), out  # refused at once: no route, not a timeout
    status, ended = service.control("DELETE", f"/v1/runs/{run_id}")
    assert status == 200 and ended["run"]["state"] == "ended", ended
    assert ended["run"]["calls"] == 4 and ended["run"]["denied"] == 2

    assert service.verify().startswith("OK: ")
    log = service.audit()
    decisions = [
        (e["tool"], e["decision"], e.get("errorCode"))
        for e in log
        if e.get("runId") == run_id and e["kind"] == "call"
    ]
    assert decisions == [
        ("fs.read", "allow", None),
        ("fs.write", "deny", "policy_denied"),
        ("fs.read", "deny", "policy_denied"),
        ("time.now", "allow", None),
    ]
    calls, results = _calls_and_results(log, run_id)
    assert calls == results
    # The journal holds gatewayd's own lines as JSON, and the run's carry its id.
    lines = [j for j in service.journal() if j.get("_TRANSPORT") == "stdout"]
    logged = [json.loads(j["MESSAGE"]) for j in lines]
    assert logged and all(isinstance(line, dict) and "event" in line for line in logged)
    of_run = {line["event"] for line in logged if line.get("run_id") == run_id}
    assert {"run_started", "run_ended"} <= of_run, of_run
    assert service.leftovers(run_id, uid) == []


def reload_while_calls_flow_loses_no_call(service: Service) -> None:
    run = service.create_run("reloadable", "time.now, fs.read")
    run_id = run["runId"]
    pid = service.main_pid()
    load = service.box.popen(
        GATEWAYD, "exec", run_id, "--", "python3", "-I", "-c", LOAD, str(LOAD_SECONDS)
    )
    try:
        # Calls are flowing before the first reload.
        service.wait_for_entry(lambda e: e.get("runId") == run_id and e.get("tool") == "time.now")
        service.box.run("systemctl", "reload", "gatewayd")
        time.sleep(0.5)
        service.write_policy("reloadable", "time.now")  # fs.read goes
        service.box.run("systemctl", "reload", "gatewayd")
        time.sleep(0.5)
        service.box.run("systemctl", "reload", "gatewayd")
        stdout, stderr = load.communicate(timeout=LOAD_SECONDS + 60)
    finally:
        if load.poll() is None:
            load.kill()
            load.wait()
    assert load.returncode == 0, stderr
    outcome = json.loads(stdout.splitlines()[-1])
    assert outcome["failures"] == [] and outcome["answered"] > 50, outcome
    assert service.main_pid() == pid  # reloaded, not restarted
    assert service.show("ActiveState")["ActiveState"] == "active"
    denied = service.exec(run_id, "cogni-tool", "exec", "fs.read", '{"path": "notes.md"}')
    assert denied.returncode == 15 and "'fs.read' is not allowed" in denied.stderr, denied.stderr

    log = service.audit()
    reloads = [e for e in log if e.get("event") == "config_reloaded"]
    changed = [e for e in log if e.get("event") == "policy_reloaded" and e.get("runId") == run_id]
    assert len(reloads) >= 3 and changed and changed[-1]["detail"]["changed"] == ["tools"]
    # Calls on both sides of every reload, and each answered on the record.
    times = [e["seq"] for e in log if e.get("runId") == run_id and e.get("tool") == "time.now"]
    assert all(min(times) < r["seq"] < max(times) for r in reloads[-3:]), (
        f"calls at seq {min(times)}..{max(times)}, reloads at {[r['seq'] for r in reloads[-3:]]}"
    )
    results = [
        e
        for e in log
        if e.get("runId") == run_id and e["kind"] == "result" and e["tool"] == "time.now"
    ]
    assert len(results) == outcome["answered"]
    status, _ = service.control("DELETE", f"/v1/runs/{run_id}")
    assert status == 200
    calls, answered = _calls_and_results(service.audit(), run_id)
    assert calls == answered
    service.verify()


def stop_with_live_runs_ends_them_on_the_record_and_leaves_nothing(service: Service) -> None:
    busy = service.create_run("busy")
    idle = service.create_run("idle")
    uids = {r["runId"]: service.sandbox_uid(r["runId"]) for r in (busy, idle)}
    sleeper = service.box.popen(GATEWAYD, "exec", busy["runId"], "--", "sleep", "600")
    try:
        service.wait_for_entry(
            lambda e: (
                e.get("runId") == busy["runId"]
                and e.get("event") == "exec_started"
                and e["detail"]["command"] == ["sleep", "600"]
            )
        )
        inode = service.box.run("stat", "-c", "%i", CONTROL_SOCKET).stdout
        started = time.monotonic()
        service.box.run("systemctl", "stop", "gatewayd", timeout=STOP_TIMEOUT_S)
        took = time.monotonic() - started
        # gatewayd.socket keeps the control socket: the path stays, the same socket.
        assert service.box.run("stat", "-c", "%i", CONTROL_SOCKET).stdout == inode
        sleeper.communicate(timeout=60)  # its client is answered or cut off, not left hanging
    finally:
        if sleeper.poll() is None:
            sleeper.kill()
            sleeper.wait()
    state = service.show("ActiveState", "Result", "ExecMainStatus")
    assert state == {"ActiveState": "inactive", "Result": "success", "ExecMainStatus": "0"}, state
    assert took < 60, f"the stop took {took:.1f} s: systemd's SIGKILL, not gatewayd's clean stop"
    log = service.audit()
    assert log[-1]["event"] == "audit_close"
    for run_id in uids:
        ended = [e for e in log if e.get("runId") == run_id and e.get("event") == "run_ended"]
        assert ended and ended[-1]["detail"]["reason"] == "daemon_stopping", ended
        calls, results = _calls_and_results(log, run_id)
        assert calls == results
    service.verify()
    for run_id, uid in uids.items():
        assert service.leftovers(run_id, uid) == [], run_id
    service.box.run("systemctl", "start", "gatewayd", timeout=120)
    service.wait_active()
    assert service.box.run("stat", "-c", "%i", CONTROL_SOCKET).stdout == inode


def kill_9_then_systemd_restarts_it_leftovers_go_and_the_chain_continues(
    service: Service,
) -> None:
    run = service.create_run("crashed")
    run_id = run["runId"]
    uid = service.sandbox_uid(run_id)
    sleeper = service.box.popen(GATEWAYD, "exec", run_id, "--", "sleep", "600")
    watcher = None
    try:
        service.wait_for_entry(
            lambda e: (
                e.get("runId") == run_id
                and e.get("event") == "exec_started"
                and e["detail"]["command"] == ["sleep", "600"]
            )
        )
        # There is something to remove: the run's directory, namespace and live process.
        held = " ".join(service.leftovers(run_id, uid))
        assert "netns " in held and "process " in held and f"runs/{run_id}" in held, held
        before = service.show("MainPID", "NRestarts")
        watcher = service.box.popen(
            "python3", "-I", "-c", WATCH, str(WATCH_SECONDS), CONTROL_SOCKET
        )
        time.sleep(0.5)
        service.box.run("kill", "-9", before["MainPID"])
        pid = service.wait_active(other_than=int(before["MainPID"]))
        watched, watch_err = watcher.communicate(timeout=WATCH_SECONDS + 60)
        sleeper.communicate(timeout=60)
    finally:
        for proc in (sleeper, watcher):
            if proc is not None and proc.poll() is None:
                proc.kill()
                proc.wait()
    assert int(service.show("NRestarts")["NRestarts"]) == int(before["NRestarts"]) + 1
    # The control socket's path stayed, the same socket (held by gatewayd.socket), and
    # every request sent across the crash was answered.
    seen = json.loads(watched.splitlines()[-1]) if watched.strip() else {"stderr": watch_err}
    assert seen.get("missing") == 0 and len(seen.get("inodes", ())) == 1, seen
    assert seen["refused"] == [] and len(seen["cut"]) <= 1, seen
    assert len(seen["answers"]) > 10 and set(seen["answers"]) == {200}, seen

    log = service.audit()
    opened = [e for e in log if e.get("event") == "audit_open" and e["detail"]["pid"] == pid]
    assert len(opened) == 1, opened
    at = log.index(opened[0])
    last_before = log[at - 1]
    assert opened[0]["detail"]["continuesSeq"] == last_before["seq"]
    assert opened[0]["prev"] == last_before["hash"]
    swept = next(e for e in log[at:] if e.get("event") == "leftovers_removed")
    assert run_id in swept["detail"]["runDirs"], swept
    assert any(run_id in n for n in swept["detail"]["netns"]), swept
    assert service.verify().startswith("OK: ")
    assert service.leftovers(run_id, uid) == []
    # The new daemon serves: a new run on the same workspace root calls from its sandbox.
    again = service.create_run("after-crash")
    done = service.exec(again["runId"], "cogni-tool", "exec", "time.now")
    assert done.returncode == 0, done.stderr


def systemd_analyze_security_rates_the_unit_below_5(service: Service) -> None:
    done = service.box.run("systemd-analyze", "security", "--no-pager", "gatewayd.service")
    print(done.stdout)  # the whole table, for the record (pytest -s, or a failure)
    found = re.search(r"Overall exposure level for gatewayd\.service: (\d+\.\d+)", done.stdout)
    assert found, done.stdout[-2000:]
    assert float(found.group(1)) < 5.0, done.stdout


def the_box_helper_reports_a_failing_command_with_its_output(service: Service) -> None:
    with pytest.raises(BoxCommandFailed) as failed:
        service.box.sh("echo to-stdout; echo to-stderr >&2; exit 3")
    message = str(failed.value)
    assert "exited 3" in message and "to-stdout" in message and "to-stderr" in message


# Each phase makes its own run and leaves the service running for the next.
PHASES: Final = (
    installed_into_its_venv_and_started_by_systemd_on_ready,
    a_run_over_the_control_socket_with_calls_from_its_os_sandbox,
    reload_while_calls_flow_loses_no_call,
    stop_with_live_runs_ends_them_on_the_record_and_leaves_nothing,
    kill_9_then_systemd_restarts_it_leftovers_go_and_the_chain_continues,
    systemd_analyze_security_rates_the_unit_below_5,
    the_box_helper_reports_a_failing_command_with_its_output,
)


def test_gatewayd_installed_and_run_under_a_real_systemd(
    service: Service, subtests: pytest.Subtests
) -> None:
    """Every phase in one test on one box: one install (a minute or more), and pytest-xdist
    never splits a test over two workers, as it would split the phases were they tests
    (each worker would boot and install a box of its own). Each phase reports on its own
    and a failed one does not stop the next."""
    for phase in PHASES:
        with subtests.test(msg=phase.__name__):
            try:
                phase(service)
            finally:
                service.ensure_running()  # a phase that failed half-way stops no other
