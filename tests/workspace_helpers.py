"""What the workspace tests share: a tree's whole contents to compare, and the clean-up
of the mounts a failed test left."""

from __future__ import annotations

import os
import stat
import subprocess
import sys
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


def run_child(script: str, *, capture_output: bool = False) -> subprocess.CompletedProcess[bytes]:
    """``script`` (after :data:`CHILD_PRELUDE`) in a Python process of its own, as a
    second gatewayd command runs, or a daemon that the script kills (``os._exit(9)``)
    at the step a crash is tested at; the caller checks how it ended."""
    return subprocess.run(
        [sys.executable, "-c", CHILD_PRELUDE + script],
        cwd=ROOT,
        capture_output=capture_output,
        check=False,
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
