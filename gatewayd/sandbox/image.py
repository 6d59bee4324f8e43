"""Checking a sandbox image: a root filesystem gatewayd can bind read-only at the sandbox's ``/``.

With ``--image DIR`` the plan (``plan.build_plan(image_dir=...)``) binds DIR at ``/`` instead
of the host's system directories, then mounts its own things into it. :func:`check_image`
says, before any run, everything that would make DIR unusable or unsafe there, each with
the command that fixes it; ``gatewayd image check DIR`` prints that report and the daemon
refuses an image with problems (:func:`require_image`).

What is checked, and why:

* DIR is an absolute path to a directory, reached through no symlink (the plan checks the
  path *string* against the host trees a sandbox never sees, so the string must be what is
  bound), and is not at or above one of those trees.
* Every mount point gatewayd mounts over exists with the right type (directory or file),
  as a real entry, not a symlink: the image is bound read-only, so bwrap cannot create one.
* ``/usr/bin/python3`` exists and is executable. Symlinks are resolved *inside the image*
  (an absolute link restarts at DIR, as the sandbox would see it), never on the host.
* bwrap and the sandbox run as an unprivileged per-run host uid, which owns none of the
  image: in its user namespace the image's root-owned files belong to an unmapped uid, so
  capabilities do not apply and only the "other" permission bits count. Every directory
  on the way to a mount point or to python3, and DIR's parents, must be ``o+x``.
* Nothing can change the image under later runs: DIR, its parents and the entries near
  the top of the image are owned by root and not writable by group or others (the image's
  uids and gids are host ids on the host). A parent with the sticky bit (``/tmp``) may be
  world-writable: there only an entry's owner can rename it.

The walk is bounded: the image root, the entries of its top-level directories and of the
sandbox's PATH directories, at most :data:`MAX_ENTRIES_CHECKED` entries; never all of /usr.
Whether the image holds secrets is the image builder's business (see sandbox_image/README.md).

The only I/O here is ``lstat``, ``readlink`` and ``scandir``: nothing is opened or changed.
"""

from __future__ import annotations

import enum
import os
import shlex
import stat
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath
from typing import Final

from gatewayd.errors import GatewayError
from gatewayd.sandbox.plan import (
    COGNI_TOOL_VISIBLE_DIR,
    DENIED_HOST_TREES,
    HIDDEN_HOST_TREES,
    SANDBOX_HOME,
    SANDBOX_PATH,
    SANDBOX_SOCKET,
    WORKSPACE,
)

# cogni-tool's launcher starts with ``#!/usr/bin/python3 -IS`` (docs/cogni-tool.md), so this
# exact path must lead to an interpreter; PATH plays no part in a shebang.
PYTHON3: Final = "/usr/bin/python3"
# Linux gives up on a path after 40 symlinks (MAXSYMLINKS); so does the resolution here.
MAX_SYMLINKS: Final = 40
# Enough for the top levels of a large toolchain image (/usr/bin of a full Debian holds a
# few thousand entries) while the check stays well under a second on a cold cache.
MAX_ENTRIES_CHECKED: Final = 20_000
# An image unpacked as the wrong user has one problem per file; the first ones show the
# pattern and the fix, the rest only bury it.
MAX_PROBLEMS_SHOWN: Final = 40
ROOT_UID: Final = 0
# Others' permission bits: bwrap and the sandbox are "others" to every file of the image.
_OTHER_EXEC: Final = stat.S_IXOTH
_OTHER_READ: Final = stat.S_IROTH
_GROUP_OTHER_WRITE: Final = stat.S_IWGRP | stat.S_IWOTH


class ImageError(GatewayError):
    """gatewayd refuses this image (an operator configuration fault, never the sandbox's);
    the message lists every problem and its fix."""


class EntryKind(enum.Enum):
    DIRECTORY = "directory"
    FILE = "file"


@dataclass(frozen=True, slots=True, kw_only=True)
class MountPoint:
    """A path gatewayd mounts over inside the image, and what it mounts there."""

    path: str
    kind: EntryKind
    purpose: str  # what gatewayd mounts there (or in it)
    covered: bool = True  # mounted over itself (False: only things inside it are)


_DIR: Final = EntryKind.DIRECTORY
_FILE: Final = EntryKind.FILE


# Parents first. ``covered``: gatewayd mounts over the path itself, so only its type
# matters; /etc and /run/cogni are not mounted over, only files in them are.
MOUNT_POINTS: Final[tuple[MountPoint, ...]] = (
    MountPoint(
        path="/etc", kind=_DIR, covered=False, purpose="generated passwd, group and hosts files"
    ),
    MountPoint(path="/etc/passwd", kind=_FILE, purpose="a generated file naming the sandbox user"),
    MountPoint(path="/etc/group", kind=_FILE, purpose="a generated file naming the sandbox group"),
    MountPoint(path="/etc/hosts", kind=_FILE, purpose="a generated file naming only localhost"),
    MountPoint(path="/proc", kind=_DIR, purpose="the sandbox's own /proc"),
    MountPoint(path="/dev", kind=_DIR, purpose="a minimal /dev"),
    MountPoint(path=SANDBOX_HOME, kind=_DIR, purpose="a private tmpfs (the sandbox's HOME)"),
    MountPoint(path=WORKSPACE, kind=_DIR, purpose="the run's workspace"),
    MountPoint(path=COGNI_TOOL_VISIBLE_DIR, kind=_DIR, purpose="cogni-tool (read-only)"),
    MountPoint(
        path=str(PurePosixPath(SANDBOX_SOCKET).parent),
        kind=_DIR,
        covered=False,
        purpose="the run's socket",
    ),
    MountPoint(path=SANDBOX_SOCKET, kind=_FILE, purpose="the run's gateway socket"),
)
# Hidden under gatewayd's mounts in the sandbox: their modes and contents do not matter.
_COVERED: Final = frozenset(mp.path for mp in MOUNT_POINTS if mp.covered)
# Directories of the sandbox's PATH that live in the image (cogni-tool's is mounted).
_PATH_DIRS: Final = tuple(d for d in SANDBOX_PATH.split(":") if d != COGNI_TOOL_VISIBLE_DIR)


@dataclass(frozen=True, slots=True, kw_only=True)
class ImageReport:
    """The outcome of :func:`check_image`; ``ok`` only without problems."""

    image: str
    problems: tuple[str, ...]
    entries_checked: int
    # Where /usr/bin/python3 leads inside the image, when it leads somewhere usable.
    python3: str | None

    @property
    def ok(self) -> bool:
        return not self.problems

    def render(self) -> str:
        """What ``gatewayd image check`` prints (and what :class:`ImageError` says)."""
        if self.ok:
            return (
                f"OK: {self.image} can be a sandbox root (python3 is {self.python3}; "
                f"{self.entries_checked} entries checked)"
            )
        count = len(self.problems)
        lines = [
            f"{self.image} cannot be a sandbox root; {count} problem(s) "
            "(paths inside the image as the sandbox sees them):"
        ]
        lines += [f"  - {problem}" for problem in self.problems[:MAX_PROBLEMS_SHOWN]]
        if count > MAX_PROBLEMS_SHOWN:
            lines.append(
                f"  ... and {count - MAX_PROBLEMS_SHOWN} more; fix the ones above and check again"
            )
        return "\n".join(lines)


def check_image(path: Path, *, policy_mount_points: Sequence[str] = ()) -> ImageReport:
    """Every problem that makes ``path`` unusable or unsafe as a sandbox root, each with
    its fix (see the module docstring for the list of checks).

    ``policy_mount_points`` are the visible paths of a run's policy directories (absolute,
    normalized, as ``PolicyMount.visible``); those not under /workspace must exist in the
    image as directories too. Without them the image is checked for any run.

    Error handling: never raises for what it finds; an entry it cannot read (the check
    run as a user who may not list the image) is reported as a problem.
    """
    image = str(path)
    problems: list[str] = []
    if not path.is_absolute():
        problems.append(
            f"{image!r} is a relative path; give the image as an absolute path "
            f"(from here that is {shlex.quote(str(path.absolute()))})"
        )
        return ImageReport(image=image, problems=tuple(problems), entries_checked=0, python3=None)
    try:
        st = os.stat(path)
    except OSError as exc:
        problems.append(f"{image} cannot be used: {exc.strerror}; give an existing directory")
        return ImageReport(image=image, problems=tuple(problems), entries_checked=0, python3=None)
    if not stat.S_ISDIR(st.st_mode):
        problems.append(f"{image} is not a directory; an image is a directory holding a root tree")
        return ImageReport(image=image, problems=tuple(problems), entries_checked=0, python3=None)
    real = os.path.realpath(path)
    if real != image:
        problems.append(
            f"{image} is not the image's real path (a symlink or '..' on the way; it is "
            f"really {real}); give {shlex.quote(real)}: the path as given is what gets checked "
            "against the host trees a sandbox never sees"
        )
    problems += _location_problems(real)
    problems += _parent_problems(Path(real))
    root = _Image(path)
    for mount_point in (*MOUNT_POINTS, *_policy_mount_points(policy_mount_points)):
        root.check_mount_point(mount_point)
    python3 = root.check_python3()
    root.check_entries()
    problems += root.problems
    return ImageReport(
        image=image, problems=tuple(problems), entries_checked=root.checked, python3=python3
    )


def require_image(path: Path, *, policy_mount_points: Sequence[str] = ()) -> ImageReport:
    """:func:`check_image`, raising :class:`ImageError` (its rendered report) on any problem."""
    report = check_image(path, policy_mount_points=policy_mount_points)
    if not report.ok:
        raise ImageError(report.render())
    return report


def _policy_mount_points(visible_paths: Sequence[str]) -> list[MountPoint]:
    # Under /workspace they are made in the workspace bind, which is writable; elsewhere the
    # read-only image must already have them.
    return [
        MountPoint(path=visible, kind=_DIR, purpose="a directory of the run's policy")
        for visible in sorted(set(visible_paths))
        if not _within(visible, WORKSPACE)
    ]


# --- the image's location on the host --------------------------------------------------


def _location_problems(image: str) -> list[str]:
    """The same rule the plan applies to every bind source (``plan.validate``)."""
    inside = [tree for tree in DENIED_HOST_TREES if _within(image, tree)]
    holds = [tree for tree in (*DENIED_HOST_TREES, *HIDDEN_HOST_TREES) if _within(tree, image)]
    fix = "keep images in a directory of their own, e.g. /srv/cogni/images/NAME"
    problems = []
    if inside:
        problems.append(f"{image} lies in {inside[0]}, which a sandbox never sees; {fix}")
    if holds:
        problems.append(
            f"{image} holds host trees a sandbox never sees ({', '.join(holds)}); {fix}"
        )
    return problems


def _parent_problems(path: Path) -> list[str]:
    """DIR's parents: reachable by others, and changeable by nobody but root."""
    problems = []
    for parent in reversed(path.parents):
        try:
            st = os.lstat(parent)
        except OSError as exc:
            problems.append(f"cannot inspect {parent}: {exc.strerror}; run the check as root")
            continue
        where = shlex.quote(str(parent))
        if not st.st_mode & _OTHER_EXEC:
            problems.append(
                f"{parent} (a parent of the image) is not traversable by others; bwrap runs as "
                f"an unprivileged per-run uid and must reach the image: chmod o+x {where}"
            )
        if st.st_uid != ROOT_UID:
            problems.append(
                f"{parent} (a parent of the image) is owned by uid {st.st_uid}, who could swap "
                f"the image for another; keep images under root-owned directories: "
                f"chown root {where}"
            )
        if st.st_mode & _GROUP_OTHER_WRITE and not st.st_mode & stat.S_ISVTX:
            problems.append(
                f"{parent} (a parent of the image) is writable by group or others, who could "
                f"swap the image for another: chmod go-w {where}"
            )
    return problems


# --- inside the image ------------------------------------------------------------------


@dataclass(slots=True)
class _Image:
    """One check's walk over the image at ``root``: accumulates problems."""

    root: Path
    problems: list[str] = field(default_factory=list)
    checked: int = 0
    # Visible directories the sandbox (or bwrap) must traverse; checked for o+x once.
    _traversed: dict[str, os.stat_result] = field(default_factory=dict)
    _reported: set[str] = field(default_factory=set)

    def on_host(self, visible: str) -> str:
        """The host path of ``visible`` (a clean absolute path inside the image)."""
        return os.path.join(self.root, visible.lstrip("/")).rstrip("/") or "/"

    def host(self, visible: str) -> str:
        """The host path of ``visible``, quoted for a shell command."""
        return shlex.quote(self.on_host(visible))

    def report_once(self, key: str, problem: str) -> None:
        if key not in self._reported:
            self._reported.add(key)
            self.problems.append(problem)

    def lstat(self, visible: str) -> os.stat_result | None:
        """``lstat`` of ``visible``; None if it does not exist (other errors reported)."""
        try:
            return os.lstat(self.on_host(visible))
        except (FileNotFoundError, NotADirectoryError):
            return None
        except OSError as exc:
            self.report_once(
                visible,
                f"cannot inspect {visible} ({self.host(visible)}): {exc.strerror}; run the "
                "check as root",
            )
            return None

    # -- mount points --

    def check_mount_point(self, mount_point: MountPoint) -> None:
        parts = PurePosixPath(mount_point.path).parts[1:]
        for depth in range(1, len(parts) + 1):
            visible = "/" + "/".join(parts[:depth])
            last = depth == len(parts)
            st = self.lstat(visible)
            if st is None:
                gap = "" if last else f" (there is no {visible})"
                self.problems.append(
                    f"{mount_point.path} is missing{gap}: gatewayd mounts {mount_point.purpose} "
                    f"{'on' if mount_point.covered else 'in'} it, and bwrap cannot create it in "
                    f"a read-only image; create it: {self._create_command(mount_point)}"
                )
                return
            want = mount_point.kind if last else EntryKind.DIRECTORY
            if stat.S_ISLNK(st.st_mode):
                target = os.readlink(self.on_host(visible))
                self.report_once(
                    visible,
                    f"{visible} is a symlink (to {target!r}); gatewayd mounts at "
                    f"{mount_point.path}, so {visible} must be a real {want.value}: replace it: "
                    f"rm {self.host(visible)} && {self._make_command(visible, want)}",
                )
                return
            if _kind(st) is not want:
                self.report_once(
                    visible,
                    f"{visible} is not a {want.value}; gatewayd mounts at {mount_point.path}, "
                    f"so {visible} must be a {want.value} (bwrap binds directories onto "
                    f"directories and files onto files): replace it: "
                    f"rm -r {self.host(visible)} && {self._make_command(visible, want)}",
                )
                return
            # A covered directory's own mode is the mount's; only those above it are walked.
            if want is EntryKind.DIRECTORY and not (last and mount_point.covered):
                self._traversed[visible] = st

    def _create_command(self, mount_point: MountPoint) -> str:
        if mount_point.kind is EntryKind.DIRECTORY:
            return f"mkdir -p {self.host(mount_point.path)}"
        parent = str(PurePosixPath(mount_point.path).parent)
        return f"mkdir -p {self.host(parent)} && touch {self.host(mount_point.path)}"

    def _make_command(self, visible: str, kind: EntryKind) -> str:
        if kind is EntryKind.DIRECTORY:
            return f"mkdir -m 0755 {self.host(visible)}"
        return f"touch {self.host(visible)}"

    # -- python3 --

    def check_python3(self) -> str | None:
        """Resolve :data:`PYTHON3` inside the image; the visible path it leads to, if usable."""
        resolved = self.resolve(PYTHON3)
        self._traversed.update(resolved.directories)
        trail = "".join(f"; {step}" for step in resolved.trail)
        install = (
            "cogni-tool runs with the image's python3 (standard library only): install it "
            "(debootstrap --include=python3, or apt-get install python3 in the Dockerfile)"
        )
        found = resolved.visible
        if found is None:
            self.problems.append(
                f"{PYTHON3} does not lead to a file in the image: {resolved.failure}{trail} "
                f"(symlinks are followed inside the image, never on the host); {install}"
            )
            return None
        st = self.lstat(found)
        if st is None:  # pragma: no cover (resolve has just seen it)
            return None
        if not stat.S_ISREG(st.st_mode):
            self.problems.append(
                f"{PYTHON3} leads to {found}, not a regular file{trail}; {install}"
            )
            return None
        if st.st_mode & (_OTHER_EXEC | _OTHER_READ) != _OTHER_EXEC | _OTHER_READ:
            self.problems.append(
                f"{PYTHON3} leads to {found}, which others cannot read and execute; the "
                f"sandbox's uid is an other: chmod 0755 {self.host(found)}"
            )
            return None
        return found

    def resolve(self, visible: str) -> _Resolution:
        """Follow ``visible`` inside the image, as the sandbox would: ``..`` stops at the
        image root and an absolute symlink restarts there, never on the host."""
        pending = list(reversed(PurePosixPath(visible).parts[1:]))
        current: list[str] = []
        trail: list[str] = []
        passed: list[tuple[str, os.stat_result]] = []
        while pending:
            name = pending.pop()
            if name in ("", "."):
                continue
            if name == "..":
                if current:
                    current.pop()
                continue
            candidate = "/" + "/".join([*current, name])
            st = self.lstat(candidate)
            if st is None:
                return _Resolution(
                    visible=None,
                    trail=tuple(trail),
                    directories=tuple(passed),
                    failure=f"{candidate} does not exist in the image ({self.host(candidate)})",
                )
            if stat.S_ISLNK(st.st_mode):
                if len(trail) == MAX_SYMLINKS:
                    return _Resolution(
                        visible=None,
                        trail=tuple(trail[:3]),
                        directories=tuple(passed),
                        failure=f"more than {MAX_SYMLINKS} symlinks (a loop?)",
                    )
                target = os.readlink(self.on_host(candidate))
                trail.append(f"{candidate} -> {target}")
                if target.startswith("/"):
                    current = []
                pending.extend(reversed(target.split("/")))
                continue
            if pending:
                if not stat.S_ISDIR(st.st_mode):
                    return _Resolution(
                        visible=None,
                        trail=tuple(trail),
                        directories=tuple(passed),
                        failure=f"{candidate} is not a directory",
                    )
                passed.append((candidate, st))
            current.append(name)
        return _Resolution(
            visible="/" + "/".join(current),
            trail=tuple(trail),
            failure=None,
            directories=tuple(passed),
        )

    # -- modes and owners near the top --

    def check_entries(self) -> None:
        root_st = self.lstat("/")
        if root_st is not None:
            self._check_owner_and_mode("/", root_st)
            if not root_st.st_mode & _OTHER_EXEC:
                self.problems.append(
                    f"the image root is not traversable by others; bwrap runs as an "
                    f"unprivileged per-run uid: chmod o+x {self.host('/')}"
                )
        for visible, st in sorted(self._traversed.items()):
            if not st.st_mode & _OTHER_EXEC:
                self.problems.append(
                    f"{visible} is not traversable by others; the sandbox's uid is an other "
                    f"and must pass through it: chmod o+x {self.host(visible)}"
                )
        for directory in self._listed_directories():
            for visible, st in self._entries(directory):
                if self.checked >= MAX_ENTRIES_CHECKED:
                    return
                self.checked += 1
                if visible not in _COVERED:
                    self._check_owner_and_mode(visible, st)

    def _listed_directories(self) -> Iterator[str]:
        """The image root, its top-level directories and the PATH directories, each once."""
        seen: set[str] = set()
        candidates = ["/"]
        for top, st in self._entries("/"):
            if stat.S_ISDIR(st.st_mode) and top not in _COVERED:
                candidates.append(top)
        for path_dir in _PATH_DIRS:
            resolved = self.resolve(path_dir).visible
            if resolved is not None:
                candidates.append(resolved)
        for directory in candidates:
            found = self.lstat(directory)
            if directory not in seen and found is not None and stat.S_ISDIR(found.st_mode):
                seen.add(directory)
                yield directory

    def _entries(self, directory: str) -> list[tuple[str, os.stat_result]]:
        prefix = "" if directory == "/" else directory
        try:
            with os.scandir(self.on_host(directory)) as it:
                names = sorted(entry.name for entry in it)
        except OSError as exc:
            self.report_once(
                directory,
                f"cannot list {directory} ({self.host(directory)}): {exc.strerror}; run the "
                "check as root",
            )
            return []
        out = []
        for name in names:
            st = self.lstat(f"{prefix}/{name}")
            if st is not None:
                out.append((f"{prefix}/{name}", st))
        return out

    def _check_owner_and_mode(self, visible: str, st: os.stat_result) -> None:
        if stat.S_ISLNK(st.st_mode):
            return  # a symlink cannot be changed in place; its directory's mode decides
        where = self.host(visible)
        if st.st_uid != ROOT_UID:
            self.report_once(
                f"owner {visible}",
                f"{visible} is owned by uid {st.st_uid}; on the host that uid could change it "
                f"under every later run: chown root {where} (or chown -R root:root on the "
                "whole image)",
            )
        if st.st_mode & _GROUP_OTHER_WRITE:
            self.report_once(
                f"mode {visible}",
                f"{visible} is writable by group or others (mode {stat.filemode(st.st_mode)}); "
                f"the image's groups are host groups, whose members could change it under "
                f"every later run: chmod go-w {where}",
            )


@dataclass(frozen=True, slots=True, kw_only=True)
class _Resolution:
    visible: str | None  # where it leads, if it exists
    trail: tuple[str, ...]  # the symlinks followed, "link -> target"
    failure: str | None  # why it leads nowhere
    directories: tuple[tuple[str, os.stat_result], ...] = ()  # passed through on the way


def _kind(st: os.stat_result) -> EntryKind | None:
    if stat.S_ISDIR(st.st_mode):
        return EntryKind.DIRECTORY
    if stat.S_ISREG(st.st_mode):
        return EntryKind.FILE
    return None


def _within(path: str, root: str) -> bool:
    """``path`` is ``root`` or lies beneath it (both clean absolute paths)."""
    return root in ("/", path) or path.startswith(root + "/")
