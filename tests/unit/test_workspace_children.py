"""The workspace tests' children (tests/workspace_helpers.py's ``run_child``), forked from a
fork server that has gatewayd.workspace imported: each must end, and be seen to end, as
the ``python -c`` it stands in for, and be a process of its own."""

from __future__ import annotations

import os

import pytest

from tests import workspace_helpers
from tests.conftest import ROOT
from tests.workspace_helpers import run_child


@pytest.mark.parametrize(
    ("script", "status"),
    [
        ("pass\n", 0),
        ("os._exit(9)\n", 9),
        ("import sys\nsys.exit(3)\n", 3),
        ("import signal\nos.kill(os.getpid(), signal.SIGKILL)\n", -9),
    ],
    ids=["end", "exit-9", "sys-exit-3", "sigkill"],
)
def test_a_childs_exit_status_is_as_subprocess_gives_it(script: str, status: int) -> None:
    assert run_child(script).returncode == status


def test_an_error_in_the_script_is_status_1_with_its_traceback() -> None:
    child = run_child("raise ValueError('the step failed')\n", capture_output=True)
    assert child.returncode == 1
    assert child.stderr is not None
    assert b'File "<string>"' in child.stderr
    assert child.stderr.endswith(b"ValueError: the step failed\n")


def test_a_child_starts_and_ends_as_python_c(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CG_CHILD_PROBE", "set after the fork server started")
    child = run_child(
        "import atexit, sys, threading, time\n"
        "print(os.getcwd(), os.environ['CG_CHILD_PROBE'], __name__, sys.argv, sep='|')\n"
        "print(sys.stdin.read() == '')\n"
        "atexit.register(print, 'atexit ran')\n"
        "threading.Thread(target=lambda: (time.sleep(0.05), print('thread joined'))).start()\n",
        capture_output=True,
    )
    assert child.returncode == 0, child.stderr
    assert child.stdout is not None
    assert child.stdout.decode().splitlines() == [
        f"{ROOT}|set after the fork server started|__main__|['-c']",
        "True",  # stdin is empty, never the fork server's requests
        "thread joined",
        "atexit ran",
    ]


def test_each_child_is_a_process_of_its_own_with_nothing_of_the_last() -> None:
    script = (
        "print(os.getpid(), overlay.apply_operation.__name__, 'leftover' in dir(), flush=True)\n"
        "overlay.apply_operation = lambda *args: None\n"
        "leftover = True\n"
    )
    first, second = (run_child(script, capture_output=True) for _ in range(2))
    assert first.stdout is not None and second.stdout is not None
    first_pid, *first_rest = first.stdout.split()
    second_pid, *second_rest = second.stdout.split()
    assert first_rest == second_rest == [b"apply_operation", b"False"]
    assert len({int(first_pid), int(second_pid), os.getpid()}) == 3


def test_output_not_captured_is_shown_with_the_tests(capfd: pytest.CaptureFixture[str]) -> None:
    child = run_child("import sys\nprint('out')\nprint('err', file=sys.stderr)\n")
    outputs: tuple[object, object] = (child.stdout, child.stderr)
    assert outputs == (None, None)  # as subprocess.run leaves them
    shown = capfd.readouterr()
    assert (shown.out, shown.err) == ("out\n", "err\n")


def test_a_fork_server_that_died_is_said_and_the_next_child_gets_a_new_one() -> None:
    run_child("pass\n")
    dead = workspace_helpers._fork_server()
    dead.kill()
    dead.wait()
    with pytest.raises(RuntimeError, match=r"the workspace tests' fork server ended \(-9\)"):
        run_child("pass\n")
    assert run_child("os._exit(5)\n").returncode == 5
    assert workspace_helpers._fork_server() is not dead
