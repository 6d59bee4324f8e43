"""Opening paths beneath a grant's root so that no component can lead out of it.

Threat model: the agent controls the contents of every writable grant (directly
through the sandbox's mount, or through fs.write), so any component of a path may
be, or may at any moment become, a symlink to ``/etc``, a ``..`` chain, a magic
link such as ``/proc/self/root``, a hard link to a file outside, or a FIFO. The
daemon must never read or write anything outside ``grant.host_root`` because of
that, and checking a path first and opening it later (time of check, time of use)
is exactly the race an attacker wins. So every open is resolved by the kernel, in
one step, relative to a directory file descriptor of the root:

* :attr:`Resolver.OPENAT2` — ``openat2(2)`` with ``RESOLVE_BENEATH |
  RESOLVE_NO_MAGICLINKS`` (Linux 5.6+). The kernel refuses any resolution that
  would leave the root (absolute symlinks, ``..`` above it) with ``EXDEV`` and any
  magic link with ``ELOOP``. Symlinks that stay inside the root are followed, for
  reads only (see :class:`BeneathRoot` for why writes never follow one).
* :attr:`Resolver.WALK` — one ``openat`` per component with ``O_NOFOLLOW``, each
  relative to the previous component's descriptor. This cannot tell a symlink that
  stays inside from one that leaves, so it is stricter: **every** symlink component
  is refused. Writes always use it, on every host, and so do reads beneath a root
  that holds another grant's root (:attr:`PathGrant.holds_nested`): a symlink that
  stays inside could still lead into that grant and dodge its own rules.

Which resolver reads use is probed once per process: any error from a probe
``openat2`` of ``/`` (``ENOSYS`` on kernels before 5.6, ``EPERM`` from a seccomp
filter that refuses syscalls it does not know, anything odd) selects the walk.
After that, only ``ENOSYS`` from a real call switches to the walk: ``EPERM`` and
``EACCES`` from a real open are ordinary permission errors on that file, and
switching on them would hide the real answer.

The root itself is opened by its host path, which may lie inside another, writable
grant, where the agent can replace it. So it is opened with ``O_NOFOLLOW`` and its
(device, inode) must still be the :attr:`PathGrant.root_id` pinned when the run was
created; anything else is refused.

Whatever the resolver, the last component is opened with ``O_NOFOLLOW`` relative
to its safely opened parent when the caller does not want a final symlink
followed, and every opened file is checked on its descriptor (``fstat``), never by
path: only regular files with a single link are read or written (see
:func:`require_single_link_regular`).

The workspace's apps folder (:mod:`gatewayd.policy.appsfolder`) is refused by the
policy on the path as written; beneath a root that holds it, while it exists, reads
follow no symlink either (a link ``notes -> apps/x/data`` would otherwise lead there),
and every directory the walk opens is compared with the folder by (device, inode), so
no other name of it (a case-folding file system's ``APPS``, a bind mount) gets in.

Messages name the agent's visible path, never the host path.
"""

from __future__ import annotations

import contextlib
import ctypes
import enum
import errno
import os
import platform
import stat
from collections.abc import Iterator
from pathlib import PurePosixPath
from types import TracebackType
from typing import Final

from gatewayd.errors import GatewayError, InvalidArguments, PolicyViolation, ToolFailed
from gatewayd.files import LIBC
from gatewayd.policy.appsfolder import apps_folder_message
from gatewayd.policy.paths import ResolvedPath, shown

# openat2(2)'s number. It is 437 on every architecture that uses the unified
# syscall table (x86, arm, riscv, powerpc, s390); alpha, mips and ia64 number it
# differently, so there we do not guess and walk instead.
_OPENAT2_NR: Final = 437
_OPENAT2_MACHINES: Final = frozenset(
    {"x86_64", "i386", "i686", "aarch64", "armv7l", "armv8l", "riscv64", "ppc64le", "s390x"}
)

# From <linux/openat2.h>.
RESOLVE_NO_MAGICLINKS: Final = 0x02  # refuse /proc/<pid>/fd/* and /proc/self/root style links
RESOLVE_BENEATH: Final = 0x08  # refuse any resolution that leaves the starting directory

_O_CLOEXEC: Final = os.O_CLOEXEC  # no descriptor may leak into a process we start
_DIR_PATH_FLAGS: Final = os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC

# openat2 answers EAGAIN when a rename raced a '..' lookup and it cannot prove the
# result stayed beneath the root (and a raw syscall is not retried on EINTR for us):
# retry a few times, then give up with an error rather than loop on an attacker.
OPENAT2_RETRIES: Final = 8

# Mode for directories fs.write creates (the daemon's umask still applies).
NEW_DIR_MODE: Final = 0o755

OUTSIDE_MESSAGE: Final = "leads outside the readable paths (symlinks may not point outside)"

# Why a file with more than one name is neither read, written nor described by the
# tools: another of its names may lie outside the grants (see :func:`hard_linked`).
HARD_LINK_REASON: Final = (
    "a hard link can make a file from outside the readable paths appear inside them"
)


class Resolver(enum.Enum):
    """How paths are resolved beneath a root (see the module docstring)."""

    OPENAT2 = "openat2"
    WALK = "walk"


class _OpenHow(ctypes.Structure):
    """``struct open_how`` from <linux/openat2.h>."""

    _fields_ = (
        ("flags", ctypes.c_uint64),
        ("mode", ctypes.c_uint64),
        ("resolve", ctypes.c_uint64),
    )


_syscall: Final = LIBC.syscall  # its return type (a long) is set once in gatewayd.files

# Process-wide, set once: whether this kernel (and seccomp filter) lets us call
# openat2. ``None`` until the first probe.
_openat2_works: bool | None = None
# Tests force a resolver so both mechanisms run the whole escape corpus.
_forced: Resolver | None = None


def _raw_openat2(dir_fd: int, path: bytes, flags: int, mode: int, resolve: int) -> int:
    how = _OpenHow(flags, mode, resolve)
    fd = int(
        _syscall(
            ctypes.c_long(_OPENAT2_NR),
            ctypes.c_int(dir_fd),
            ctypes.c_char_p(path),
            ctypes.byref(how),
            ctypes.c_size_t(ctypes.sizeof(how)),
        )
    )
    if fd < 0:
        err = ctypes.get_errno()
        raise OSError(err, os.strerror(err))
    return fd


def _probe_openat2() -> bool:
    if platform.machine() not in _OPENAT2_MACHINES:
        return False
    root = os.open("/", _DIR_PATH_FLAGS)
    try:
        fd = _raw_openat2(root, b".", os.O_PATH | _O_CLOEXEC, 0, RESOLVE_BENEATH)
    except OSError:
        # ENOSYS: kernel before 5.6 (or a sandbox that lacks it); EPERM: a seccomp
        # filter that refuses syscalls it does not know. Anything else is odd, and
        # the stricter walk is the safe answer to odd.
        return False
    finally:
        os.close(root)
    os.close(fd)
    return True


def openat2_available() -> bool:
    """Whether this kernel (and any seccomp filter around us) allows openat2."""
    global _openat2_works  # noqa: PLW0603 - a process-wide capability cache, probed once
    if _openat2_works is None:
        _openat2_works = _probe_openat2()
    return _openat2_works


def active_resolver() -> Resolver:
    """The resolver this process uses: openat2 when the kernel allows it, else the walk."""
    if _forced is not None:
        return _forced
    return Resolver.OPENAT2 if openat2_available() else Resolver.WALK


@contextlib.contextmanager
def forced_resolver(resolver: Resolver) -> Iterator[None]:
    """Use ``resolver`` inside the block (tests run the escape corpus with both)."""
    global _forced  # noqa: PLW0603 - test hook; production never sets it
    previous = _forced
    _forced = resolver
    try:
        yield
    finally:
        _forced = previous


class _SymlinkRefused(Exception):
    """The walk met a symlink at ``parts[index]``."""

    def __init__(self, index: int) -> None:
        super().__init__(index)
        self.index = index


class _ComponentFailed(Exception):
    """The walk failed to open ``parts[index]`` as a directory."""

    def __init__(self, index: int, error: OSError) -> None:
        super().__init__(index)
        self.index = index
        self.error = error


def describe_mode(mode: int) -> str:
    """What kind of file ``mode`` is, in words for a message."""
    if stat.S_ISDIR(mode):
        return "directory"
    if stat.S_ISLNK(mode):
        return "symlink"
    if stat.S_ISFIFO(mode):
        return "FIFO (named pipe)"
    if stat.S_ISSOCK(mode):
        return "socket"
    if stat.S_ISCHR(mode) or stat.S_ISBLK(mode):
        return "device"
    return "special file"


def hard_linked(st: os.stat_result) -> bool:
    """Whether ``st`` (from ``lstat`` or ``fstat``) is a non-directory with more than one name.

    Nothing on the inode says which name came first, so any of them may have been made
    inside a grant for a file that lives outside it (``ln /etc/shadow workspace/x``):
    its contents, size, times and mode are that file's, and its link count is how many
    names it has elsewhere. Directories cannot be hard linked, so theirs are their own.
    """
    return not stat.S_ISDIR(st.st_mode) and st.st_nlink > 1


def hard_link_refusal(visible: str, remedy: str) -> PolicyViolation:
    """The refusal of a hard-linked file; it never says how many links it has (see above)."""
    return PolicyViolation(
        f"'{shown(visible)}' is one of several hard links to the same file; "
        f"{HARD_LINK_REASON}, so only files with a single link can be read or written "
        f"({remedy})"
    )


def require_single_link_regular(fd: int, visible: str) -> os.stat_result:
    """``fstat`` an opened file and refuse anything but a regular file with one link.

    The check is on the descriptor, so it describes exactly the file that will be
    read or written. A directory is the caller's mistake (:class:`ToolFailed`);
    FIFOs, devices and sockets are refused by policy (reading a FIFO blocks, a
    device is not a file); a second hard link may be a name for a file outside the
    readable paths that someone linked into the workspace, and nothing on the
    descriptor says which name is the original, so it is refused too.
    """
    st = os.fstat(fd)
    if stat.S_ISDIR(st.st_mode):
        raise ToolFailed(
            f"'{shown(visible)}' is a directory; fs.list shows its entries, "
            "fs.read/fs.write/fs.edit take a file"
        )
    if not stat.S_ISREG(st.st_mode):
        raise PolicyViolation(
            f"'{shown(visible)}' is a {describe_mode(st.st_mode)}, not a regular file; "
            "only regular files can be read or written"
        )
    if hard_linked(st):
        raise hard_link_refusal(visible, "copy the file to get one")
    return st


def check_parts(target: ResolvedPath) -> None:
    """Refuse components the policy should never have produced (defence in depth)."""
    for part in target.parts:
        if part in ("", ".", "..") or "/" in part or "\0" in part:
            raise PolicyViolation(
                f"'{shown(target.visible)}' contains a '..', '.', empty or NUL component; "
                "name paths inside the readable paths without them"
            )
        try:
            os.fsencode(part)
        except UnicodeEncodeError:
            raise InvalidArguments(
                f"'{shown(target.visible)}' is not a valid file name (unpaired surrogate); "
                "use UTF-8 names"
            ) from None


def translate_oserror(exc: OSError, visible: str) -> GatewayError:
    """The agent-facing error for an OSError on ``visible`` (never the host path)."""
    v = shown(visible)
    code = exc.errno
    if code == errno.ENOENT:
        return ToolFailed(f"'{v}' does not exist; fs.list shows what is there")
    if code == errno.ENOTDIR:
        return ToolFailed(f"a component of '{v}' is not a directory")
    if code == errno.EISDIR:
        return ToolFailed(f"'{v}' is a directory; this tool takes a file")
    if code in (errno.EXDEV, errno.ELOOP):
        return PolicyViolation(f"'{v}' {OUTSIDE_MESSAGE}")
    if code == errno.ENAMETOOLONG:
        return InvalidArguments(
            f"'{v}' is too long: each name may have at most 255 bytes and the whole "
            "path at most 4095"
        )
    if code == errno.ENXIO:
        return PolicyViolation(
            f"'{v}' is a socket or a FIFO with no reader, not a regular file; "
            "only regular files can be read or written"
        )
    if code in (errno.EACCES, errno.EPERM):
        return ToolFailed(f"'{v}': permission denied on the host")
    if code == errno.ENOSPC:
        # A workspace's own limit (an agent run's overlay delta) or the host's disk.
        return ToolFailed(
            f"'{v}': no space left: the workspace's size limit is reached or the disk is full"
        )
    if code == errno.EROFS:
        return ToolFailed(f"'{v}': the host file system is read-only")
    if code == errno.EEXIST:
        return ToolFailed(f"'{v}' already exists as something that is not a directory")
    name = errno.errorcode.get(code or 0, "unknown")
    return ToolFailed(f"'{v}': I/O error on the host ({name}: {os.strerror(code or 0)})")


class BeneathRoot:
    """An open descriptor of one grant's root, and safe opens of ``target`` beneath it.

    Resource handling: use as a context manager; the root descriptor is closed on
    exit. Every descriptor a method returns belongs to the caller, who closes it.

    Error handling: methods raise :class:`PolicyViolation`, :class:`InvalidArguments`
    or :class:`ToolFailed` with messages that name ``target.visible`` only.

    ``follow_symlinks`` (default: only for reads) lets openat2 follow symlinks that
    stay beneath the root. Writes never go through any symlink: the policy decided on
    the lexical path (a read-only grant nested in a writable one, a suffix rule), and
    a link ``/workspace/x -> ro-docs`` would otherwise write where it said no. Reads
    beneath a root that holds another grant's root follow none either, for the same
    reason (a link ``/workspace/x -> docs/key.pem`` would read past the rules of
    ``docs``). Nor do reads beneath a root that holds the workspace's apps folder while
    it exists (decided when the block is entered): ``apps_id`` is then the folder's
    (device, inode), and a directory with it is refused whatever name reached it.
    ``no_follow_reason``: what a symlink's refusal says when a caller that reads asked
    to follow none (``follow_symlinks=False``) for a rule of its own.
    """

    def __init__(
        self,
        target: ResolvedPath,
        *,
        follow_symlinks: bool | None = None,
        no_follow_reason: str | None = None,
    ) -> None:
        check_parts(target)
        self.target = target
        # Why no symlink is followed, as a refusal says it, when it is the caller's own
        # rule (install_app's: "an app is installed from the folder the policy checked").
        self.no_follow_reason = no_follow_reason
        wanted = target.access == "read" if follow_symlinks is None else follow_symlinks
        self.follows = wanted and not target.grant.holds_nested
        # Without following, the per-component no-follow walk is exactly the rule.
        self.resolver = active_resolver() if self.follows else Resolver.WALK
        self.apps_id: tuple[int, int] | None = None
        self._root_fd = -1

    def __enter__(self) -> BeneathRoot:
        self._root_fd = open_pinned_root(self.target)
        try:
            self.apps_id = self._apps_folder_id()
        except BaseException:
            os.close(self._root_fd)
            self._root_fd = -1
            raise
        if self.apps_id is not None:
            # A symlink could lead into the folder under any name: walk, following none,
            # so the path the policy judged is the path opened.
            self.follows = False
            self.resolver = Resolver.WALK
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        if self._root_fd >= 0:
            os.close(self._root_fd)
            self._root_fd = -1

    # --- the apps folder -----------------------------------------------------

    def _apps_folder_id(self) -> tuple[int, int] | None:
        """(device, inode) of the apps folder beneath this root, if it is a directory now."""
        parts = self.target.grant.apps_parts
        if not parts:
            return None
        try:
            st = os.stat("/".join(parts), dir_fd=self._root_fd, follow_symlinks=False)
        except OSError:
            return None  # absent (or unreachable): nothing of it to reach
        return (st.st_dev, st.st_ino) if stat.S_ISDIR(st.st_mode) else None

    def _refuse_apps_folder(self, fd: int) -> None:
        """Refuse (and close) ``fd`` if it is the apps folder, whatever name reached it."""
        if self.apps_id is None:
            return
        st = os.fstat(fd)
        if (st.st_dev, st.st_ino) != self.apps_id:
            return
        os.close(fd)
        grant = self.target.grant
        folder = grant.visible_root.joinpath(*(grant.apps_parts or ()))
        raise PolicyViolation(
            apps_folder_message(
                shown(self.target.visible), str(folder), write=self.target.access == "write"
            )
        )

    # --- visible names -------------------------------------------------------

    def visible_prefix(self, count: int) -> str:
        """The visible path of the first ``count`` components."""
        return str(PurePosixPath(self.target.grant.visible_root, *self.target.parts[:count]))

    # --- resolution ----------------------------------------------------------

    def _openat2(self, parts: tuple[str, ...], flags: int, mode: int = 0) -> int:
        path = os.fsencode("/".join(parts)) if parts else b"."
        for _ in range(OPENAT2_RETRIES):
            try:
                return _raw_openat2(
                    self._root_fd,
                    path,
                    flags | _O_CLOEXEC,
                    mode,
                    RESOLVE_BENEATH | RESOLVE_NO_MAGICLINKS,
                )
            except OSError as exc:
                if exc.errno not in (errno.EAGAIN, errno.EINTR):
                    raise
        raise OSError(errno.EAGAIN, os.strerror(errno.EAGAIN))

    def _walk_dir(self, parts: tuple[str, ...]) -> int:
        """O_PATH descriptor of ``parts``, one no-follow component at a time."""
        fd = os.open(".", _DIR_PATH_FLAGS, dir_fd=self._root_fd)
        for index, part in enumerate(parts):
            try:
                child = os.open(part, _DIR_PATH_FLAGS | os.O_NOFOLLOW, dir_fd=fd)
            except OSError as exc:
                is_link = _is_symlink_at(fd, part)
                os.close(fd)
                if is_link:
                    raise _SymlinkRefused(index) from None
                raise _ComponentFailed(index, exc) from None
            os.close(fd)
            self._refuse_apps_folder(child)
            fd = child
        return fd

    def _dir_fd(self, parts: tuple[str, ...]) -> int:
        """O_PATH descriptor of the directory ``parts``; raises the agent-facing error."""
        try:
            if self.resolver is Resolver.OPENAT2:
                try:
                    return self._openat2(parts, _DIR_PATH_FLAGS)
                except OSError as exc:
                    if exc.errno != errno.ENOSYS:
                        raise
                    self._switch_to_walk()
            return self._walk_dir(parts)
        except _SymlinkRefused as refused:
            raise self._walk_symlink_error(refused.index) from None
        except _ComponentFailed as failed:
            raise translate_oserror(failed.error, self.visible_prefix(failed.index + 1)) from None
        except OSError as exc:
            raise translate_oserror(exc, self.visible_prefix(len(parts))) from None

    def _switch_to_walk(self) -> None:
        # The kernel lost openat2 under us (a seccomp filter added later): walk from now on.
        global _openat2_works  # noqa: PLW0603 - the capability cache, see active_resolver
        _openat2_works = False
        self.resolver = Resolver.WALK

    def _walk_symlink_error(self, index: int) -> PolicyViolation:
        link = shown(self.visible_prefix(index + 1))
        grant = self.target.grant
        if self.follows:
            reason = (
                "this host cannot resolve symlinks safely (no openat2), so no symlink is followed"
            )
        elif self.target.access == "read" and grant.holds_nested:
            reason = (
                f"'{grant.visible_root}' holds the directory of another path grant with its "
                "own rules, which a symlink could dodge, so no symlink is followed there"
            )
        elif self.target.access == "read" and self.apps_id is not None:
            reason = (
                f"'{grant.visible_root}' holds the apps folder, which no run may read and "
                "a symlink could lead into, so no symlink is followed there"
            )
        elif self.no_follow_reason is not None:
            reason = self.no_follow_reason
        else:
            reason = (
                "writes never go through a symlink, so the path the policy approved is the "
                "path written"
            )
        if index == len(self.target.parts) - 1:
            return PolicyViolation(f"'{link}' is a symlink; {reason}: use the real path")
        return PolicyViolation(
            f"'{shown(self.target.visible)}' goes through the symlink '{link}'; {reason}: "
            "use the real path"
        )

    def _final_symlink_error(self, follow_final: bool) -> PolicyViolation:
        if follow_final or not self.follows:
            # Following was wanted but openat2 is missing, or this is a write.
            return self._walk_symlink_error(len(self.target.parts) - 1)
        return PolicyViolation(
            f"'{shown(self.target.visible)}' is a symlink, and this operation does not "
            "follow a symlink at the end of a path: use the path of the file it points to"
        )

    # --- public opens --------------------------------------------------------

    def open_dir(self, *, create: bool = False) -> int:
        """O_PATH descriptor of the directory ``target`` (the root for ``()``).

        ``create`` makes missing directories, each with ``mkdirat`` in its safely
        opened parent; a component that exists as anything but a directory fails.
        """
        return self._open_dir_parts(self.target.parts, create=create)

    def _open_dir_parts(self, parts: tuple[str, ...], *, create: bool) -> int:
        try:
            return self._dir_fd(parts)
        except ToolFailed:
            if not create:
                raise
        # Slow path: find and make the missing components, parent by parent.
        fd = self._dir_fd(())
        try:
            for index in range(len(parts)):
                prefix = parts[: index + 1]
                try:
                    os.mkdir(parts[index], NEW_DIR_MODE, dir_fd=fd)
                    # Owned like its parent (a lent workspace's: the run's uid), not
                    # gatewayd's; a name swapped in meanwhile is not followed.
                    parent = os.fstat(fd)
                    if (parent.st_uid, parent.st_gid) != (os.geteuid(), os.getegid()):
                        os.chown(
                            parts[index],
                            parent.st_uid,
                            parent.st_gid,
                            dir_fd=fd,
                            follow_symlinks=False,
                        )
                except FileExistsError:
                    pass  # already there (or raced into being): open it below
                except OSError as exc:
                    raise translate_oserror(exc, self.visible_prefix(index + 1)) from None
                child = self._dir_fd(prefix)
                os.close(fd)
                fd = child
        except BaseException:
            os.close(fd)
            raise
        return fd

    def open_parent(self, *, create: bool = False) -> tuple[int, str]:
        """O_PATH descriptor of the target's parent directory, and the target's last name."""
        if not self.target.parts:
            raise ToolFailed(
                f"'{shown(self.target.visible)}' is the root of a grant, a directory; "
                "name a file inside it"
            )
        fd = self._open_dir_parts(self.target.parts[:-1], create=create)
        return fd, self.target.parts[-1]

    def open_file(self, flags: int, *, follow_final: bool) -> int:
        """Open the target with ``flags`` (``O_CLOEXEC`` is added).

        ``follow_final``: a symlink at the last component is followed when it stays
        beneath the root (openat2 only; the walk never follows one). Otherwise a
        final symlink is refused with a message saying so.
        """
        parts = self.target.parts
        if follow_final and self.resolver is Resolver.OPENAT2:
            try:
                return self._openat2(parts, flags)
            except OSError as exc:
                if exc.errno != errno.ENOSYS:
                    raise translate_oserror(exc, self.target.visible) from None
                self._switch_to_walk()
        if not parts:
            root = self._dir_fd(())
            try:
                return os.open(".", flags | _O_CLOEXEC, dir_fd=root)
            except OSError as exc:
                raise translate_oserror(exc, self.target.visible) from None
            finally:
                os.close(root)
        parent, name = self.open_parent()
        try:
            return self.open_name(parent, name, flags, follow_final=follow_final)
        finally:
            os.close(parent)

    def open_name(
        self, parent_fd: int, name: str, flags: int, mode: int = 0, *, follow_final: bool = False
    ) -> int:
        """Open the target's last component ``name`` in its parent, never following a symlink.

        ``parent_fd`` comes from :meth:`open_parent`; ``O_NOFOLLOW | O_CLOEXEC`` are
        added, so a symlink there is refused (with ``O_CREAT``, never created through).
        ``follow_final`` only says whether the caller wanted it followed (the message).
        """
        try:
            fd = os.open(name, flags | os.O_NOFOLLOW | _O_CLOEXEC, mode, dir_fd=parent_fd)
        except OSError as exc:
            if exc.errno in (errno.ELOOP, errno.ENOTDIR) and _is_symlink_at(parent_fd, name):
                raise self._final_symlink_error(follow_final) from None
            raise translate_oserror(exc, self.target.visible) from None
        # O_PATH | O_NOFOLLOW opens a symlink itself instead of failing: refuse it the same.
        if flags & os.O_PATH and stat.S_ISLNK(os.fstat(fd).st_mode):
            os.close(fd)
            raise self._final_symlink_error(follow_final)
        self._refuse_apps_folder(fd)
        return fd


def open_pinned_root(target: ResolvedPath) -> int:
    """O_PATH descriptor of ``target.grant``'s root, refused unless it is still the
    directory pinned in ``root_id`` when the run was created.

    The last component is not followed (``O_NOFOLLOW``): a root swapped for a symlink
    fails to open as a directory. A root swapped for another directory (or reached
    through a swapped parent) opens, and its (device, inode) tells.
    """
    grant = target.grant
    replaced = PolicyViolation(
        f"the directory behind '{grant.visible_root}' was replaced after the run started "
        f"(by a symlink or another directory), so it is refused; '{shown(target.visible)}' "
        "can be reached again once the original directory is back, or in a new run"
    )
    try:
        fd = os.open(grant.host_root, _DIR_PATH_FLAGS | os.O_NOFOLLOW)
    except OSError as exc:
        if exc.errno in (errno.ENOTDIR, errno.ELOOP):
            raise replaced from None  # a symlink or a file where the directory was
        name = errno.errorcode.get(exc.errno or 0, "unknown")
        raise ToolFailed(
            f"the directory behind '{grant.visible_root}' is unavailable on the host ({name})"
        ) from None
    st = os.fstat(fd)
    if not stat.S_ISDIR(st.st_mode) or (st.st_dev, st.st_ino) != grant.root_id:
        os.close(fd)
        raise replaced
    return fd


def _is_symlink_at(dir_fd: int, name: str) -> bool:
    try:
        st = os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
    except OSError:
        return False
    return stat.S_ISLNK(st.st_mode)


def open_child_dir(dir_fd: int, name: str) -> int | None:
    """Open the directory entry ``name`` of ``dir_fd`` for listing, never following a symlink.

    ``name`` is one component from ``getdents`` (no ``/``, never ``..``), so this is
    safe without openat2. ``None`` when it is no longer a directory (raced away).
    """
    try:
        return os.open(
            name, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | _O_CLOEXEC, dir_fd=dir_fd
        )
    except OSError:
        return None
