"""The client commands' import footprint against a live sandboxed daemon: `gatewayd exec`
to a live run and to a run it does not know, and `rules pending`, load none of the heavy
libraries (the commands that need no daemon are in tests/unit/test_cli_imports.py, with
the positive control and the helpers used here); and a one-shot `gatewayd run` in a real
sandbox loads the libraries only some tools use (gatewayd.libraries) only when its
run's policy reaches such a tool, then in a worker thread, never on its event loop.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
import textwrap
from collections.abc import Iterator
from pathlib import Path
from typing import Final

import pytest

from gatewayd.configdefaults import DEFAULT_CONFIG_PATH
from tests.livedaemon import sandbox_options
from tests.unit.test_cli_imports import (
    CLIENT_STDLIB,
    CODECS,
    DENY_ALL,
    HEAVY,
    MODELS,
    SOME_DAEMONS_ONLY,
    TOOL_LIBRARIES,
    TYPING,
    UNKNOWN_RUN,
    assert_light,
    clean_env,
    run_cli,
)

# Runs the command line's main, then writes each watched module it imported (argv[2]:
# names, comma-separated) with the thread that imported it: "main" (trio's loop runs on
# it in `gatewayd run`) or "worker"; exits with the command's status.
THREADS_WRAPPER: Final = """
import sys, threading
out, watched, words = sys.argv[1], set(sys.argv[2].split(",")), sys.argv[3:]
seen = {}

class Watch:
    def find_spec(self, name, path, target=None):
        if name in watched and name not in seen:
            main = threading.current_thread() is threading.main_thread()
            seen[name] = "main" if main else "worker"
        return None

sys.meta_path.insert(0, Watch())
try:
    from gatewayd.cli import main
    code = main(words)
except SystemExit as stop:
    code = stop.code
with open(out, "w") as listing:
    listing.write("\\n".join(f"{name} {thread}" for name, thread in sorted(seen.items())))
sys.exit(code)
"""
# A policy whose run can reach http.fetch (and nothing over an egress proxy, which its
# run's start would make on the loop, as a run's start may).
FETCH_POLICY: Final = """
version: 1
name: fetch-only
tools:
  allow: [http.fetch]
network:
  allow_domains: [example.com]
  proxy: {enabled: false}
"""


@pytest.fixture(scope="module")
def live(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Path, str]]:
    """A sandboxed `gatewayd serve` and a live run of it: (state dir, run id)."""
    from tests.integration.test_run_sandbox import _unavailable
    from tests.livedaemon import start_daemon

    if (reason := _unavailable()) is not None:
        pytest.skip(reason)
    if os.path.exists(DEFAULT_CONFIG_PATH):
        pytest.skip(f"{DEFAULT_CONFIG_PATH} exists: the command reads it, as it should")
    base = Path(tempfile.mkdtemp(prefix="cg-cli-", dir="/tmp"))
    base.chmod(0o711)  # the run's uid passes through to its workspace
    workspace = base / "ws"
    workspace.mkdir()
    daemon = start_daemon(base / "state", sandbox=True)
    try:
        run = daemon.create_run(workspace, DENY_ALL)
        yield daemon.state, run["runId"]
    finally:
        daemon.stop()
        shutil.rmtree(base, ignore_errors=True)


def test_exec_in_a_live_run_prints_its_output_and_loads_nothing_heavy(
    tmp_path: Path, live: tuple[Path, str]
) -> None:
    state, run_id = live
    done, modules = run_cli(
        tmp_path,
        "exec",
        "--state-dir",
        str(state),
        run_id,
        "--",
        "sh",
        "-c",
        "echo out; echo err >&2",
    )
    assert (done.returncode, done.stdout, done.stderr) == (0, "out\n", "err\n"), done
    assert_light(modules, HEAVY | MODELS | CODECS | TYPING | CLIENT_STDLIB)


def test_exec_of_an_unknown_run_of_a_live_daemon_says_so_and_loads_nothing_heavy(
    tmp_path: Path, live: tuple[Path, str]
) -> None:
    state, _ = live
    done, modules = run_cli(tmp_path, "exec", "--state-dir", str(state), UNKNOWN_RUN, "--", "true")
    assert done.returncode == 1, done
    assert done.stderr == f"gatewayd exec: bad_request: no such run {UNKNOWN_RUN}\n", done
    assert_light(modules, HEAVY | MODELS | CODECS | TYPING | CLIENT_STDLIB)


def test_rules_pending_of_a_live_daemon_loads_nothing_heavy(
    tmp_path: Path, live: tuple[Path, str]
) -> None:
    state, _ = live
    done, modules = run_cli(tmp_path, "rules", "pending", "--state-dir", str(state))
    assert done.returncode == 0, done
    assert_light(modules, HEAVY | MODELS | CODECS | TYPING | CLIENT_STDLIB)


def test_an_attached_run_loads_nothing_heavy_nor_what_only_a_terminal_needs(
    tmp_path: Path, live: tuple[Path, str]
) -> None:
    # `gatewayd run` served by the live daemon: the client passes its streams right after
    # the daemon's 101 (no import in between: no threading without a terminal, no
    # contextlib, no array); signal (its stop signals) and shlex (the store options)
    # are its own.
    state, _ = live
    workspace = state.parent / "ws-attached"
    workspace.mkdir(exist_ok=True)
    done, modules = run_cli(
        tmp_path,
        *("run", "--state-dir", str(state), "--workspace", str(workspace)),
        *("--policy", "default", "--on-end", "discard", "--", "echo", "attached"),
    )
    assert (done.returncode, done.stdout) == (0, "attached\n"), done
    assert "gatewayd: run " in done.stderr, done.stderr
    attached_stdlib = (CLIENT_STDLIB - {"signal", "shlex"}) | {"threading", "array"}
    assert_light(modules, HEAVY | MODELS | CODECS | TYPING | attached_stdlib)


def test_a_command_answered_in_process_loads_no_tool_library(tmp_path: Path) -> None:
    # No daemon serves the state directory: `gatewayd workspace list` opens one in this
    # process for its one answer, which serves no call and so loads no tool's library.
    state = tmp_path / "state"
    done, modules = run_cli(tmp_path, "workspace", "list", "--state-dir", str(state))
    assert done.returncode == 0, done.stderr
    assert "no workspace sessions" in done.stdout, done.stdout
    assert "gatewayd.daemon" in modules  # answered in this process
    assert_light(modules, TOOL_LIBRARIES | {"litellm", "gatewayd.egress"})


# --- a one-shot `gatewayd run` in a real sandbox ----------------------------------------


@pytest.fixture(scope="module")
def one_shot_base() -> Iterator[Path]:
    """A base directory for one-shot runs (the run's uid passes through to it)."""
    from tests.integration.test_run_sandbox import _unavailable

    if (reason := _unavailable()) is not None:
        pytest.skip(reason)
    if os.path.exists(DEFAULT_CONFIG_PATH):
        pytest.skip(f"{DEFAULT_CONFIG_PATH} exists: the command reads it, as it should")
    base = Path(tempfile.mkdtemp(prefix="cg-run-", dir="/tmp"))
    base.chmod(0o711)
    try:
        yield base
    finally:
        shutil.rmtree(base, ignore_errors=True)


def one_shot(base: Path, name: str, policy: str) -> tuple[str, dict[str, str]]:
    """``gatewayd run --policy POLICY -- /bin/true`` in a fresh interpreter, in a real
    sandbox: its stderr, and the tool libraries (and what only some daemons use) it
    imported, with their threads."""
    workspace = base / f"{name}-ws"
    workspace.mkdir()
    listing = base / f"{name}-libraries.txt"
    argv = [
        *("run", "--state-dir", str(base / f"{name}-state"), *sandbox_options()),
        *("--policy", policy, "--workspace", str(workspace), "--", "/bin/true"),
    ]
    done = subprocess.run(
        [
            *(sys.executable, "-c", THREADS_WRAPPER, str(listing)),
            ",".join(TOOL_LIBRARIES | SOME_DAEMONS_ONLY),
            *argv,
        ],
        capture_output=True,
        text=True,
        env=clean_env(),
        cwd=base,
        timeout=120,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert "ended: exit 0" in done.stderr, done.stderr
    lines = listing.read_text().split("\n") if listing.read_text() else []
    return done.stderr, dict(line.split() for line in lines)


def test_a_one_shot_run_of_the_deny_all_policy_loads_no_tool_library_nor_what_only_some_daemons_use(
    one_shot_base: Path,
) -> None:
    _, libraries = one_shot(one_shot_base, "deny-all", str(DENY_ALL))
    assert libraries == {}


def test_a_one_shot_run_that_may_fetch_loads_the_http_libraries_in_a_worker_thread(
    one_shot_base: Path,
) -> None:
    policy = one_shot_base / "fetch-only.yaml"
    policy.write_text(textwrap.dedent(FETCH_POLICY))
    _, libraries = one_shot(one_shot_base, "fetch", str(policy))
    assert {"httpx", "httpcore", "h11"} <= set(libraries), libraries
    on_the_loop = sorted(name for name, thread in libraries.items() if thread == "main")
    assert not on_the_loop, f"imported on the event loop's thread: {on_the_loop}"
    assert not {"wasmtime", "jsonschema", "markdown_it"} & set(libraries), libraries


def test_the_positive_control_sees_a_library_imported_on_the_loop(one_shot_base: Path) -> None:
    # With its egress proxy on, the run's start makes the proxy, on the loop (a run's
    # start may import; in a serving daemon it is loaded at the daemon's start): the
    # listing names that thread, so the check above can fail.
    policy = one_shot_base / "proxy.yaml"
    policy.write_text(textwrap.dedent(FETCH_POLICY).replace("{enabled: false}", "{enabled: true}"))
    _, libraries = one_shot(one_shot_base, "proxy", str(policy))
    assert libraries.get("httpx") == "main", libraries
