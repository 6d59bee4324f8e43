"""The floor of a run's start + end: only the kernel work a run cannot do without, given
the design's durability and isolation, in as little Python as that takes.

    .venv/bin/python bench/run_start_floor.py [--iterations 100] [--warmup 5]

Why it exists: the target for run create + teardown (at most 15 ms at the median, overlay
mode) is judged against what no implementation of this design can skip. This module does
one overlay run's start + end with plain system calls (no trio, no pydantic, no
gatewayd code), step for step in gatewayd's order and with its concurrency (the
namespace made in a long-lived thread of its own while the session opens, the run's
lease record written in another meanwhile, the first audit flush made there while the
run's socket is opened; the run's directory deleted in that other thread while the
session ends, and the last audit flush made while it is deleted).
``bench/sandbox_launch.py --run-start`` runs it in the same rounds as
``RunManager.start`` + ``end`` and prints both; run alone, it prints the floor by itself.

Every step, with the place in gatewayd that does it (each record flushed is one crash
recovery reads):

start
  1. the run's directory: ``mkdir`` (gatewayd/runs/registry.py:175).
  2. the network namespace, in a long-lived thread while 3-6 run: an empty file under
     /run/netns, ``unshare(CLONE_NEWNET)``, a bind mount of
     ``/proc/thread-self/ns/net`` onto it, ``lo`` up over a netlink socket opened
     there (one acknowledged ``RTM_NEWLINK``), ``setns`` home
     (gatewayd/sandbox/netns.py:425-444, 515; session.py ``NamespaceAhead``).
  3. the session's directory: ``mkdir``, its lock file ``flock``ed, ``meta.json``
     (state live: what recovery keeps a dead run's session by) written atomically:
     fsync #1 (file; its name made durable by #3) (gatewayd/workspace/store.py:760,
     780, 786); the store's base lock taken around the lend and the mount (store.py
     ``_writing_base``).
  4. the base lent to the run's uid: ``lease.json`` in the session's directory (what
     recovery gives back after a crash), fsync #2 (file), #3 (the directory: both
     names), before the first chown; then one ``lstat`` and ``chown`` per entry, and
     ``getxattr(security.capability)`` per file (a chown clears file capabilities:
     such a file is never lent), one read of the mount table (the walk enters no
     mount) (gatewayd/sandbox/lease.py:233, 240, 365; runs/workspaces.py ``BaseLender``).
  5. the overlay: ``session/``, ``upper``, ``work``, ``merged`` made, ``mount`` with
     gatewayd's options (gatewayd/workspace/overlay.py:401, 407, 408); the view's top
     directory chowned to the run's uid (gatewayd/runs/lifecycle.py:520).
  6. the run's directory opened to the uid's group, its mount points ``mnt/`` and
     ``mnt/0`` (the workspace's pin) made and the view opened ``O_PATH``
     (gatewayd/sandbox/session.py:382, 950, 957, 966).
  7. the apps folder the sandbox's cover needs as a mount point: ``mkdirat`` in the
     view, chowned, and its record ``apps-folder.json`` in the run's directory (what
     the next start after a crash of gatewayd removes the folder by), renamed into
     place, not flushed: the record reaches the folder only through the view's
     mount, which no reboot leaves (gatewayd/sandbox/appsfolder.py:201, 208, 215).
  8. the run's own lease record (a lease of no tree: only the run's uid, whose
     processes the next start kills after a crash; read strictly, so whole), in the
     run's directory: fsync #4 (file only), written in the worker thread while 3-7 run,
     waited for here (gatewayd/sandbox/lease.py ``record_uid``; session.py
     ``UidRecordAhead``, taken at the sandbox's lease).
  9. ``run_created`` + ``workspace_opened``: one append, fdatasync #1, then the head
     file moved (a ``pwrite``: what tells a truncated log), in the worker thread while
     10 runs, waited for after it (gatewayd/runs/lifecycle.py ``start``: the flush asked
     for when recorded, ``_serve``: the socket opened meanwhile; audit/writer.py).
 10. the run's socket: ``socket``, ``bind``, ``chown`` to the run's group, ``chmod``,
     ``listen`` (gatewayd/server.py:95 ``open_unix_listener``).

end
 11. the socket closed; the end's ``/proc`` scan for the run's uid: every
     ``/proc/PID/status`` read once (gatewayd/sandbox/session.py:793;
     sandbox/uids.py ``pids_of_uid``).
 12. the apps folder made for the run removed (session.py:796; appsfolder.py:289).
 13. the namespace removed: ``umount2(MNT_DETACH)``, ``unlink`` (session.py:807;
     netns.py:166, 174).
 14. in another thread meanwhile, the run's directory deleted: its socket, two
     records, two mount points, itself (gatewayd/runs/registry.py:209).
 15. the session sealed: the view unmounted (overlay.py:463), the upper directory
     read (the delta: here empty; store.py:909), ``seal.json`` (the signatures the
     commit's conflict check compares, durable before any record says kept): fsync
     #5 (file), #6 (directory) (store.py:923).
 16. the base given back: the lease read, one ``lstat`` and ``chown`` per entry, one
     read of the mount table, the lease removed (gatewayd/runs/workspaces.py:255, 256).
 17. the on-end (keep): ``meta.json`` state kept: fsync #7 (file), #8 (directory)
     (store.py:891); the session's lock released.
 18. ``workspace_ended`` + ``run_ended``: one append, fdatasync #2, the head moved,
     while the run's directory is deleted (14), then the wait for that deletion
     (gatewayd/runs/lifecycle.py ``_finish``: the flush asked for when recorded).

Left out, as gatewayd's own and not the design's need: the namespace's verification
dumps (two netlink requests), ``/run/netns`` made a shared mount (gatewayd: at its
first creation only; once per boot suffices), the socket bound under a staging name
and linked into place, the chmods after mkdirs that could be given the mode at once, the extra
reads of the mount table (the lendable-roots check), the audit log's hash tree
writes (page-cache writes beside its flush), every ``stat`` that re-checks
what was just made, and every hand-off between threads but those above. The uid
itself comes from the pool's records in memory (gatewayd/sandbox/uids.py): no system
call, so nothing of it is here.
"""

from __future__ import annotations

import argparse
import ctypes
import errno
import fcntl
import os
import queue
import secrets
import shutil
import socket
import statistics
import struct
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Final

_LIBC: Final = ctypes.CDLL(None, use_errno=True)
_CLONE_NEWNET: Final = 0x40000000
_MS_NOSUID: Final = 0x2
_MS_NODEV: Final = 0x4
_MS_BIND: Final = 0x1000
_MNT_DETACH: Final = 0x2
# gatewayd/workspace/overlay.py MOUNT_OPTIONS: the same overlay.
_OVERLAY_OPTIONS: Final = "redirect_dir=off,metacopy=off,index=off,xino=off"
_NETNS_DIR: Final = Path("/run/netns")
# One acknowledged RTM_NEWLINK: lo (index 1 in every namespace) up.
_RTM_NEWLINK: Final = 16
_NLMSG_ERROR: Final = 2
_NLM_F_REQUEST: Final = 0x1
_NLM_F_ACK: Final = 0x4
_IFF_UP: Final = 0x1
_LO_UP: Final = struct.pack(
    "=IHHIIBBHiII", 32, _RTM_NEWLINK, _NLM_F_REQUEST | _NLM_F_ACK, 1, 0, 0, 0, 0, 1, 0, 0
)
_LO_UP_FLAGS: Final = struct.pack("=II", _IFF_UP, _IFF_UP)
# Records about as large as gatewayd's (meta.json ~350-430 bytes, the leases ~50-160,
# seal.json ~50, apps-folder.json ~140) and each flush's audit entries (~900-1,100).
_META: Final = b"m" * 400
_LEASE: Final = b"l" * 160
_RUN_LEASE: Final = b"l" * 50
_APPS_RECORD: Final = b"a" * 140
_SEAL: Final = b"s" * 50
_AUDIT_BATCH: Final = b"e" * 1000 + b"\n"
_AUDIT_HEAD: Final = b"h" * 185  # gatewayd/audit/head.py's record
_STATUS_BYTES: Final = 4096  # gatewayd/sandbox/uids.py _STATUS_READ_BYTES

Durations = dict[str, float]


def _check(result: int, what: str) -> None:
    if result != 0:
        code = ctypes.get_errno()
        raise OSError(code, f"{what}: {os.strerror(code)}")


def write_record(path: Path, data: bytes, *, sync_dir: bool, flush: bool = True) -> None:
    """A record written atomically and durably: temporary file, fsync, rename, and the
    directory's fsync unless ``sync_dir`` is False (gatewayd/files.py write_atomically);
    ``flush`` False: no fsync at all (whole whenever its name is there)."""
    tmp = path.with_name(f".{path.name}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o600)
    try:
        os.write(fd, data)
        if flush:
            os.fsync(fd)
    finally:
        os.close(fd)
    os.rename(tmp, path)
    if sync_dir:
        dir_fd = os.open(path.parent, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        try:
            os.fsync(dir_fd)
        finally:
            os.close(dir_fd)


def rechown(root: Path, to_uid: int, to_gid: int, *, lending: bool) -> int:
    """Every entry of ``root`` (itself included) to ``to_uid``/``to_gid``: one ``lstat``
    and ``chown`` each, ``getxattr`` of each file when lending; the mount table read once
    (the walk enters no mount point). Returns how many entries changed."""
    with open("/proc/self/mountinfo", "rb") as table:
        table.read()
    os.lchown(root, to_uid, to_gid)
    changed = 1
    todo = [str(root)]
    while todo:
        with os.scandir(todo.pop()) as entries:
            for entry in entries:
                entry.stat(follow_symlinks=False)
                if entry.is_dir(follow_symlinks=False):
                    todo.append(entry.path)
                elif lending:
                    try:
                        os.getxattr(entry.path, "security.capability", follow_symlinks=False)
                    except OSError as exc:
                        if exc.errno != errno.ENODATA:
                            raise
                os.lchown(entry.path, to_uid, to_gid)
                changed += 1
    return changed


class _Worker:
    """A long-lived thread running one job at a time (gatewayd's namespace thread, and
    the worker thread trio keeps between hand-offs)."""

    def __init__(self, name: str, setup: Callable[[], int] | None = None) -> None:
        self._jobs: queue.SimpleQueue[tuple[Callable[[int], object], queue.SimpleQueue[object]]]
        self._jobs = queue.SimpleQueue()
        self._setup = setup
        threading.Thread(target=self._serve, name=name, daemon=True).start()

    def _serve(self) -> None:
        home = self._setup() if self._setup is not None else -1
        while True:
            job, answer = self._jobs.get()
            try:
                answer.put(job(home))
            except BaseException as exc:
                answer.put(exc)

    def submit(self, job: Callable[[int], object]) -> Callable[[], object]:
        """Start ``job``; returns what waits for its result (re-raising its error)."""
        answer: queue.SimpleQueue[object] = queue.SimpleQueue()
        self._jobs.put((job, answer))

        def wait() -> object:
            got = answer.get()
            if isinstance(got, BaseException):
                raise got
            return got

        return wait


def _home_netns() -> int:
    return os.open("/proc/self/ns/net", os.O_RDONLY | os.O_CLOEXEC)


def make_netns(path: Path, home: int) -> float:
    """In the namespace thread: the namespace pinned at ``path``, lo up, back home.
    Returns the seconds it took."""
    started = time.perf_counter()
    os.close(os.open(path, os.O_RDONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0))
    _check(_LIBC.unshare(_CLONE_NEWNET), "unshare")
    try:
        _check(
            _LIBC.mount(b"/proc/thread-self/ns/net", os.fsencode(path), b"none", _MS_BIND, None),
            "bind mount of the namespace",
        )
        with socket.socket(socket.AF_NETLINK, socket.SOCK_RAW | socket.SOCK_CLOEXEC) as route:
            route.bind((0, 0))
            route.send(_LO_UP + _LO_UP_FLAGS)
            answer = route.recv(4096)
        kind = struct.unpack_from("=H", answer, 4)[0]
        (error,) = struct.unpack_from("=i", answer, 16)
        if kind != _NLMSG_ERROR or error != 0:
            raise OSError(-error, f"lo up: {os.strerror(-error)}")
    finally:
        _check(_LIBC.setns(home, _CLONE_NEWNET), "setns home")
    return time.perf_counter() - started


@dataclass
class RunStartFloor:
    """One overlay run's start + end as bare kernel work (see the module doc), in
    ``base`` (the file system gatewayd's state lies on), over ``workspace``, lent to
    ``uid``; namespaces named ``netns_prefix`` + a 32-hex id."""

    base: Path
    workspace: Path
    uid: int
    netns_prefix: str
    runs: Path = field(init=False)
    store: Path = field(init=False)
    _audit_fd: int = field(init=False)
    _head_fd: int = field(init=False)
    _netns: _Worker = field(init=False)
    _worker: _Worker = field(init=False)

    def __post_init__(self) -> None:
        self.runs = self.base / "floor-state" / "runs"
        self.store = self.base / "floor-agent" / "workspaces"
        for directory in (self.runs, self.store):
            directory.mkdir(mode=0o711, parents=True, exist_ok=True)
        (self.store / ".base.lock").touch(mode=0o600)
        _NETNS_DIR.mkdir(mode=0o755, exist_ok=True)
        flags = os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_CLOEXEC
        self._audit_fd = os.open(self.base / "floor-state" / "audit.jsonl", flags, 0o600)
        head = self.base / "floor-state" / "audit.jsonl.head"
        self._head_fd = os.open(head, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        self._netns = _Worker("floor-netns", _home_netns)
        self._worker = _Worker("floor-worker")

    def close(self) -> None:
        os.close(self._audit_fd)
        os.close(self._head_fd)

    def _flush_audit(self) -> None:
        os.write(self._audit_fd, _AUDIT_BATCH)
        os.fdatasync(self._audit_fd)
        os.pwrite(self._head_fd, _AUDIT_HEAD, 0)

    def round(self) -> Durations:
        """One start + end; the wall time of the whole and of its steps (seconds), and
        the process's CPU time. Blocking."""
        t: Durations = {}
        uid = gid = self.uid
        run_id = secrets.token_hex(16)
        cpu = time.process_time()
        started = mark = time.perf_counter()

        def lap(key: str) -> None:
            nonlocal mark
            now = time.perf_counter()
            t[key] = t.get(key, 0.0) + now - mark
            mark = now

        # --- start ---
        run_dir = self.runs / run_id
        run_dir.mkdir(mode=0o710)  # 1
        netns = _NETNS_DIR / f"{self.netns_prefix}{run_id}"
        netns_made = self._netns.submit(lambda home: make_netns(netns, home))  # 2
        run_lease_written = self._worker.submit(  # 8, meanwhile
            lambda _: write_record(run_dir / "lease.json", _RUN_LEASE, sync_dir=False)
        )
        session = self.store / run_id
        session.mkdir(mode=0o700)  # 3
        lock = os.open(session / "lock", os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        write_record(session / "meta.json", _META, sync_dir=False)
        lap("store_open")
        base_lock = os.open(self.store / ".base.lock", os.O_RDWR | os.O_CLOEXEC)
        try:
            fcntl.flock(base_lock, fcntl.LOCK_EX)
            write_record(session / "lease.json", _LEASE, sync_dir=True)  # 4
            owner = os.stat(self.workspace)
            rechown(self.workspace, uid, gid, lending=True)
            lap("lend")
            state = session / "session"  # 5
            upper, work, merged = state / "upper", state / "work", state / "merged"
            state.mkdir(mode=0o700)
            for directory in (upper, work, merged):
                directory.mkdir(mode=0o755)
            options = f"lowerdir={self.workspace},upperdir={upper},workdir={work},"
            _check(
                _LIBC.mount(
                    b"overlay",
                    os.fsencode(merged),
                    b"overlay",
                    ctypes.c_ulong(_MS_NOSUID | _MS_NODEV),
                    os.fsencode(options + _OVERLAY_OPTIONS),
                ),
                "overlay mount",
            )
        finally:
            os.close(base_lock)
        os.chown(merged, uid, gid)
        lap("overlay")
        os.chown(run_dir, 0, gid)  # 6
        points = run_dir / "mnt"
        points.mkdir(mode=0o710)
        os.chown(points, 0, gid)
        view = os.open(merged, os.O_PATH | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
        (points / "0").mkdir(mode=0o700)
        lap("run_dir")
        os.mkdir("apps", 0o755, dir_fd=view)  # 7
        os.chown("apps", uid, gid, dir_fd=view, follow_symlinks=False)
        write_record(run_dir / "apps-folder.json", _APPS_RECORD, sync_dir=False, flush=False)
        lap("apps")
        t["netns"] = float(netns_made())  # type: ignore[arg-type]
        lap("netns_wait")
        run_lease_written()  # 8
        lap("run_lease")
        audit_flushed = self._worker.submit(lambda _: self._flush_audit())  # 9, meanwhile
        listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC)  # 10
        sock_path = run_dir / "gateway.sock"
        listener.bind(os.fspath(sock_path))
        os.chown(sock_path, -1, gid)
        os.chmod(sock_path, 0o660)
        listener.listen(1024)
        lap("socket")
        audit_flushed()
        lap("audit")
        created = time.perf_counter()

        # --- end ---
        listener.close()  # 11
        needles = (f"\t{uid}\t".encode(), f"\t{uid}\n".encode())
        left = []
        for entry in os.listdir("/proc"):
            if entry.isdigit():
                try:
                    fd = os.open(f"/proc/{entry}/status", os.O_RDONLY | os.O_CLOEXEC)
                except OSError:
                    continue
                try:
                    status = os.read(fd, _STATUS_BYTES)
                except OSError:
                    continue
                finally:
                    os.close(fd)
                ids = status[status.find(b"\nUid:") : status.find(b"\nFDSize:")]
                if any(needle in ids for needle in needles):
                    left.append(entry)
        if left:
            raise RuntimeError(f"processes of uid {uid} are running: {left}")
        lap("proc_scan")
        os.rmdir("apps", dir_fd=view)  # 12
        os.close(view)
        lap("apps_remove")
        _check(_LIBC.umount2(os.fsencode(netns), _MNT_DETACH), "umount the namespace")  # 13
        os.unlink(netns)
        lap("netns_remove")

        def delete_run_dir(_: int) -> float:  # 14
            began = time.perf_counter()
            for name in ("gateway.sock", "lease.json", "apps-folder.json"):
                os.unlink(run_dir / name)
            for directory in (points / "0", points, run_dir):
                directory.rmdir()
            return time.perf_counter() - began

        deleted = self._worker.submit(delete_run_dir)
        _check(_LIBC.umount2(os.fsencode(merged), 0), "umount the view")  # 15
        os.listdir(upper)
        write_record(session / "seal.json", _SEAL, sync_dir=True)
        lap("seal")
        with open(session / "lease.json", "rb") as record:  # 16
            record.read()
        rechown(self.workspace, owner.st_uid, owner.st_gid, lending=False)
        os.unlink(session / "lease.json")
        lap("give_back")
        write_record(session / "meta.json", _META, sync_dir=True)  # 17
        os.close(lock)
        lap("keep")
        self._flush_audit()  # 18, while 14 runs
        lap("audit")
        t["run_dir_delete"] = float(deleted())  # type: ignore[arg-type]
        lap("run_dir_wait")
        ended = time.perf_counter()
        t["total"] = ended - started
        t["start"] = created - started
        t["end"] = ended - created
        t["cpu"] = time.process_time() - cpu
        return t


def main() -> int:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--iterations", type=int, default=100)
    ap.add_argument("--warmup", type=int, default=5)
    args = ap.parse_args()
    if os.geteuid() != 0:
        print("run_start_floor: needs root (mounts, namespaces, chown)", file=sys.stderr)
        return 2
    prefix = f"cgfl{secrets.token_hex(4)}-"
    # A uid of bench/sandbox_launch.py's region (1.6e9..), away from any daemon's range.
    uid = 1_600_000_000 + secrets.randbelow(50_000) * 1024
    base = Path(tempfile.mkdtemp(prefix="cg-floor-", dir="/tmp"))
    try:
        workspace = base / "ws"
        for sub in ("src", "docs"):  # bench/sandbox_launch.py's small workspace
            (workspace / sub).mkdir(parents=True)
            for i in range(4):
                (workspace / sub / f"f{i}.txt").write_text("hello\n")
        floor = RunStartFloor(base=base, workspace=workspace, uid=uid, netns_prefix=prefix)
        samples: dict[str, list[float]] = {}
        for i in range(args.warmup + args.iterations):
            got = floor.round()
            if i >= args.warmup:
                for key, value in got.items():
                    samples.setdefault(key, []).append(value)
        floor.close()
    finally:
        shutil.rmtree(base, ignore_errors=True)
    print(f"run start + end floor, {args.iterations} rounds after {args.warmup} warm-up (ms):")
    for key, values in samples.items():
        print(f"  {key:<16}{statistics.median(values) * 1000:9.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
