"""gatewayd lifts its own descriptor limit at start (systemd's soft default is 1024), in a
fresh interpreter (the test process keeps its own limits)."""

from __future__ import annotations

import subprocess
import sys

CODE = """
import resource
soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
resource.setrlimit(resource.RLIMIT_NOFILE, (min(256, hard), hard))
from gatewayd.runs.startup import raise_open_file_limit
print(raise_open_file_limit() == hard, resource.getrlimit(resource.RLIMIT_NOFILE)[0] == hard)
"""


def test_the_soft_descriptor_limit_is_raised_to_the_hard_one() -> None:
    done = subprocess.run([sys.executable, "-c", CODE], capture_output=True, text=True, check=True)
    assert done.stdout.split() == ["True", "True"], done.stderr
