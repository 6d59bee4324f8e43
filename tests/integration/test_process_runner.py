"""Process tools (gatewayd/runners/process.py), called through the real chokepoint of a
real daemon, each call in a fresh bubblewrap sandbox of a real run (its uid, its limits).

The tool is a probe: a Python script in its own folder, run with the sandbox's python3.
It tries, from inside, what a hostile tool would (write outside its declared paths, read
an undeclared file, write into its own folder, reach the network, the run's services or
the gateway socket, see a host variable) and reports what happened; every property is
shown by the probe failing, never by reading our own configuration back.
"""

from __future__ import annotations

import os
import secrets
import shutil
import socket
import tempfile
import textwrap
from collections.abc import AsyncIterator, Iterator, Mapping
from pathlib import Path
from typing import Any

import pytest
import trio

from gatewayd.audit import Peer
from gatewayd.config import GatewaydConfig, SandboxUids
from gatewayd.daemon import Daemon, open_daemon
from gatewayd.errors import PolicyViolation
from gatewayd.policy.capabilities import Capabilities, FileCapability
from gatewayd.policy.paths import PathMode
from gatewayd.protocol import ErrorCode, Request, Response
from gatewayd.runners.process import ProcessToolRunner, escape_controls
from gatewayd.runners.rights import required_request
from gatewayd.runners.spec import FileNeed, FolderTool, NameNeed
from gatewayd.runs import Grant, Run, RunLimits, RunRequest
from gatewayd.sandbox.plan import PlanError
from gatewayd.sandbox.session import CallBind, CallView
from gatewayd.tools import builtin_tools
from gatewayd.tools.manifest import RunnerKind, ToolLimits, ToolManifest
from gatewayd.tools.registry import Tool, ToolContext
from tests.responses import failure, value

PY = "/usr/bin/python3"
PEER = Peer(pid=4242, uid=1000, gid=1000)
SECRET_NAME = "COGNI_TEST_PROC_SECRET"  # in gatewayd's environment, granted to no tool
GRANTED_NAME = "COGNI_TEST_PROC_GRANTED"  # declared by the probe and in the run's env.allow
UNALLOWED_NAME = "COGNI_TEST_PROC_OPTIONAL"  # declared (optional), not in env.allow
MIB = 1024 * 1024

# The probe: reads {"arguments": {...}} and does what "mode" says.
PROBE = r"""
import json, os, socket, sys, time

args = json.load(sys.stdin)["arguments"]
mode = args.get("mode", "echo")


def attempt(fn):
    try:
        return "ok: " + repr(fn())
    except Exception as exc:  # what stopped it, by name
        return type(exc).__name__ + ": " + str(exc)


def write(path, text="x"):
    with open(path, "w") as f:
        f.write(text)
    return path


def read(path):
    with open(path) as f:
        return f.read()


def connect(host, port):
    with socket.create_connection((host, port), timeout=2) as s:
        return s.getpeername()


if mode == "echo":
    print(json.dumps({"arguments": args, "cwd": os.getcwd(), "uid": os.getuid()}))
elif mode == "probe":
    port = args["port"]
    report = {
        "read_declared": attempt(lambda: read("/workspace/src/a.txt")),
        "write_declared_rw": attempt(lambda: write("/workspace/out/result.txt", "from the tool")),
        "write_declared_ro": attempt(lambda: write("/workspace/src/new.txt")),
        "overwrite_declared_ro": attempt(lambda: write("/workspace/src/a.txt")),
        "write_undeclared": attempt(lambda: write("/workspace/undeclared.txt")),
        "mkdir_undeclared": attempt(lambda: os.mkdir("/workspace/newdir")),
        "read_undeclared": attempt(lambda: read("/workspace/secret.txt")),
        "read_through_inner_link": attempt(lambda: read("/workspace/src/escape")),
        "write_tool_folder": attempt(lambda: write("/tool/planted.py")),
        "write_root": attempt(lambda: write("/planted")),
        "read_policy_path": attempt(lambda: os.listdir("/data/extra")),
        "workspace_entries": sorted(os.listdir("/workspace")),
        "apps_folder": attempt(lambda: os.listdir("/workspace/apps")),
        "tcp_host_loopback": attempt(lambda: connect("127.0.0.1", port)),
        "tcp_host_address": attempt(lambda: connect(args["host_ip"], port)),
        "tcp_run_egress_proxy": attempt(lambda: connect("127.0.0.1", 3128)),
        "tcp_run_model_endpoint": attempt(lambda: connect("127.0.0.1", 11411)),
        "dns": attempt(lambda: socket.getaddrinfo("example.com", 443)),
        "gateway_socket": attempt(lambda: os.stat("/run/cogni/gateway.sock")),
        "egress_socket": attempt(lambda: os.stat("/run/cogni/egress.sock")),
        "interfaces": sorted(name for _, name in socket.if_nameindex()),
        "env": dict(os.environ),
        "cwd": os.getcwd(),
        "tmp_writable": attempt(lambda: write("/tmp/scratch")),
    }
    print(json.dumps(report))
elif mode == "read":
    print(json.dumps({p: attempt(lambda p=p: read(p)) for p in args["paths"]}))
elif mode == "exit":
    sys.stderr.write("x" * 5000 + "\nboom \x1b[31mred\u202eevil\n")
    sys.exit(3)
elif mode == "stderrflood":
    for _ in range(200):
        sys.stderr.write("noise " * 10000 + "\n")
    sys.stderr.write("the last words")
    sys.exit(1)
elif mode == "badjson":
    print("this is not json")
elif mode == "two":
    print('{"a": 1} {"b": 2}')
elif mode == "nothing":
    pass
elif mode == "sleep":
    time.sleep(60)
elif mode == "memory":
    hog = []
    while True:
        hog.append(bytearray(16 * 1024 * 1024))
        for i in range(0, len(hog[-1]), 4096):
            hog[-1][i] = 1
elif mode == "flood":
    chunk = "x" * 65536
    while True:
        sys.stdout.write(chunk)
"""

POLICY = """
version: 1
name: process-tools
tools:
  allow: ["proc.*", sandbox.exec]
filesystem:
  paths:
    src: {{root: src, mode: ro}}
    out: {{root: out, mode: rw}}
    made: {{root: made, mode: rw}}
    extra: {{root: {extra}, mount: /data/extra, mode: ro}}
env:
  allow: [{granted}]
network:
  allow_domains: [example.com]
limits: {{calls_per_second: 1000, burst: 1000, max_output_bytes: 200000, call_timeout_s: 20}}
sandbox: {{timeout_s: 30, cpu_s: 20, max_processes: 48, max_file_mb: 1}}
"""
# A run that grants the workspace whole, with a grant under per-file rules inside it.
WHOLE_POLICY = """
version: 1
name: process-tools-whole
tools:
  allow: ["proc.*"]
filesystem:
  paths:
    workspace: {root: ., mode: rw}
    notes: {root: notes, mode: ro, suffixes: [.md]}
limits: {calls_per_second: 1000, burst: 1000}
"""


def _unavailable() -> str | None:
    if os.geteuid() != 0:
        return "sandboxed runs need root (network namespaces, a uid per run)"
    if not os.path.exists("/usr/bin/bwrap") or not os.path.exists(PY):
        return "needs bubblewrap at /usr/bin/bwrap and the system python3"
    return None


pytestmark = pytest.mark.skipif(_unavailable() is not None, reason=str(_unavailable()))


def folder_tool(
    name: str,
    folder: Path,
    *,
    files: tuple[FileNeed, ...] = (),
    env: tuple[NameNeed, ...] = (),
    network: tuple[NameNeed, ...] = (),
    memory_mb: int | None = None,
    timeout_s: float | None = None,
    entry: tuple[str, ...] = (PY, "-I", "/tool/probe.py"),
) -> FolderTool:
    """A process tool as the manifest reader makes one (built by hand here)."""
    manifest = ToolManifest(
        name=name,
        version="1.0.0",
        summary=f"test tool {name}",
        args_schema={"type": "object"},
        runner=RunnerKind.PROCESS,
        capabilities=Capabilities(
            files=tuple(FileCapability(path=f.path, mode=f.mode) for f in files),
            network=tuple(n.name for n in network),
            env=tuple(n.name for n in env),
            exec=True,
        ),
        limits=ToolLimits(
            timeout_s=timeout_s, memory_bytes=None if memory_mb is None else memory_mb * MIB
        ),
    )
    return FolderTool(
        manifest=manifest,
        folder=str(folder),
        manifest_path=str(folder / "manifest.json"),
        entry=entry,
        files=files,
        network=network,
        env=env,
    )


def as_tool(folder: FolderTool) -> Tool[Mapping[str, Any]]:
    request = required_request(folder)
    return Tool(
        manifest=folder.manifest,
        decode=dict,
        requests=lambda _args: request,
        runner=ProcessToolRunner(folder),
    )


def ro(path: str, *, optional: bool = False) -> FileNeed:
    return FileNeed(path=path, mode=PathMode.RO, optional=optional)


def rw(path: str, *, optional: bool = False) -> FileNeed:
    return FileNeed(path=path, mode=PathMode.RW, optional=optional)


class Harness:
    def __init__(self, daemon: Daemon, base: Path) -> None:
        self.daemon = daemon
        self.base = base
        self._ids = 0
        self.run: Run
        self.workspace: Path

    async def start(self, policy_text: str, ws: Path) -> Run:
        policy = self.base / f"policy-{secrets.token_hex(4)}.yaml"
        policy.write_text(textwrap.dedent(policy_text))
        return await self.daemon.runs.start(
            RunRequest(
                workspacePath=str(ws),
                policy=str(policy),
                actorId="tester",
                tenantId="t1",
                grant=Grant(allowSandbox=True),
                limits=RunLimits(maxMemoryMb=1024),
            ),
            policy_paths=True,
        )

    async def call(self, tool: str, run: Run | None = None, **args: Any) -> Response:
        run = run or self.run
        self._ids += 1
        request = Request(v=1, runId=run.run_id, toolCallId=f"c{self._ids}", tool=tool, args=args)
        return await self.daemon.dispatcher.handle(run, request, PEER)


@pytest.fixture
def base() -> Iterator[Path]:
    path = Path(tempfile.mkdtemp(prefix="cg-proc-", dir="/tmp"))
    path.chmod(0o711)  # the run's uid passes through to its workspace
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


def make_folder(base: Path) -> Path:
    folder = base / "tools" / "probe"
    folder.mkdir(parents=True)
    (folder / "probe.py").write_text(PROBE)
    for directory in (base / "tools", folder):
        directory.chmod(0o755)
    (folder / "probe.py").chmod(0o644)
    return folder


def make_workspace(base: Path) -> Path:
    ws = base / "ws"
    (ws / "src").mkdir(parents=True)
    (ws / "src" / "a.txt").write_text("declared input\n")
    (ws / "src" / "escape").symlink_to("../secret.txt")
    (ws / "src" / "link-out").symlink_to("/etc")
    (ws / "out").mkdir()
    (ws / "made").mkdir()
    (ws / "notes").mkdir()
    (ws / "notes" / "n.md").write_text("a note\n")
    (ws / "secret.txt").write_text("undeclared workspace file\n")
    os.link(ws / "secret.txt", ws / "src" / "hard")  # a second name of an undeclared file
    return ws


def tools(folder: Path) -> list[FolderTool]:
    src_out = (ro("/workspace/src"), rw("/workspace/out"))
    return [
        folder_tool(
            "proc.probe",
            folder,
            files=src_out,
            env=(NameNeed(name=GRANTED_NAME), NameNeed(name=UNALLOWED_NAME, optional=True)),
        ),
        folder_tool("proc.bare", folder, timeout_s=3, memory_mb=96),
        folder_tool("proc.net", folder, network=(NameNeed(name="example.com"),)),
        folder_tool("proc.optnet", folder, network=(NameNeed(name="example.com", optional=True),)),
        folder_tool("proc.whole", folder, files=(ro("/workspace"),)),
        folder_tool("proc.notes", folder, files=(ro("/workspace/notes"),)),
        folder_tool("proc.linked", folder, files=(ro("/workspace/src/link-out"),)),
        # /bin/sh's head, unlike python, does not ignore SIGXFSZ.
        folder_tool(
            "proc.bigfile", folder, entry=("/bin/sh", "-c", "head -c 2000000 /dev/zero >/tmp/big")
        ),
        folder_tool("proc.deaf", folder, entry=("/bin/sh", "-c", "echo '{\"deaf\": true}'")),
        folder_tool("proc.file", folder, files=(ro("/workspace/src/a.txt"),)),
        folder_tool("proc.hardlink", folder, files=(ro("/workspace/src/hard"),)),
        folder_tool("proc.fresh", folder, files=(rw("/workspace/made/here"),)),
        folder_tool("proc.optional", folder, files=(ro("/workspace/missing", optional=True),)),
    ]


@pytest.fixture
async def harness(base: Path) -> AsyncIterator[Harness]:
    folder = make_folder(base)
    ws = make_workspace(base)
    extra = base / "extra"
    extra.mkdir()
    (extra / "policy-path.txt").write_text("the run's, not the tool's\n")
    registry = builtin_tools()
    for tool in tools(folder):
        registry.register(as_tool(tool))
    config = GatewaydConfig(
        state_dir=base / "state",
        policy_dirs=(base,),
        netns_prefix=f"cgp{secrets.token_hex(4)}-",
        sandbox_uids=SandboxUids(base=1_700_000_000 + secrets.randbelow(50_000) * 1024, count=64),
        audit_fsync=False,
        # What a tool's process writes (and leaves no trace of) is looked for on the host.
        workspace_mode="host",
    )
    os.environ[SECRET_NAME] = "sk-host-only-" + secrets.token_hex(8)
    os.environ[GRANTED_NAME] = "granted-value"
    os.environ[UNALLOWED_NAME] = "declared-but-not-allowed"
    try:
        async with open_daemon(config, preload=True, tools=registry) as daemon:
            assert daemon.runs.support.available, daemon.runs.support.reason
            harness = Harness(daemon, base)
            harness.run = await harness.start(POLICY.format(extra=extra, granted=GRANTED_NAME), ws)
            harness.workspace = ws
            yield harness
    finally:
        for name in (SECRET_NAME, GRANTED_NAME, UNALLOWED_NAME):
            os.environ.pop(name, None)


def host_address() -> str:
    """A non-loopback address of this host (the probe must not reach it either)."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            s.connect(("198.51.100.1", 9))  # no packet is sent: picks the outgoing address
            return str(s.getsockname()[0])
        except OSError:
            return "127.0.0.2"


# --- what a process tool sees ----------------------------------------------------------


async def test_probe_sees_only_its_declared_paths_no_network_no_socket_no_host_env(
    harness: Harness,
) -> None:
    listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    listener.bind(("0.0.0.0", 0))  # every host address: loopback and the outgoing one
    listener.listen()
    port = listener.getsockname()[1]
    try:
        report = value(
            await harness.call("proc.probe", mode="probe", port=port, host_ip=host_address())
        )
    finally:
        listener.close()
    ws = harness.workspace
    # Success paths: the declared directory read, the declared rw directory written.
    assert report["read_declared"] == "ok: 'declared input\\n'"
    assert report["write_declared_rw"].startswith("ok:")
    assert (ws / "out" / "result.txt").read_text() == "from the tool"
    # Writes outside the declared rw path fail from inside, and nothing lands on the host.
    for key in ("write_declared_ro", "overwrite_declared_ro", "write_undeclared"):
        assert report[key].startswith("OSError: [Errno 30]"), (key, report[key])
    assert report["mkdir_undeclared"].startswith("OSError: [Errno 30]")
    assert report["write_tool_folder"].startswith("OSError: [Errno 30]")
    assert report["write_root"].startswith("OSError: [Errno 30]")
    assert not (ws / "undeclared.txt").exists() and not (ws / "newdir").exists()
    assert (ws / "src" / "a.txt").read_text() == "declared input\n"
    assert not (ws / "src" / "new.txt").exists()
    assert not Path(ws.parent / "tools" / "probe" / "planted.py").exists()
    # Undeclared files: neither by name nor through a link inside a declared directory.
    assert report["read_undeclared"].startswith("FileNotFoundError")
    assert report["read_through_inner_link"].startswith("FileNotFoundError")
    assert report["workspace_entries"] == ["out", "src"]
    assert report["apps_folder"].startswith("FileNotFoundError")
    assert report["read_policy_path"].startswith("FileNotFoundError")  # the run's, not its
    # No network: only its own loopback; nothing of the host's or the run's loopback.
    assert report["interfaces"] == ["lo"]
    for key in ("tcp_host_loopback", "tcp_run_egress_proxy", "tcp_run_model_endpoint"):
        assert report[key].startswith("ConnectionRefusedError"), (key, report[key])
    assert report["tcp_host_address"].startswith("OSError: [Errno 101]"), report["tcp_host_address"]
    assert report["dns"].startswith("gaierror"), report["dns"]
    # No gateway socket, no egress socket.
    assert report["gateway_socket"].startswith("FileNotFoundError")
    assert report["egress_socket"].startswith("FileNotFoundError")
    # The environment: the granted name only (the optional one the run does not allow is
    # left out, the host's secret never enters), and the sandbox's own PATH and HOME.
    env = report["env"]
    assert env[GRANTED_NAME] == "granted-value"
    assert SECRET_NAME not in env and UNALLOWED_NAME not in env
    assert not [v for v in env.values() if v.startswith("sk-host-only-")]
    # PWD is bwrap's (--chdir), LC_CTYPE python's own (PEP 538 locale coercion).
    fixed = {"PATH", "HOME", "COGNI_GATEWAY_SOCK", "COGNI_RUN_ID", "PWD", "LC_CTYPE"}
    assert set(env) <= {GRANTED_NAME, *fixed}, set(env)
    assert report["cwd"] == "/workspace"
    assert report["tmp_writable"].startswith("ok:")  # its own /tmp, gone with the call
    # The call's own mount points went with it: only the run's pins are left.
    mnt = harness.run.directory / "mnt"
    assert sorted(int(p.name) for p in mnt.iterdir()) == list(range(len(harness.run.sandbox.pins)))


async def test_a_tool_without_files_starts_in_its_folder_and_echoes_its_arguments(
    harness: Harness,
) -> None:
    answer = value(await harness.call("proc.bare", mode="echo", n=[1, 2, {"k": "v"}]))
    assert answer == {
        "arguments": {"mode": "echo", "n": [1, 2, {"k": "v"}]},
        "cwd": "/tool",
        "uid": 1000,
    }


async def test_concurrent_calls_each_get_their_own_sandbox(harness: Harness) -> None:
    answers: list[Any] = []

    async def one(i: int) -> None:
        answers.append(value(await harness.call("proc.bare", mode="echo", i=i)))

    async with trio.open_nursery() as nursery:
        for i in range(4):
            nursery.start_soon(one, i)
    assert sorted(a["arguments"]["i"] for a in answers) == [0, 1, 2, 3]
    # The run's own commands are untouched by the calls' mount points.
    result = await harness.daemon.runs.exec(
        harness.run.run_id, ["/bin/cat", "/workspace/secret.txt"]
    )
    assert result.stdout == b"undeclared workspace file\n"


# --- refusals --------------------------------------------------------------------------


async def test_a_tool_needing_network_is_refused_and_optional_network_is_dropped(
    harness: Harness,
) -> None:
    # These tools' runners have no per-call egress proxy (the daemon's wiring gives one:
    # tests/integration/test_process_runner_network.py), so none can be given.
    message = failure(await harness.call("proc.net", mode="echo"), ErrorCode.POLICY_DENIED)
    assert "proc.net" in message and "example.com" in message and "network" in message
    # An optional domain: the call runs, with no network at all.
    report = value(await harness.call("proc.optnet", mode="probe", port=9, host_ip=host_address()))
    assert report["interfaces"] == ["lo"] and report["dns"].startswith("gaierror")


async def test_directories_a_mount_cannot_hand_over_whole_are_refused(harness: Harness) -> None:
    ws = harness.base / "ws-whole"
    (ws / "notes").mkdir(parents=True)
    run = await harness.start(WHOLE_POLICY, ws)
    # The workspace itself holds the apps folder; notes/ has a suffix rule.
    whole = failure(await harness.call("proc.whole", run, mode="echo"), ErrorCode.POLICY_DENIED)
    assert "apps folder" in whole and "narrower path" in whole
    notes = failure(await harness.call("proc.notes", run, mode="echo"), ErrorCode.POLICY_DENIED)
    assert ".md" in notes and "narrower path" in notes


async def test_a_declared_path_that_is_a_symlink_out_is_refused(harness: Harness) -> None:
    message = failure(await harness.call("proc.linked", mode="echo"), ErrorCode.POLICY_DENIED)
    assert "/workspace/src/link-out" in message and "symlink" in message
    assert "/etc" not in message.replace("/workspace", "")


async def test_a_declared_file_is_shown_alone_and_a_hard_link_is_refused(
    harness: Harness,
) -> None:
    paths = ["/workspace/src/a.txt", "/workspace/src/escape", "/workspace/secret.txt"]
    answer = value(await harness.call("proc.file", mode="read", paths=paths))
    assert answer["/workspace/src/a.txt"] == "ok: 'declared input\\n'"
    assert answer["/workspace/src/escape"].startswith("FileNotFoundError")
    assert answer["/workspace/secret.txt"].startswith("FileNotFoundError")
    message = failure(await harness.call("proc.hardlink", mode="echo"), ErrorCode.POLICY_DENIED)
    assert "/workspace/src/hard" in message and "hard link" in message


async def test_missing_paths_rw_is_made_optional_is_left_out(harness: Harness) -> None:
    answer = value(await harness.call("proc.fresh", mode="echo"))
    assert answer["cwd"] == "/workspace"
    made = harness.workspace / "made" / "here"
    assert made.is_dir()
    assert os.stat(made).st_uid == harness.run.sandbox.user.uid  # lent like the rest
    assert value(await harness.call("proc.optional", mode="echo"))["cwd"] == "/tool"


async def test_a_run_without_an_os_sandbox_is_refused_by_the_runner(base: Path) -> None:
    folder = folder_tool("proc.bare", base / "tools" / "probe")
    ctx = ToolContext(
        run_id="r1", grants=(), max_output_bytes=1000, degraded="bubblewrap is missing"
    )
    with pytest.raises(PolicyViolation, match=r"only inside an OS sandbox.*bubblewrap is missing"):
        await ProcessToolRunner(folder).run({}, ctx)


async def test_a_degraded_run_is_refused_by_the_policy_step(base: Path) -> None:
    folder = make_folder(base)
    registry = builtin_tools()
    registry.register(as_tool(folder_tool("proc.bare", folder)))
    policy = base / "degraded.yaml"
    policy.write_text(
        "version: 1\nname: degraded\ntools:\n  allow: [proc.bare]\nrequire_os_sandbox: false\n"
    )
    config = GatewaydConfig(state_dir=base / "state", policy_dirs=(base,), os_sandbox=False)
    ws = base / "ws-degraded"
    ws.mkdir()
    async with open_daemon(config, preload=True, tools=registry) as daemon:
        run = await daemon.runs.start(
            RunRequest(
                workspacePath=str(ws),
                policy=str(policy),
                actorId="tester",
                tenantId="t1",
                grant=Grant(allowSandbox=True),
            ),
            policy_paths=True,
        )
        request = Request(v=1, runId=run.run_id, toolCallId="c1", tool="proc.bare", args={})
        response = await daemon.dispatcher.handle(run, request, PEER)
    message = failure(response, ErrorCode.POLICY_DENIED)
    assert "OS sandbox" in message


# --- error mapping ---------------------------------------------------------------------


async def test_a_non_zero_exit_is_tool_failed_with_the_tail_of_stderr_escaped(
    harness: Harness,
) -> None:
    message = failure(await harness.call("proc.bare", mode="exit"), ErrorCode.TOOL_FAILED)
    assert "exited with status 3" in message
    assert "boom \\x1b[31mred\\u202eevil" in message  # the end of it, escaped
    assert "\n" not in message and "\x1b" not in message and "\u202e" not in message
    assert len(message) < 1200  # cut: the 5000 x's are not all there


async def test_a_stderr_flood_keeps_only_its_end_in_the_message(harness: Harness) -> None:
    started = trio.current_time()
    message = failure(await harness.call("proc.bare", mode="stderrflood"), ErrorCode.TOOL_FAILED)
    assert "exited with status 1" in message and message.endswith("the last words")
    assert len(message) < 1200
    assert trio.current_time() - started < 5


async def test_a_tool_that_never_reads_its_input_still_answers(harness: Harness) -> None:
    # Far more than a pipe holds: the write to its stdin fails once it exits, harmlessly.
    answer = value(await harness.call("proc.deaf", big="x" * 150_000))
    assert answer == {"deaf": True}


@pytest.mark.parametrize(
    ("mode", "says"),
    [
        ("badjson", "other than one JSON value"),
        ("two", "other than one JSON value"),
        ("nothing", "wrote nothing to stdout"),
    ],
)
async def test_stdout_that_is_not_one_json_value_is_tool_failed(
    harness: Harness, mode: str, says: str
) -> None:
    message = failure(await harness.call("proc.bare", mode=mode), ErrorCode.TOOL_FAILED)
    assert says in message and "proc.bare" in message


async def test_a_tool_past_its_time_is_stopped_with_timeout(harness: Harness) -> None:
    started = trio.current_time()
    message = failure(await harness.call("proc.bare", mode="sleep"), ErrorCode.TIMEOUT)
    assert "3 s" in message
    assert trio.current_time() - started < 10


async def test_a_tool_past_its_memory_is_limit_exceeded_naming_memory(harness: Harness) -> None:
    sandbox = harness.run.sandbox
    assert sandbox is not None
    response = await harness.call("proc.bare", mode="memory")
    if sandbox.settings.cgroups is None:
        # Without a memory cgroup the limit is RLIMIT_AS: the program's own MemoryError.
        assert "MemoryError" in failure(response, ErrorCode.TOOL_FAILED)
        return
    message = failure(response, ErrorCode.LIMIT_EXCEEDED)
    assert "memory" in message and "96 MiB" in message


async def test_a_stdout_flood_is_stopped_at_the_output_limit(harness: Harness) -> None:
    started = trio.current_time()
    message = failure(await harness.call("proc.bare", mode="flood"), ErrorCode.TOOL_FAILED)
    assert "200000 bytes" in message and "output limit" in message
    assert trio.current_time() - started < 3  # stopped at once, not at its timeout


async def test_a_file_past_the_runs_file_size_limit_is_limit_exceeded(harness: Harness) -> None:
    message = failure(await harness.call("proc.bigfile"), ErrorCode.LIMIT_EXCEEDED)
    assert "file size" in message and "max_file_mb" in message


async def test_a_bind_is_the_directory_opened_not_what_its_path_became(harness: Harness) -> None:
    """The sandbox layer binds by descriptor: a declared directory swapped for a symlink
    after gatewayd opened it (the run's own commands can rename in its workspace) still
    shows the directory opened, never the symlink's target."""
    sandbox = harness.run.sandbox
    assert sandbox is not None
    src = harness.workspace / "src"
    fd = os.open(src, os.O_PATH | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    try:
        src.rename(harness.workspace / "src-moved")
        src.symlink_to("/etc")
        view = CallView(
            binds=(CallBind(fd=fd, host=str(src), visible="/workspace/src", writable=False),),
        )
        result = await sandbox.exec_in_view(
            ["/bin/ls", "/workspace/src"],
            view,
            limits=sandbox.limits.for_command(10),
            env_values={},
        )
    finally:
        os.close(fd)
    assert result.exitCode == 0, result.stderr
    assert sorted(result.stdout.decode().split()) == ["a.txt", "escape", "hard", "link-out"]


async def test_a_view_showing_the_apps_folder_is_refused_and_leaves_no_mount_point(
    harness: Harness,
) -> None:
    sandbox = harness.run.sandbox
    assert sandbox is not None
    apps = harness.workspace / "apps"
    assert apps.is_dir()  # made for the run, covered in every command's sandbox
    fd = os.open(apps, os.O_PATH | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    try:
        view = CallView(
            binds=(CallBind(fd=fd, host=str(apps), visible="/workspace/x", writable=False),)
        )
        with pytest.raises(PlanError, match="never sees"):
            await sandbox.exec_in_view(
                ["/bin/true"], view, limits=sandbox.limits.for_command(10), env_values={}
            )
    finally:
        os.close(fd)
    mnt = harness.run.directory / "mnt"
    assert sorted(int(p.name) for p in mnt.iterdir()) == list(range(len(sandbox.pins)))


def test_escape_controls_leaves_text_and_escapes_controls() -> None:
    assert escape_controls("plain é ✓") == "plain é ✓"
    assert escape_controls("a\nb\x1b[0m\u202e\x00") == "a\\nb\\x1b[0m\\u202e\\x00"
