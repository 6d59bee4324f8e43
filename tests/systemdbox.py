"""A real systemd (PID 1) for tests, in a container: ``../shared/tools/systemd-box``.

The tool boots ``systemd-nspawn --volatile=yes`` from this host's own ``/usr`` with the
checkout bound read-write at its own path (its root, /etc, /var and /opt are a fresh
tmpfs that vanishes at stop), and runs commands inside with ``nsenter``. This module
starts one box, runs commands in it as an operator's root shell would (a clean
environment, the checkout as the working directory), and stops it, also when the start
failed half-way: the tool leaves its pid and log files under ``/run/systemd-box`` when
nspawn dies before systemd is up, and nothing of a test session may stay behind.

Box names carry the test worker and the pid (``<prefix>-<worker>-<pid>``): two workers,
or two sessions on one machine, never meet in one box. ``SYSTEMD_BOX_NAME_PREFIX``
changes the prefix (a developer sharing the machine names boxes after their work).
"""

from __future__ import annotations

import contextlib
import os
import shlex
import shutil
import signal
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Final

ROOT: Final = Path(__file__).resolve().parent.parent
# The team's tool, kept beside the checkout (shared/tools/); a clone made elsewhere (CI
# clones main wherever it likes) uses the copy committed in tests/tools/. SYSTEMD_BOX
# names another copy.
_SHARED_TOOL: Final = ROOT.parent / "shared" / "tools" / "systemd-box"
_OWN_TOOL: Final = ROOT / "tests" / "tools" / "systemd-box"
TOOL: Final = Path(
    os.environ.get("SYSTEMD_BOX", _SHARED_TOOL if _SHARED_TOOL.is_file() else _OWN_TOOL)
)
# Through bash: a copy of shared/ may lack its execute bits (CI lays it read-only).
_TOOL_ARGV: Final = ("/bin/bash", str(TOOL))
STATE_DIR: Final = Path("/run/systemd-box")
NAME_PREFIX: Final = os.environ.get("SYSTEMD_BOX_NAME_PREFIX", "gatewayd-e2e")
# Booting takes ~2-9 s on an idle machine; the tool itself gives up after 60 s.
START_TIMEOUT_S: Final = 120.0
# A poweroff takes a second or two; the tool SIGKILLs nspawn after 30 s.
STOP_TIMEOUT_S: Final = 60.0
# What one command in the box may take unless its caller says (make install builds and
# installs a wheel with its dependencies: ~40 s).
COMMAND_TIMEOUT_S: Final = 60.0
# An operator's root shell: the system's PATH, no virtualenv of the checkout's. pip's own
# variables pass (where this machine's package index is), nothing else of the test's.
BOX_PATH: Final = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
PASSED_PREFIXES: Final = ("PIP_",)


class BoxUnavailable(Exception):
    """The box could not boot on this machine; the message says why (the skip reason)."""


class BoxCommandFailed(Exception):
    """A command in the box exited non-zero where the caller required success."""

    def __init__(self, argv: list[str], done: subprocess.CompletedProcess[str]) -> None:
        self.done = done
        super().__init__(
            f"in the box: {shlex.join(argv)} exited {done.returncode}\n"
            f"stdout:\n{done.stdout[-4000:]}\nstderr:\n{done.stderr[-4000:]}"
        )


def box_name(tag: str) -> str:
    """A name for this test worker's box: prefix, tag, worker, pid (a valid hostname)."""
    worker = os.environ.get("PYTEST_XDIST_WORKER", "main")
    return f"{NAME_PREFIX}-{tag}-{worker}-{os.getpid()}"


def stop_stale_boxes() -> list[str]:
    """Stop the boxes of earlier test sessions that were killed before their teardown
    (named with this prefix and the pid of a process that is gone); their names."""
    stale = []
    for init in sorted(STATE_DIR.glob(f"{NAME_PREFIX}-*.init")):
        name = init.name.removesuffix(".init")
        owner = name.rsplit("-", 1)[-1]
        if owner.isdigit() and not Path(f"/proc/{owner}").exists():
            stop_box(Box(name))
            stale.append(name)
    return stale


def unavailable_reason() -> str | None:
    """Why no box can be started here at all, or None."""
    if os.geteuid() != 0:
        return "systemd-box needs root (systemd-nspawn)"
    if not TOOL.is_file():
        return f"no systemd-box tool at {TOOL} (set SYSTEMD_BOX)"
    if shutil.which("systemd-nspawn") is None:
        return "systemd-nspawn is missing: make system-packages installs systemd-container"
    return None


def _environment() -> dict[str, str]:
    env = {"PATH": BOX_PATH, "HOME": "/root", "LANG": "C.UTF-8", "TERM": "dumb"}
    env.update({k: v for k, v in os.environ.items() if k.startswith(PASSED_PREFIXES)})
    return env


@dataclass
class Box:
    """A booted box. Commands run as root in every namespace of the box's PID 1, in the
    checkout (bound at its own path)."""

    name: str
    commands: list[str] = field(default_factory=list)

    def run(
        self,
        *argv: str,
        input: str | None = None,
        check: bool = True,
        timeout: float = COMMAND_TIMEOUT_S,
    ) -> subprocess.CompletedProcess[str]:
        """Run ``argv`` in the box; with ``check``, BoxCommandFailed on a non-zero exit."""
        self.commands.append(shlex.join(argv))
        done = subprocess.run(
            [*_TOOL_ARGV, "run", self.name, "--", *argv],
            input=input,
            capture_output=True,
            text=True,
            timeout=timeout,
            cwd=ROOT,
            env=_environment(),
            check=False,
        )
        if check and done.returncode != 0:
            raise BoxCommandFailed(list(argv), done)
        return done

    def sh(self, script: str, *, check: bool = True, timeout: float = COMMAND_TIMEOUT_S) -> str:
        """A shell script in the box (``set -eu``); its stdout."""
        return self.run("/bin/sh", "-euc", script, check=check, timeout=timeout).stdout

    def popen(self, *argv: str) -> subprocess.Popen[str]:
        """Start ``argv`` in the box and return at once (the caller waits for it)."""
        self.commands.append(shlex.join(argv) + " &")
        return subprocess.Popen(
            [*_TOOL_ARGV, "run", self.name, "--", *argv],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            cwd=ROOT,
            env=_environment(),
        )

    def read(self, path: str) -> str:
        return self.run("cat", path).stdout

    def exists(self, path: str) -> bool:
        return self.run("test", "-e", path, check=False).returncode == 0

    def append(self, path: str, text: str) -> None:
        """Append ``text`` to the file ``path`` in the box (its owner and mode kept)."""
        self.run("/bin/sh", "-euc", 'cat >> "$1"', "append", path, input=text)

    def write(self, path: str, text: str, mode: int = 0o644) -> None:
        """Write ``path`` in the box (its parents made), mode ``mode``."""
        self.run(
            "/bin/sh",
            "-euc",
            'mkdir -p "$(dirname "$1")"; cat > "$1"; chmod "$2" "$1"',
            "write",
            path,
            f"{mode:o}",
            input=text,
        )


def start_box(name: str) -> Box:
    """Boot a box named ``name``. BoxUnavailable (after removing whatever the failed start
    left) when it does not come up."""
    reason = unavailable_reason()
    if reason is not None:
        raise BoxUnavailable(reason)
    try:
        done = subprocess.run(
            [*_TOOL_ARGV, "start", name],
            capture_output=True,
            text=True,
            timeout=START_TIMEOUT_S,
            cwd=ROOT,
            check=False,
        )
    except subprocess.TimeoutExpired:
        _remove_failed_start(name)
        raise BoxUnavailable(
            f"systemd-box start {name} took over {START_TIMEOUT_S:.0f} s"
        ) from None
    if done.returncode != 0:
        log = _tail(STATE_DIR / f"{name}.log")
        _remove_failed_start(name)
        raise BoxUnavailable(
            f"systemd-box start {name} failed (exit {done.returncode}): "
            f"{done.stderr.strip()[-1500:]}{log}"
        )
    return Box(name)


def stop_box(box: Box) -> None:
    """Power the box off and wait; whatever the tool leaves of it is removed too."""
    try:
        subprocess.run(
            [*_TOOL_ARGV, "stop", box.name],
            capture_output=True,
            text=True,
            timeout=STOP_TIMEOUT_S,
            cwd=ROOT,
            check=False,
        )
    finally:
        _remove_failed_start(box.name)


def _remove_failed_start(name: str) -> None:
    """End the nspawn this start made (its own session: setsid) and remove its files."""
    pid_file = STATE_DIR / f"{name}.nspawn"
    try:
        pid = int(pid_file.read_text().strip())
    except (OSError, ValueError):
        pid = None
    if pid is not None and _is_nspawn(pid):
        # Its process group (the container's processes), and itself in case it has not
        # made its own session yet.
        with contextlib.suppress(ProcessLookupError):
            os.killpg(pid, signal.SIGKILL)
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
        deadline = time.monotonic() + STOP_TIMEOUT_S
        while _is_nspawn(pid) and time.monotonic() < deadline:
            time.sleep(0.1)
    for leftover in STATE_DIR.glob(f"{name}.*"):
        leftover.unlink(missing_ok=True)


def _is_nspawn(pid: int) -> bool:
    """Whether ``pid`` is still that box's nspawn (not a reused pid of anything else)."""
    try:
        return "systemd-nspawn" in Path(f"/proc/{pid}/cmdline").read_bytes().decode(
            errors="replace"
        )
    except OSError:
        return False


def _tail(log: Path) -> str:
    try:
        lines = log.read_text(errors="replace").splitlines()[-10:]
    except OSError:
        return ""
    return "\nnspawn's log:\n" + "\n".join(lines) if lines else ""
