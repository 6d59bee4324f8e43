"""The floor of a command's start in a run's sandbox: gatewayd's launcher program and
bwrap alone, with the plan a run's command gets, timed from the launcher's spawn to the
moment the command runs (it prints the host's clock: the sandbox shares it).

Used by ``bench/cli_start.py`` for the attached ``gatewayd run``'s floor: what no
implementation of the design can skip between "the run exists" and "its command runs".
Not in it: gatewayd's own work (audit entries, the plan's building and checks, the
pinned directories, trio's supervision). In it: a fresh command cgroup with the run's
limits, joined by the launcher as gatewayd's commands join theirs (made before the
spawn, removed after, neither timed), the run's network namespace, a uid of its own,
the same rlimits, the seccomp filter and generated files on memfds made once, bwrap's
namespaces and mounts.
"""

from __future__ import annotations

import contextlib
import os
import secrets
import socket
import subprocess
import time
from pathlib import Path

import trio

from gatewayd.sandbox.cgroup import CgroupSupport, create_command_cgroup, probe_cgroups
from gatewayd.sandbox.launch import memfd, sandbox_argv, start_launched
from gatewayd.sandbox.limits import HostUser, LimitMechanism, SandboxLimits, rlimits
from gatewayd.sandbox.netns import create_run_netns, remove_run_netns
from gatewayd.sandbox.plan import BWRAP, build_plan, probe_host_layout

# The command: the host's clock at its start, in nanoseconds.
STAMP = ("/bin/date", "+%s%N")


class SandboxStartFloor:
    """A run's sandbox without gatewayd around it, in ``base``; ``start()`` times one
    command's start. A context manager: the namespace, memfds and socket are released
    on exit."""

    def __init__(self, base: Path, *, uid: int, netns_prefix: str) -> None:
        self.base = base
        self.user = HostUser(uid=uid, gid=uid)
        self.limits = SandboxLimits()
        self.run_id = secrets.token_hex(16)
        self.cgroups: CgroupSupport = probe_cgroups()
        self._stack = contextlib.ExitStack()
        self._netns_prefix = netns_prefix
        self.argv: list[str] = []
        self.fds: tuple[int, ...] = ()
        self.netns_fd = -1

    def __enter__(self) -> SandboxStartFloor:
        stack = self._stack
        ws, tool, state = (self.base / f"sandbox-floor-{name}" for name in ("ws", "tool", "state"))
        for directory in (ws, tool, state):
            directory.mkdir(mode=0o755)
        os.chown(ws, self.user.uid, self.user.gid)
        run_dir = state / "runs" / self.run_id
        run_dir.mkdir(parents=True)
        for directory in (state / "runs", run_dir):
            directory.chmod(0o755)
        listener = stack.enter_context(socket.socket(socket.AF_UNIX))
        listener.bind(str(run_dir / "gateway.sock"))
        handle = create_run_netns(self.run_id, prefix=self._netns_prefix)
        stack.callback(remove_run_netns, handle.name)
        plan = build_plan(
            run_id=self.run_id,
            workspace_host=str(ws),
            policy_paths=[],
            gateway_socket_host=str(run_dir / "gateway.sock"),
            cogni_tool_host_dir=str(tool),
            command=STAMP,
            extra_env_names=[],
            env_values={"LANG": "C.UTF-8"},
            state_dir=str(state),
            netns_path=str(handle.path),
            layout=probe_host_layout(),
        )
        data = {step.dest: memfd(stack, "cogni-data", step.data) for step in plan.data_steps}
        seccomp = memfd(stack, "cogni-seccomp", None)
        self.argv = sandbox_argv(plan, bwrap=BWRAP, data_fds=data, seccomp_fd=seccomp)
        self.fds = (*data.values(), seccomp)
        self.netns_fd = os.open(handle.path, os.O_RDONLY | os.O_CLOEXEC)
        stack.callback(os.close, self.netns_fd)
        return self

    def __exit__(self, *exc: object) -> None:
        self._stack.close()

    def start(self) -> float:
        """One command's start: seconds from the launcher's spawn to the command's own
        clock reading. Blocking."""
        cgroup = None
        joins: tuple[bytes, ...] = ()
        memory = processes = LimitMechanism.RLIMIT
        if self.cgroups.available:
            cgroup = create_command_cgroup(
                self.cgroups,
                run_id=self.run_id,
                memory_bytes=self.limits.memory_bytes,
                max_processes=self.limits.max_processes,
            )
            joins = cgroup.join_files
            memory = LimitMechanism.CGROUP
            if cgroup.pids_dir is not None:
                processes = LimitMechanism.CGROUP
        try:
            for fd in self.fds:
                os.lseek(fd, 0, os.SEEK_SET)  # bwrap reads each from the current offset
            spawned = time.time_ns()
            process = start_launched(
                self.argv,
                netns_fd=self.netns_fd,
                user=self.user,
                joins=joins,
                limits=rlimits(self.limits, memory=memory, processes=processes),
                pass_fds=self.fds,
                stdin=subprocess.DEVNULL,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
            )
            out, err = process.communicate()
            if process.returncode != 0:
                raise RuntimeError(f"the floor's sandbox failed ({process.returncode}): {err!r}")
            return (int(out) - spawned) / 1e9
        finally:
            if cgroup is not None:
                trio.run(cgroup.remove)
