"""The safe opener: nothing beneath a grant's root may lead out of it, under either resolver.

Every escape in the corpus runs against both mechanisms (openat2 and the
component walk), on real directories, symlinks, hard links and FIFOs in tmp_path.
"""

from __future__ import annotations

import errno
import json
import os
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path, PurePosixPath

import pytest

from gatewayd.errors import GatewayError, InvalidArguments, PolicyViolation, ToolFailed
from gatewayd.hostpaths.beneath import (
    BeneathRoot,
    Resolver,
    active_resolver,
    forced_resolver,
    openat2_available,
    require_single_link_regular,
    translate_oserror,
)
from gatewayd.policy.paths import Access, PathGrant, PathMode, ResolvedPath

SECRET = "OUTSIDE-SECRET"
VISIBLE_ROOT = PurePosixPath("/workspace")


@pytest.fixture
def root(tmp_path: Path) -> Path:
    path = tmp_path / "root"
    path.mkdir()
    (path / "file.txt").write_text("inside\n")
    (path / "sub").mkdir()
    (path / "sub" / "inner.txt").write_text("inner\n")
    return path


@pytest.fixture
def outside(tmp_path: Path) -> Path:
    path = tmp_path / "outside"
    path.mkdir()
    (path / "secret.txt").write_text(SECRET)
    return path


def pinned(host_root: Path) -> tuple[int, int]:
    """The root identity bind_paths records when a run is created."""
    st = os.stat(host_root)
    return (st.st_dev, st.st_ino)


def grant_for(host_root: Path, *, suffixes: tuple[str, ...] = ()) -> PathGrant:
    return PathGrant(
        name="workspace",
        host_root=host_root,
        root_id=pinned(host_root),
        holds_nested=False,
        visible_root=VISIBLE_ROOT,
        mode=PathMode.RW,
        suffixes=suffixes,
    )


def target(host_root: Path, *parts: str, access: Access = "read") -> ResolvedPath:
    return ResolvedPath(
        grant=grant_for(host_root),
        parts=parts,
        visible=str(VISIBLE_ROOT.joinpath(*parts)),
        access=access,
    )


def read_through(resolved: ResolvedPath, *, follow_final: bool = True) -> str:
    """Open like fs.read does and return the content."""
    with BeneathRoot(resolved) as beneath:
        fd = beneath.open_file(os.O_RDONLY | os.O_NONBLOCK, follow_final=follow_final)
    try:
        require_single_link_regular(fd, resolved.visible)
        return os.read(fd, 1 << 16).decode()
    finally:
        os.close(fd)


def assert_message_is_safe(exc: GatewayError, tmp_path: Path) -> None:
    message = str(exc)
    assert str(tmp_path) not in message, "a host path leaked into a message"
    assert SECRET not in message


# --- the escape corpus ---------------------------------------------------------


def _dotdot(root: Path, outside: Path) -> tuple[str, ...]:
    return ("..", "outside", "secret.txt")


def _absolute_symlink_to_etc(root: Path, outside: Path) -> tuple[str, ...]:
    (root / "etc").symlink_to("/etc")
    return ("etc", "passwd")


def _relative_symlink_up(root: Path, outside: Path) -> tuple[str, ...]:
    (root / "sub" / "up").symlink_to("../../outside")
    return ("sub", "up", "secret.txt")


def _symlink_chain(root: Path, outside: Path) -> tuple[str, ...]:
    (root / "c").symlink_to("../outside/secret.txt")
    (root / "b").symlink_to("c")
    (root / "a").symlink_to("b")
    return ("a",)


def _symlink_to_outside_dir_then_file(root: Path, outside: Path) -> tuple[str, ...]:
    (root / "d").symlink_to(outside)
    return ("d", "secret.txt")


def _symlink_in_middle_component(root: Path, outside: Path) -> tuple[str, ...]:
    (outside / "deeper").mkdir()
    (outside / "deeper" / "secret.txt").write_text(SECRET)
    (root / "sub" / "mid").symlink_to(outside)
    return ("sub", "mid", "deeper", "secret.txt")


def _final_symlink_to_outside_file(root: Path, outside: Path) -> tuple[str, ...]:
    (root / "sub" / "link.txt").symlink_to(outside / "secret.txt")
    return ("sub", "link.txt")


def _dangling_symlink_leading_up(root: Path, outside: Path) -> tuple[str, ...]:
    (root / "dangle").symlink_to("../outside/does-not-exist")
    return ("dangle",)


def _proc_self_root_symlink(root: Path, outside: Path) -> tuple[str, ...]:
    (root / "proc").symlink_to("/proc/self/root")
    return ("proc", "etc", "passwd")


ESCAPES = [
    _dotdot,
    _absolute_symlink_to_etc,
    _relative_symlink_up,
    _symlink_chain,
    _symlink_to_outside_dir_then_file,
    _symlink_in_middle_component,
    _final_symlink_to_outside_file,
    _dangling_symlink_leading_up,
    _proc_self_root_symlink,
]


@pytest.mark.parametrize("build", ESCAPES, ids=lambda f: f.__name__.strip("_"))
def test_escape_is_refused_as_policy_violation_naming_the_visible_path(
    resolver: Resolver, root: Path, outside: Path, tmp_path: Path, build: object
) -> None:
    assert callable(build)
    parts = build(root, outside)
    resolved = target(root, *parts)
    with pytest.raises(PolicyViolation) as caught:
        read_through(resolved)
    message = str(caught.value)
    assert resolved.visible[:40] in message
    assert "symlink" in message or "'..'" in message
    assert_message_is_safe(caught.value, tmp_path)


@pytest.mark.parametrize("access", ["read", "write"])
@pytest.mark.parametrize("build", ESCAPES[1:], ids=lambda f: f.__name__.strip("_"))
def test_escape_through_parent_cannot_create_a_file_outside(
    resolver: Resolver, root: Path, outside: Path, build: object, access: Access
) -> None:
    assert callable(build)
    parts = build(root, outside)
    before = sorted(p.name for p in outside.rglob("*"))
    resolved = target(root, *parts, "planted.txt", access=access)
    with pytest.raises(PolicyViolation), BeneathRoot(resolved) as beneath:
        beneath.open_parent(create=True)
    assert sorted(p.name for p in outside.rglob("*")) == before


def test_openat2_names_the_outside_rule_in_its_message(root: Path, outside: Path) -> None:
    if not openat2_available():
        pytest.skip("this kernel does not allow openat2")
    (root / "d").symlink_to(outside)
    with forced_resolver(Resolver.OPENAT2), pytest.raises(PolicyViolation) as caught:
        read_through(target(root, "d", "secret.txt"))
    assert str(caught.value) == (
        "'/workspace/d/secret.txt' leads outside the readable paths "
        "(symlinks may not point outside)"
    )


def test_walk_refuses_every_symlink_and_says_why(root: Path) -> None:
    (root / "alias").symlink_to("sub")
    with forced_resolver(Resolver.WALK), pytest.raises(PolicyViolation) as caught:
        read_through(target(root, "alias", "inner.txt"))
    message = str(caught.value)
    assert "'/workspace/alias'" in message
    assert "no symlink is followed" in message
    assert "use the real path" in message


def test_magic_links_under_proc_are_refused(resolver: Resolver, outside: Path) -> None:
    # A grant rooted in /proc/self: "root", "cwd" and "fd/N" are magic links that
    # jump anywhere; neither resolver may follow them.
    proc_self = Path("/proc/self")
    fd = os.open(outside / "secret.txt", os.O_RDONLY)
    try:
        for parts in (("root", "etc", "passwd"), ("cwd",), ("fd", str(fd))):
            with pytest.raises(PolicyViolation):
                read_through(target(proc_self, *parts))
    finally:
        os.close(fd)


def test_hard_link_to_an_outside_file_is_refused_with_the_reason(
    resolver: Resolver, root: Path, outside: Path, tmp_path: Path
) -> None:
    os.link(outside / "secret.txt", root / "hl.txt")
    with pytest.raises(PolicyViolation) as caught:
        read_through(target(root, "hl.txt"))
    message = str(caught.value)
    assert "'/workspace/hl.txt' is one of several hard links" in message
    assert "only files with a single link" in message
    assert_message_is_safe(caught.value, tmp_path)


def test_fifo_is_refused_without_blocking(resolver: Resolver, root: Path) -> None:
    os.mkfifo(root / "pipe")
    with pytest.raises(PolicyViolation) as caught:
        read_through(target(root, "pipe"))
    assert "FIFO" in str(caught.value)
    assert "only regular files" in str(caught.value)


def test_unix_socket_is_refused(
    resolver: Resolver, root: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(root)  # a short relative name: AF_UNIX paths are limited to 108 bytes
    with socket.socket(socket.AF_UNIX) as server:
        server.bind("sock")
        with pytest.raises(PolicyViolation) as caught:
            read_through(target(root, "sock"))
    assert "not a regular file" in str(caught.value)


def test_directory_is_a_tool_failure_pointing_at_fs_list(resolver: Resolver, root: Path) -> None:
    with pytest.raises(ToolFailed) as caught:
        read_through(target(root, "sub"))
    assert "'/workspace/sub' is a directory" in str(caught.value)
    assert "fs.list" in str(caught.value)


def test_dangling_symlink_inside_is_missing_with_openat2(root: Path) -> None:
    if not openat2_available():
        pytest.skip("this kernel does not allow openat2")
    (root / "dangle").symlink_to("nowhere.txt")
    with forced_resolver(Resolver.OPENAT2), pytest.raises(ToolFailed) as caught:
        read_through(target(root, "dangle"))
    assert "'/workspace/dangle' does not exist" in str(caught.value)


def test_symlinks_inside_the_root_are_followed_by_openat2_only(root: Path) -> None:
    (root / "alias").symlink_to("sub")
    (root / "link.txt").symlink_to("sub/../file.txt")
    if openat2_available():
        with forced_resolver(Resolver.OPENAT2):
            assert read_through(target(root, "alias", "inner.txt")) == "inner\n"
            assert read_through(target(root, "link.txt")) == "inside\n"
    with forced_resolver(Resolver.WALK):
        for parts in (("alias", "inner.txt"), ("link.txt",)):
            with pytest.raises(PolicyViolation):
                read_through(target(root, *parts))


def test_writes_never_go_through_a_symlink_even_one_that_stays_inside(
    resolver: Resolver, root: Path
) -> None:
    # The policy approved the lexical path: '/workspace/alias/new.txt' may be writable
    # while what 'alias' points at is a read-only grant nested in this one.
    (root / "alias").symlink_to("sub")
    with (
        BeneathRoot(target(root, "alias", "new.txt", access="write")) as beneath,
        pytest.raises(PolicyViolation) as caught,
    ):
        beneath.open_parent(create=True)
    assert str(caught.value) == (
        "'/workspace/alias/new.txt' goes through the symlink '/workspace/alias'; writes "
        "never go through a symlink, so the path the policy approved is the path written: "
        "use the real path"
    )
    assert sorted(p.name for p in (root / "sub").iterdir()) == ["inner.txt"]


def test_final_symlink_is_refused_when_the_caller_does_not_follow(
    resolver: Resolver, root: Path
) -> None:
    (root / "link.txt").symlink_to("file.txt")
    with pytest.raises(PolicyViolation) as caught:
        read_through(target(root, "link.txt"), follow_final=False)
    assert "'/workspace/link.txt'" in str(caught.value)
    assert "symlink" in str(caught.value)


def test_o_path_open_of_a_final_symlink_is_refused_not_returned(root: Path) -> None:
    (root / "link").symlink_to("sub")
    with (
        forced_resolver(Resolver.WALK),
        BeneathRoot(target(root, "link")) as beneath,
        pytest.raises(PolicyViolation),
    ):
        beneath.open_file(os.O_PATH, follow_final=False)


def test_plain_paths_open_under_both_resolvers(resolver: Resolver, root: Path) -> None:
    assert read_through(target(root, "file.txt")) == "inside\n"
    assert read_through(target(root, "sub", "inner.txt")) == "inner\n"


def test_missing_file_and_missing_parent_are_tool_failures(resolver: Resolver, root: Path) -> None:
    for parts in (("nope.txt",), ("nodir", "nope.txt")):
        with pytest.raises(ToolFailed) as caught:
            read_through(target(root, *parts))
        assert "does not exist" in str(caught.value)


def test_file_used_as_directory_is_a_tool_failure(resolver: Resolver, root: Path) -> None:
    with pytest.raises(ToolFailed) as caught:
        read_through(target(root, "file.txt", "x"))
    assert "not a directory" in str(caught.value)


def test_overlong_name_is_a_clean_invalid_arguments(resolver: Resolver, root: Path) -> None:
    for parts in (("a" * 300,), ("sub", "b" * 300)):
        with pytest.raises(InvalidArguments) as caught:
            read_through(target(root, *parts))
        assert "at most 255 bytes" in str(caught.value)
        assert len(str(caught.value)) < 400  # the path is shortened in the message


def test_overlong_path_is_a_clean_error_with_a_short_message(
    resolver: Resolver, root: Path
) -> None:
    parts = ("c" * 250,) * 20  # 5000 bytes: past PATH_MAX
    # openat2 sees the whole path (too long); the walk stops at the first missing name.
    with pytest.raises((InvalidArguments, ToolFailed)) as caught:
        read_through(target(root, *parts))
    assert len(str(caught.value)) < 400


def test_unencodable_component_is_invalid_arguments(root: Path) -> None:
    with pytest.raises(InvalidArguments) as caught:
        BeneathRoot(target(root, "bad\ud800name"))
    assert "UTF-8" in str(caught.value)


@pytest.mark.parametrize("bad", ["", ".", "..", "a/b", "nul\0"])
def test_components_the_policy_never_produces_are_refused(root: Path, bad: str) -> None:
    with pytest.raises(PolicyViolation) as caught:
        BeneathRoot(target(root, "sub", bad))
    assert "without them" in str(caught.value)


def test_missing_host_root_is_reported_by_its_visible_name(tmp_path: Path) -> None:
    (tmp_path / "gone").mkdir()
    resolved = target(tmp_path / "gone", "x")
    (tmp_path / "gone").rmdir()  # removed after the run started
    with pytest.raises(ToolFailed) as caught, BeneathRoot(resolved):
        pass
    assert str(caught.value) == (
        "the directory behind '/workspace' is unavailable on the host (ENOENT)"
    )


def test_open_parent_creates_missing_directories_inside(resolver: Resolver, root: Path) -> None:
    with BeneathRoot(target(root, "new", "deeper", "f.txt")) as beneath:
        fd, name = beneath.open_parent(create=True)
        os.close(fd)
    assert name == "f.txt"
    assert (root / "new" / "deeper").is_dir()


def test_open_parent_of_the_grant_root_is_refused(root: Path) -> None:
    with BeneathRoot(target(root)) as beneath, pytest.raises(ToolFailed) as caught:
        beneath.open_parent()
    assert "root of a grant" in str(caught.value)


def test_creating_through_a_file_component_fails_cleanly(resolver: Resolver, root: Path) -> None:
    with (
        BeneathRoot(target(root, "file.txt", "x", "y")) as beneath,
        pytest.raises(ToolFailed) as caught,
    ):
        beneath.open_parent(create=True)
    assert "not a directory" in str(caught.value)


def test_forced_resolver_restores_the_previous_one() -> None:
    before = active_resolver()
    with forced_resolver(Resolver.WALK):
        assert active_resolver() is Resolver.WALK
    assert active_resolver() is before


@pytest.mark.parametrize(
    ("code", "kind", "phrase"),
    [
        (errno.ENOENT, ToolFailed, "does not exist"),
        (errno.EXDEV, PolicyViolation, "leads outside the readable paths"),
        (errno.ELOOP, PolicyViolation, "symlinks may not point outside"),
        (errno.EACCES, ToolFailed, "permission denied"),
        (errno.ENOSPC, ToolFailed, "no space left"),
        (errno.EROFS, ToolFailed, "read-only"),
        (errno.EIO, ToolFailed, "I/O error on the host (EIO"),
    ],
)
def test_os_errors_translate_to_one_code_with_the_visible_path(
    code: int, kind: type[GatewayError], phrase: str
) -> None:
    error = translate_oserror(OSError(code, os.strerror(code), "/host/secret/path"), "/workspace/x")
    assert type(error) is kind
    assert phrase in str(error)
    assert "'/workspace/x'" in str(error)
    assert "/host/secret" not in str(error)


# --- the race ----------------------------------------------------------------------

RACE_ITERATIONS = 3000
# The reads go on past RACE_ITERATIONS until both a clean read and the attacker's
# swap were seen (thread scheduling decides when), for at most this long.
RACE_DEADLINE_S = 10.0


def test_swapping_a_directory_for_an_outside_symlink_never_leaks(
    resolver: Resolver, root: Path, outside: Path
) -> None:
    race = root / "race"
    saved = root / "race-saved"
    race.mkdir()
    (race / "secret.txt").write_text("inside")
    stop = threading.Event()

    def attacker() -> None:
        while not stop.is_set():
            os.rename(race, saved)
            os.symlink(outside, race)
            os.unlink(race)
            os.rename(saved, race)

    outcomes = {"inside": 0, "refused": 0, "missing": 0}
    thread = threading.Thread(target=attacker)
    thread.start()
    try:
        deadline = time.monotonic() + RACE_DEADLINE_S
        iterations = 0
        while iterations < RACE_ITERATIONS or (
            not (outcomes["inside"] and outcomes["refused"] + outcomes["missing"])
            and time.monotonic() < deadline
        ):
            iterations += 1
            try:
                content = read_through(target(root, "race", "secret.txt"))
            except PolicyViolation:
                outcomes["refused"] += 1
            except ToolFailed:
                outcomes["missing"] += 1
            else:
                assert content == "inside", "a read returned content from outside the root"
                outcomes["inside"] += 1
    finally:
        stop.set()
        thread.join()
    assert outcomes["inside"] > 0
    # The race really ran: some reads met the swapped-in symlink or the gap.
    assert outcomes["refused"] + outcomes["missing"] > 0


def test_swapping_a_parent_during_creates_never_writes_outside(
    resolver: Resolver, root: Path, outside: Path
) -> None:
    race = root / "race"
    saved = root / "race-saved"
    race.mkdir()
    stop = threading.Event()

    def attacker() -> None:
        while not stop.is_set():
            os.rename(race, saved)
            os.symlink(outside, race)
            os.unlink(race)
            os.rename(saved, race)

    thread = threading.Thread(target=attacker)
    thread.start()
    try:
        for index in range(RACE_ITERATIONS // 3):
            try:
                with BeneathRoot(target(root, "race", f"f{index}")) as beneath:
                    parent, name = beneath.open_parent()
                    try:
                        fd = beneath.open_name(parent, name, os.O_WRONLY | os.O_CREAT, 0o644)
                        os.close(fd)
                    finally:
                        os.close(parent)
            except (PolicyViolation, ToolFailed):
                pass
    finally:
        stop.set()
        thread.join()
    assert sorted(p.name for p in outside.iterdir()) == ["secret.txt"]


# --- falling back when openat2 is missing or refused -------------------------------

# Runs in a child process, which first installs a real seccomp filter that answers
# openat2 with the given errno (what an old kernel or a strict container does).
_SECCOMP_CHILD = r"""
import ctypes, json, os, struct, sys
from pathlib import Path, PurePosixPath

err, root = int(sys.argv[1]), Path(sys.argv[2])
libc = ctypes.CDLL(None, use_errno=True)
RET_ERRNO, RET_ALLOW = 0x00050000, 0x7FFF0000
program = b"".join(
    struct.pack("HBBI", *insn)
    for insn in (
        (0x20, 0, 0, 0),  # load the syscall number
        (0x15, 0, 1, 437),  # openat2?
        (0x06, 0, 0, RET_ERRNO | err),
        (0x06, 0, 0, RET_ALLOW),
    )
)
filters = ctypes.create_string_buffer(program)

class Prog(ctypes.Structure):
    _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.c_void_p)]

prog = Prog(len(program) // 8, ctypes.addressof(filters))
assert libc.prctl(38, 1, 0, 0, 0) == 0  # PR_SET_NO_NEW_PRIVS
assert libc.prctl(22, 2, ctypes.byref(prog), 0, 0) == 0  # PR_SET_SECCOMP, FILTER

from gatewayd.errors import PolicyViolation
from gatewayd.policy.paths import PathGrant, PathMode, ResolvedPath
from gatewayd.hostpaths.beneath import BeneathRoot, active_resolver, openat2_available

st = os.stat(root)
grant = PathGrant(name="w", host_root=root, root_id=(st.st_dev, st.st_ino),
                  holds_nested=False, visible_root=PurePosixPath("/workspace"),
                  mode=PathMode.RW)

def read(*parts):
    t = ResolvedPath(grant=grant, parts=parts, visible="/workspace/" + "/".join(parts),
                     access="read")
    try:
        with BeneathRoot(t) as b:
            fd = b.open_file(os.O_RDONLY, follow_final=True)
    except PolicyViolation as exc:
        return "refused: " + str(exc)
    try:
        return os.read(fd, 100).decode()
    finally:
        os.close(fd)

print(json.dumps({
    "available": openat2_available(),
    "resolver": active_resolver().value,
    "plain": read("file.txt"),
    "inside_link": read("link.txt"),
}))
"""


@pytest.mark.parametrize("refusal", [errno.ENOSYS, errno.EPERM], ids=["ENOSYS", "EPERM"])
def test_a_host_that_refuses_openat2_falls_back_to_the_stricter_walk(
    root: Path, refusal: int
) -> None:
    if not openat2_available():
        pytest.skip("this kernel already lacks openat2 (every test here runs the walk)")
    (root / "link.txt").symlink_to("file.txt")
    child = subprocess.run(
        [sys.executable, "-c", _SECCOMP_CHILD, str(refusal), str(root)],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert child.returncode == 0, child.stderr
    seen = json.loads(child.stdout)
    assert seen["available"] is False
    assert seen["resolver"] == "walk"
    assert seen["plain"] == "inside\n"
    assert seen["inside_link"].startswith("refused: ")
    assert "no openat2" in seen["inside_link"]


def test_messages_escape_control_characters_and_cut_long_paths_like_the_policy() -> None:
    hostile = "/workspace/a\x1b[31m\n" + "x" * 500
    message = str(translate_oserror(OSError(errno.ENOENT, "gone"), hostile))
    assert "\x1b" not in message
    assert "\n" not in message
    assert message.startswith("'/workspace/a\\x1b[31m\\nxxx")
    assert "…' does not exist; fs.list shows what is there" in message
    assert len(message) < 300


@pytest.mark.parametrize("how", ["symlink", "directory", "file"])
def test_a_root_swapped_after_pinning_is_refused_by_both_resolvers(
    resolver: Resolver, tmp_path: Path, outside: Path, how: str
) -> None:
    host_root = tmp_path / "nested"
    host_root.mkdir()
    resolved = target(host_root, "secret.txt")  # pins the original directory
    host_root.rename(tmp_path / "moved")
    if how == "symlink":
        host_root.symlink_to(outside)
    elif how == "directory":
        host_root.mkdir()
        (host_root / "secret.txt").write_text(SECRET)
    else:
        host_root.write_text(SECRET)
    with pytest.raises(PolicyViolation) as caught:
        read_through(resolved)
    assert str(caught.value) == (
        "the directory behind '/workspace' was replaced after the run started (by a symlink "
        "or another directory), so it is refused; '/workspace/secret.txt' can be reached "
        "again once the original directory is back, or in a new run"
    )
    assert_message_is_safe(caught.value, tmp_path)
