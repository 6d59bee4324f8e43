"""The client commands' import footprint against a live sandboxed daemon: `gatewayd exec`
to a live run and to a run it does not know, and `rules pending`, load none of the heavy
libraries (the commands that need no daemon are in tests/unit/test_cli_imports.py, with
the positive control and the helpers used here).
"""

from __future__ import annotations

import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from gatewayd.configdefaults import DEFAULT_CONFIG_PATH
from tests.unit.test_cli_imports import (
    CODECS,
    DENY_ALL,
    HEAVY,
    MODELS,
    UNKNOWN_RUN,
    assert_light,
    run_cli,
)


@pytest.fixture(scope="module")
def live(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Path, str]]:
    """A sandboxed `gatewayd serve` and a live run of it: (state dir, run id)."""
    from tests.integration.test_run_sandbox import _unavailable
    from tests.livedaemon import start_daemon

    if (reason := _unavailable()) is not None:
        pytest.skip(reason)
    if DEFAULT_CONFIG_PATH.exists():
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
    assert_light(modules, HEAVY | MODELS | CODECS)


def test_exec_of_an_unknown_run_of_a_live_daemon_says_so_and_loads_nothing_heavy(
    tmp_path: Path, live: tuple[Path, str]
) -> None:
    state, _ = live
    done, modules = run_cli(tmp_path, "exec", "--state-dir", str(state), UNKNOWN_RUN, "--", "true")
    assert done.returncode == 1, done
    assert done.stderr == f"gatewayd exec: bad_request: no such run {UNKNOWN_RUN}\n", done
    assert_light(modules, HEAVY | MODELS | CODECS)


def test_rules_pending_of_a_live_daemon_loads_nothing_heavy(
    tmp_path: Path, live: tuple[Path, str]
) -> None:
    state, _ = live
    done, modules = run_cli(tmp_path, "rules", "pending", "--state-dir", str(state))
    assert done.returncode == 0, done
    assert_light(modules, HEAVY | MODELS | CODECS)
