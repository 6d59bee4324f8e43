"""What the workspace tests share: a tree's whole contents to compare, and the clean-up
of the mounts a failed test left."""

from __future__ import annotations

import atexit
import contextlib
import functools
import json
import os
import stat
import subprocess
import sys
import tempfile
import threading
from pathlib import Path

from gatewayd.workspace.store import _mounts_under
from tests.conftest import ROOT

Tree = dict[str, tuple[object, ...]]


def tree(root: Path) -> Tree:
    """Everything below ``root``: kind, content or link target, and permission bits."""
    found: Tree = {}
    for dirpath, dirnames, filenames in os.walk(root):
        for name in dirnames + filenames:
            path = Path(dirpath, name)
            rel = str(path.relative_to(root))
            st = os.lstat(path)
            if stat.S_ISLNK(st.st_mode):
                found[rel] = ("link", os.readlink(path))
            elif stat.S_ISDIR(st.st_mode):
                found[rel] = ("dir", stat.S_IMODE(st.st_mode))
            else:
                found[rel] = ("file", path.read_bytes(), stat.S_IMODE(st.st_mode))
    return found


def unmount_all_under(path: Path) -> None:
    """Whatever a failed test left mounted below ``path`` must not outlive it."""
    for point in _mounts_under(path):
        subprocess.run(["umount", "-l", str(point)], check=False)


# What every child below starts with: the names its script uses to patch a step.
CHILD_PRELUDE = (
    "import os\n"
    "from pathlib import Path\n"
    "from gatewayd.workspace import journal, overlay\n"
    "from gatewayd.workspace.store import WorkspaceStore\n"
)


# The modules the children's scripts import and patch, imported once per test process by
# a fork server that forks every child: each child is then a process of its own in the
# state of a fresh ``python -c`` that has just imported them, in milliseconds where
# importing them again takes 0.4 s of CPU (the workspace tests start twenty children).
CHILD_PRELOAD = (
    "gatewayd.workspace.agentfs",
    "gatewayd.workspace.journal",
    "gatewayd.workspace.overlay",
    "gatewayd.workspace.store",
)

# The fork server: ``python -c`` with CHILD_PRELOAD imported, reading one request a line
# (JSON: the script, its directory, environment and output files) and answering each with
# the child's exit status as ``subprocess`` gives it. Ours, not multiprocessing's fork
# server: that one's children import the parent's ``__main__`` again (pytest's script)
# and end through its own bootstrap; a child here leaves the loop and ends as
# ``python -c`` ends (atexit handlers, threads joined, a traceback and 1 on an error).
_FORK_SERVER = """\
import gc, json, os, sys
for _name in sys.argv[1:]:
    __import__(_name)
# What is loaded now is never collected: a child's collections, and its exit's, then
# leave those pages shared instead of copying them (0.3 s a child otherwise).
gc.freeze()


def _serve():
    for line in sys.stdin.buffer:
        request = json.loads(line)
        pid = os.fork()
        if pid == 0:
            return request
        _, status = os.waitpid(pid, 0)
        sys.stdout.write(f"{os.waitstatus_to_exitcode(status)}\\n")
        sys.stdout.flush()
    sys.exit(0)


_request = _serve()
sys.argv = ["-c"]
os.chdir(_request["cwd"])
os.environ.clear()
os.environ.update(_request["env"])
for _fd, _path in ((0, os.devnull), (1, _request["stdout"]), (2, _request["stderr"])):
    _opened = os.open(_path, os.O_RDWR)
    os.dup2(_opened, _fd)
    os.close(_opened)
exec(compile(_request["script"], "<string>", "exec"), {"__name__": "__main__"})
"""
# How long the fork server may take to end once its requests end (the test process's
# exit); it has no child then, so it ends at once unless it is stuck.
_FORK_SERVER_STOP_S = 5.0
_fork_server_lock = threading.Lock()


@functools.cache
def _fork_server() -> subprocess.Popen[bytes]:
    server = subprocess.Popen(
        [sys.executable, "-c", _FORK_SERVER, *CHILD_PRELOAD],
        cwd=ROOT,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
    )
    atexit.register(_stop_fork_server, server)
    return server


def _stop_fork_server(server: subprocess.Popen[bytes]) -> None:
    assert server.stdin is not None
    with contextlib.suppress(BrokenPipeError):  # it died before (run_child said so)
        server.stdin.close()
    try:
        server.wait(timeout=_FORK_SERVER_STOP_S)
    except subprocess.TimeoutExpired:
        server.kill()
        server.wait()


def run_child(script: str, *, capture_output: bool = False) -> subprocess.CompletedProcess[bytes]:
    """``script`` (after :data:`CHILD_PRELUDE`) in a Python process of its own, as a
    second gatewayd command runs, or a daemon that the script kills (``os._exit(9)``)
    at the step a crash is tested at; the caller checks how it ended (the exit status
    as ``subprocess`` gives it: negative for a signal)."""
    source = CHILD_PRELUDE + script
    with tempfile.TemporaryDirectory(prefix="cg-child-") as directory:
        outputs = (Path(directory, "stdout"), Path(directory, "stderr"))
        for path in outputs:
            path.touch()
        request = {
            "script": source,
            "cwd": str(ROOT),
            "env": dict(os.environ),
            "stdout": str(outputs[0]),
            "stderr": str(outputs[1]),
        }
        with _fork_server_lock:
            server = _fork_server()
            assert server.stdin is not None and server.stdout is not None
            try:
                server.stdin.write(json.dumps(request).encode() + b"\n")
                server.stdin.flush()
                status = server.stdout.readline()
            except BrokenPipeError:
                status = b""
            if not status:  # it died: the next child gets a new one
                _fork_server.cache_clear()
                raise RuntimeError(f"the workspace tests' fork server ended ({server.poll()})")
        stdout, stderr = (path.read_bytes() for path in outputs)
    if not capture_output:  # shown with the test's output, as inherited streams would be
        sys.stdout.write(stdout.decode(errors="replace"))
        sys.stderr.write(stderr.decode(errors="replace"))
    return subprocess.CompletedProcess(
        [sys.executable, "-c", source],
        int(status),
        stdout if capture_output else None,
        stderr if capture_output else None,
    )


def commit_in_child(
    state: Path, run_id: str, patch: str, *, capture_output: bool = False
) -> subprocess.CompletedProcess[bytes]:
    """Commit ``run_id`` of the store in ``state`` from a child process after ``patch``
    (the script that makes a step of the commit die there)."""
    return run_child(
        patch + f"WorkspaceStore(Path({str(state)!r})).commit({run_id!r})\n",
        capture_output=capture_output,
    )
