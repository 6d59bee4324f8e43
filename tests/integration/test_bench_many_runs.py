"""bench/many_runs.py: a small run end to end (a real `gatewayd serve` with the OS
sandbox, runs started at once, calls over their sockets, execs, every run ended) prints
every figure and a clean leak check; and each leak check finds what it looks for when it
is there (a real process of the uid range, cgroup, mount, network namespace, child
process), so a clean check means something. Figures only: no time is asserted."""

from __future__ import annotations

import importlib.util
import json
import os
import re
import secrets
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType

import pytest

from tests.conftest import ROOT
from tests.integration.test_run_sandbox import _unavailable

pytestmark = pytest.mark.skipif(_unavailable() is not None, reason=str(_unavailable()))

BENCH = ROOT / "bench" / "many_runs.py"
ENV = {**os.environ, "LITELLM_LOCAL_MODEL_COST_MAP": "True"}
MS = r"p50\s+-?[\d.]+\s+p90\s+-?[\d.]+\s+p99\s+-?[\d.]+ ms"
# Uids of the positive control: above the bench's and the tests' daemons' slices.
CONTROL_UID_BASE = 1_750_000_000


@pytest.fixture(scope="module")
def many_runs() -> ModuleType:
    """The bench's module (it finds bench/harness.py beside itself)."""
    spec = importlib.util.spec_from_file_location("many_runs", BENCH)
    assert spec is not None
    assert spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["many_runs"] = module  # its dataclasses look their module up
    spec.loader.exec_module(module)
    return module


def test_two_small_cycles_print_every_figure_and_a_clean_leak_check() -> None:
    done = subprocess.run(
        [
            sys.executable,
            str(BENCH),
            "--runs",
            "3",
            "--calls",
            "4",
            "--execs",
            "1",
            "--cycles",
            "2",
        ],
        capture_output=True,
        text=True,
        env=ENV,
        timeout=300,
        check=False,
    )
    assert done.returncode == 0, (done.stdout[-3000:], done.stderr[-3000:])
    out = done.stdout
    assert "6 runs started, 3 at once (2 cycle(s))" in out
    for label in ("start latency", "end latency", "call latency", "exec latency"):
        assert re.search(rf"{label}\s+{MS}", out), (label, out)
    assert re.search(r"calls\s+24 answered in [\d.]+ s: [\d,]+ calls/s", out), out
    assert re.search(r"execs\s+6 in [\d.]+ s", out), out
    cpu = r"daemon CPU each\s+start [\d.]+ ms, call \d+ us, exec [\d.]+ ms, end [\d.]+ ms"
    assert re.search(cpu, out), out
    for label in (
        "at 0 runs",
        "with every run idle",
        "peak (sampled)",
        "after every run ended",
        "after cycle 2",
    ):
        assert re.search(rf"{re.escape(label)}.*?(\s+[\d.]+){{7}}\n", out), (label, out)
    assert re.search(r"per idle run \(delta / runs\): RSS -?[\d.]+ MiB", out), out
    checks = re.findall(r"^    (ok  |LEAK) (.+)$", out, re.MULTILINE)
    assert len(checks) == 9, out
    assert all(state == "ok  " for state, _ in checks), out
    assert any("uid leases 0" in label for _, label in checks)
    assert out.rstrip().endswith("no failed call, no leak")


def test_the_options_are_checked() -> None:
    for argv, why in (
        (["--runs", "0"], "--runs must be 1..1000"),
        (["--runs", "1001"], "--runs must be 1..1000"),
        (["--calls", "-1"], "--calls and --execs must be >= 0"),
        (["--call-workers", "0"], "the workers and parallelism >= 1"),
    ):
        done = subprocess.run(
            [sys.executable, str(BENCH), *argv], capture_output=True, text=True, check=False
        )
        assert done.returncode == 2, argv
        assert why in done.stderr, (argv, done.stderr)


def test_a_call_worker_reports_a_run_it_cannot_reach(tmp_path: Path) -> None:
    """A failed job is a line naming the run and the error, never a silent zero."""
    jobs = [
        {"netns": str(tmp_path / "no-such-netns"), "socket": "/x", "runId": "r1", "calls": 1},
        {
            "netns": "/proc/self/ns/net",
            "socket": str(tmp_path / "no.sock"),
            "runId": "r2",
            "calls": 1,
        },
    ]
    done = subprocess.run(
        [sys.executable, str(BENCH), "--worker"],
        input="".join(json.dumps(job) + "\n" for job in jobs),
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    ready, *answers = [json.loads(line) for line in done.stdout.splitlines()]
    assert ready == {"ready": True}
    assert [a["runId"] for a in answers] == ["r1", "r2"]
    assert "FileNotFoundError" in answers[0]["error"]
    assert "no-such-netns" in answers[0]["error"]
    assert "no.sock" in answers[1]["error"] or "FileNotFoundError" in answers[1]["error"]
    assert all(a["latencies"] == [] for a in answers)


@pytest.fixture
def sleeper() -> Iterator[subprocess.Popen[bytes]]:
    uid = CONTROL_UID_BASE + secrets.randbelow(1000)
    proc = subprocess.Popen(["sleep", "60"], user=uid, group=uid, extra_groups=[])
    try:
        yield proc
    finally:
        proc.kill()
        proc.wait()


def test_a_process_of_the_uid_range_and_a_child_are_found(
    many_runs: ModuleType, sleeper: subprocess.Popen[bytes]
) -> None:
    assert sleeper.pid in many_runs.processes_of_uids(CONTROL_UID_BASE, 1000)
    assert sleeper.pid not in many_runs.processes_of_uids(CONTROL_UID_BASE + 1000, 1000)
    assert sleeper.pid in many_runs.descendants_of(os.getpid())
    assert sleeper.pid in many_runs.children_of(os.getpid())


def test_a_command_cgroup_of_a_run_is_found(many_runs: ModuleType) -> None:
    run_id = secrets.token_hex(16)
    hierarchy = next(
        p
        for p in (Path("/sys/fs/cgroup/pids"), Path("/sys/fs/cgroup"))
        if (p / "cgroup.procs").exists()
    )
    made = hierarchy / f"cogni-{run_id}-{secrets.token_hex(4)}"
    made.mkdir()
    try:
        assert many_runs.cgroups_left([run_id]) == [str(made)]
        assert many_runs.cgroups_left([secrets.token_hex(16)]) == []
    finally:
        made.rmdir()
    assert many_runs.cgroups_left([run_id]) == []


def test_a_mount_and_a_network_namespace_of_the_prefix_are_found(many_runs: ModuleType) -> None:
    prefix = f"cgtmr{secrets.token_hex(3)}-"
    name = prefix + secrets.token_hex(16)
    subprocess.run(["ip", "netns", "add", name], check=True)
    try:
        assert many_runs.netns_left(prefix) == [name]
        assert any(name in point for point in many_runs.mounts_left(None, [prefix]))
    finally:
        subprocess.run(["ip", "netns", "delete", name], check=True)
    assert many_runs.netns_left(prefix) == []
    assert many_runs.mounts_left(None, [prefix]) == []


def test_descriptors_are_told_apart_by_kind(many_runs: ModuleType) -> None:
    before = many_runs.kinds(many_runs.fd_targets(os.getpid()))
    with tempfile.TemporaryFile():
        read_end, write_end = os.pipe()
        try:
            more = many_runs.more_fds(before, os.getpid())
        finally:
            os.close(read_end)
            os.close(write_end)
    assert more.get("pipe") == 2, more
    assert sum(more.values()) == 3, more  # and the file
    assert many_runs.more_fds(before, os.getpid()) == {}


def test_the_audit_trees_level_files_are_not_counted(many_runs: ModuleType) -> None:
    assert many_runs.AUDIT_TREE_LEVEL.search("/s/audit/audit.jsonl.tree/level-05")
    assert not many_runs.AUDIT_TREE_LEVEL.search("/s/audit/audit.jsonl")
    assert not many_runs.AUDIT_TREE_LEVEL.search("/s/level-05/other")
