"""The example tools of examples/tools/, built and copied for the tests that call them.

:func:`built_examples` runs ``make tools`` once per test process (a no-op when the
modules are newer than their sources; `make test` builds them before pytest starts), with
this interpreter's ``ziglang`` and without re-making the virtualenv the tests run from
(``TOOL_NEEDS=``). Only a missing ``ziglang`` package skips; a failing build fails.
:func:`copy_examples` copies tool folders into a tool directory of a test's own,
owned by root with mode 0755 as gatewayd requires of tool directories (a checkout made
under another umask would not be).
"""

from __future__ import annotations

import functools
import importlib.util
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import ROOT

EXAMPLES = ROOT / "examples" / "tools"
# Each example's folder and the tool it holds.
TOOL_NAMES = {
    "wordcount": "text.wordcount",
    "search": "files.search",
    "write": "files.write",
    "summarize": "text.summarize",
    "py-lines": "files.lines",
}


@functools.cache
def _build() -> str | None:
    """None when the modules are built, else why not (the build's own words)."""
    if importlib.util.find_spec("ziglang") is None:
        return "SKIP"
    done = subprocess.run(
        ["make", "-s", "tools", "TOOL_NEEDS=", f"PY={sys.executable}"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,  # the first build ever also builds zig's WASI libc (~30 s)
        check=False,
    )
    if done.returncode != 0:
        return f"make tools failed ({done.returncode}):\n{done.stderr[-4000:]}"
    return None


def built_examples() -> Path:
    """examples/tools with every module built (skips when ziglang is not installed)."""
    problem = _build()
    if problem == "SKIP":
        pytest.skip("the ziglang package (the dev extra) is not installed: pip install -e '.[dev]'")
    if problem is not None:
        pytest.fail(problem)
    return EXAMPLES


def copy_examples(dest: Path, names: tuple[str, ...] = tuple(TOOL_NAMES)) -> Path:
    """A tool directory at ``dest`` holding copies of the built examples ``names``."""
    source = built_examples()
    dest.mkdir(mode=0o755, parents=True, exist_ok=True)
    dest.chmod(0o755)
    for name in names:
        shutil.copytree(source / name, dest / name)
        for path in (dest / name, *(dest / name).rglob("*")):
            path.chmod(0o755 if path.is_dir() else 0o644)
    return dest
