"""How a run's network namespace is made now: by gatewayd's namespace thread, with no
fork, the thread back in the daemon's namespace afterwards, and nothing left behind
when it is removed or when a step of its making fails. Real namespaces and mounts.

(What a process inside sees is probed in test_netns.py, and from inside a real sandbox
in test_run_start.py.)
"""

from __future__ import annotations

import ctypes
import errno
import os
import secrets
import subprocess
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import trio

from gatewayd.files import LIBC
from gatewayd.sandbox import netns as netns_module
from gatewayd.sandbox.netns import (
    NETNS_RUN_DIR,
    NetnsError,
    create_run_netns,
    netns_name,
    remove_run_netns,
    stale_netns,
)
from gatewayd.sandbox.session import NamespaceAhead
from tests.integration.test_netns import _REASON, ip_netns_list

pytestmark = pytest.mark.skipif(_REASON is not None, reason=_REASON or "")

_FORKS = [0]
os.register_at_fork(before=lambda: _FORKS.__setitem__(0, _FORKS[0] + 1))


@pytest.fixture
def prefix() -> Iterator[str]:
    """A prefix of this test's own; whatever is left with it is removed afterwards."""
    mine = f"cgth{secrets.token_hex(3)}-"
    try:
        yield mine
    finally:
        for name in stale_netns(mine):
            remove_run_netns(name)


def mounted_at(path: Path) -> bool:
    with open("/proc/self/mountinfo", encoding="utf-8") as info:
        return any(line.split(" ")[4] == str(path) for line in info)


def namespace_of_thread(native_id: int) -> tuple[int, int]:
    st = os.stat(f"/proc/self/task/{native_id}/ns/net")
    return (st.st_dev, st.st_ino)


def daemon_namespace() -> tuple[int, int]:
    st = os.stat("/proc/self/ns/net")
    return (st.st_dev, st.st_ino)


def namespace_thread() -> threading.Thread:
    (thread,) = [t for t in threading.enumerate() if t.name == "gatewayd-netns"]
    return thread


def test_a_namespace_is_made_and_removed_without_a_fork_by_a_thread_that_goes_home(
    prefix: str,
) -> None:
    forks = _FORKS[0]
    handles = [create_run_netns(secrets.token_hex(16), prefix=prefix) for _ in range(3)]
    try:
        thread = namespace_thread()
        assert thread.native_id is not None
        assert namespace_of_thread(thread.native_id) == daemon_namespace()
        # This thread, and every other of the process, never left it either.
        assert {namespace_of_thread(t.native_id) for t in threading.enumerate() if t.native_id} == {
            daemon_namespace()
        }
        listed = ip_netns_list()
        for handle in handles:
            assert handle.name in listed
            assert mounted_at(handle.path)
            assert os.stat(handle.path).st_ino != daemon_namespace()[1]
        assert len({os.stat(h.path).st_ino for h in handles}) == 3
    finally:
        for handle in handles:
            assert remove_run_netns(handle.name) is True
    assert _FORKS[0] == forks
    subprocess.run(["true"], check=True, preexec_fn=lambda: None)
    assert _FORKS[0] == forks + 1  # the control: a fork is counted
    for handle in handles:
        assert not os.path.lexists(handle.path)
        assert not mounted_at(handle.path)
        assert handle.name not in ip_netns_list()


def test_the_namespace_directory_is_a_shared_mount_point_of_its_own(prefix: str) -> None:
    handle = create_run_netns(secrets.token_hex(16), prefix=prefix)
    try:
        with open("/proc/self/mountinfo", encoding="utf-8") as info:
            (line,) = [x for x in info if x.split(" ")[4] == str(NETNS_RUN_DIR)][-1:]
        # As iproute2 makes it: the pins propagate to mount namespaces made from ours.
        assert "shared:" in line.split(" - ")[0]
    finally:
        remove_run_netns(handle.name)


class _RecordingLibc:
    """gatewayd's libc, recording the target of every mount call."""

    def __init__(self) -> None:
        self.targets: list[bytes] = []

    def __getattr__(self, name: str) -> Any:
        return getattr(LIBC, name)

    def mount(self, source: bytes, target: bytes, *rest: Any) -> int:
        self.targets.append(target)
        return int(LIBC.mount(source, target, *rest))


def test_the_namespace_directory_is_shared_once_per_process(
    prefix: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    # iproute2 makes /run/netns a shared mount again at every creation (a recursive
    # mount call over every pin there); gatewayd at its first one only.
    remove_run_netns(create_run_netns(secrets.token_hex(16), prefix=prefix).name)
    libc = _RecordingLibc()
    monkeypatch.setattr(netns_module, "LIBC", libc)
    handles = [create_run_netns(secrets.token_hex(16), prefix=prefix) for _ in range(2)]
    monkeypatch.undo()
    for handle in handles:
        remove_run_netns(handle.name)
    assert libc.targets == [os.fsencode(h.path) for h in handles]  # the pins alone
    with open("/proc/self/mountinfo", encoding="utf-8") as info:
        (line,) = [x for x in info if x.split(" ")[4] == str(NETNS_RUN_DIR)][-1:]
    assert "shared:" in line.split(" - ")[0]


def test_a_namespace_directory_made_again_is_shared_again(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Shared once already, but the directory is gone (removed with what was mounted
    # there): the one made in its place is made a shared mount point of its own too.
    made = tmp_path / "netns"
    monkeypatch.setattr(netns_module, "NETNS_RUN_DIR", made)
    monkeypatch.setattr(netns_module._RUN_DIR_SHARED, "done", True)
    try:
        netns_module._share_run_dir()
        with open("/proc/self/mountinfo", encoding="utf-8") as info:
            lines = [x for x in info if x.split(" ")[4] == str(made)]
        assert lines and "shared:" in lines[-1].split(" - ")[0]
        assert netns_module._RUN_DIR_SHARED.done
    finally:
        while mounted_at(made):
            LIBC.umount2(os.fsencode(made), 2)  # MNT_DETACH


def test_a_refused_bind_mount_is_a_netns_error_and_leaves_nothing(
    prefix: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The namespace's bind source, made to fail: the mount is refused with ENOENT.
    monkeypatch.setattr(netns_module, "_BIND_SOURCE", "/proc/thread-self/ns/no-such-thing")
    run_id = secrets.token_hex(16)
    name = netns_name(run_id, prefix=prefix)
    with pytest.raises(NetnsError) as info:
        create_run_netns(run_id, prefix=prefix)
    message = str(info.value)
    assert info.value.name == name
    assert f"cannot create network namespace {name!r}" in message
    assert "bind-mount /proc/thread-self/ns/no-such-thing onto its mount point" in message
    assert "ENOENT (No such file or directory)" in message
    assert not os.path.lexists(NETNS_RUN_DIR / name)
    assert not mounted_at(NETNS_RUN_DIR / name)
    thread = namespace_thread()
    assert thread.native_id is not None
    assert namespace_of_thread(thread.native_id) == daemon_namespace()
    monkeypatch.undo()
    handle = create_run_netns(run_id, prefix=prefix)  # the same thread makes the next one
    assert namespace_thread() is thread
    remove_run_netns(handle.name)


class _SetnsFailsOnce:
    """The C library, but its next setns(2) fails with EPERM: the namespace thread
    cannot get back to the daemon's namespace."""

    def __init__(self) -> None:
        self.failed = False

    def setns(self, fd: int, nstype: int) -> int:
        if not self.failed:
            self.failed = True
            ctypes.set_errno(errno.EPERM)
            return -1
        result: int = LIBC.setns(fd, nstype)
        return result

    def __getattr__(self, name: str) -> Any:
        return getattr(LIBC, name)


def test_a_thread_that_cannot_get_home_is_retired_and_its_namespace_removed(
    prefix: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    create_run_netns(secrets.token_hex(16), prefix=prefix)  # the thread is up
    stranded = namespace_thread()
    retired = netns_module._NAMESPACE_THREAD.retired
    monkeypatch.setattr(netns_module, "LIBC", _SetnsFailsOnce())
    run_id = secrets.token_hex(16)
    name = netns_name(run_id, prefix=prefix)
    with pytest.raises(NetnsError) as info:
        create_run_netns(run_id, prefix=prefix)
    assert "return the thread that made it to gatewayd's own network namespace" in str(info.value)
    assert "EPERM" in str(info.value)
    assert not os.path.lexists(NETNS_RUN_DIR / name)
    assert not mounted_at(NETNS_RUN_DIR / name)
    stranded.join(timeout=10)
    assert not stranded.is_alive()  # it never serves another creation
    assert netns_module._NAMESPACE_THREAD.retired == retired + 1
    handle = create_run_netns(run_id, prefix=prefix)  # a fresh thread, at home
    fresh = namespace_thread()
    assert fresh is not stranded and fresh.native_id is not None
    assert namespace_of_thread(fresh.native_id) == daemon_namespace()
    assert mounted_at(handle.path)
    remove_run_netns(handle.name)


def test_removing_a_file_a_failed_creation_left_unmounted_still_removes_it(prefix: str) -> None:
    name = netns_name(secrets.token_hex(16), prefix=prefix)
    path = NETNS_RUN_DIR / name
    path.touch(mode=0)  # a mount point with nothing mounted on it (umount2: EINVAL)
    assert remove_run_netns(name) is True
    assert not os.path.lexists(path)
    assert remove_run_netns(name) is False


def test_a_namespace_made_ahead_goes_to_its_own_run_only_and_is_removed_untaken(
    prefix: str,
) -> None:
    run_id, other = secrets.token_hex(16), secrets.token_hex(16)
    name = netns_name(run_id, prefix=prefix)

    async def main() -> None:
        ahead = NamespaceAhead(run_id, prefix)
        async with trio.open_nursery() as nursery:
            nursery.start_soon(ahead.make)
        with pytest.raises(ValueError, match=f"run {other} was handed run {run_id}'s network"):
            await ahead.take(other)
        # Refused to another run, it is still its maker's to remove.
        assert name in ip_netns_list()
        await ahead.drop_untaken()
        assert name not in ip_netns_list()
        taken = NamespaceAhead(run_id, prefix)
        async with trio.open_nursery() as nursery:
            nursery.start_soon(taken.make)
        handle = await taken.take(run_id)
        with pytest.raises(RuntimeError, match="taken already"):
            await taken.take(run_id)
        await taken.drop_untaken()  # taken: the owner removes it, not drop_untaken
        assert handle.name in ip_netns_list()
        remove_run_netns(handle.name)

    trio.run(main)
