"""What gatewayd may lend to a sandbox: directories strictly beneath a lendable root,
never a system tree.

Lending a tree (:mod:`gatewayd.sandbox.lease`) chowns what it holds to the run's uid, and
the run then rewrites whatever it likes there. Lent a system directory, a run could
rewrite a script root runs later, and the chown alone would clear set-user-ID bits. So
what may be lent is an allowlist, in three checks:

1. The operator names the lendable roots (the ``lendable_roots`` setting; by default
   :data:`DEFAULT_LENDABLE_ROOTS`, where workspaces live on a fresh host). Each root is
   checked when the configuration is read (:func:`root_problem`): ``/`` and ``/srv`` are
   never roots, nor is any path at, above or beneath a system tree (:data:`SYSTEM_TREES`)
   or gatewayd's own state and agent directories. So not even an operator makes /usr
   lendable by mistake.
2. Every run's workspace and ``rw`` policy path must lie strictly beneath a root, on its
   real path (symlinks and ``..`` resolved): a root itself is never lent whole, since it
   holds what every user keeps there (:meth:`LendableRoots.require`). gatewayd checks
   this when it creates the run, sandboxed or degraded, and the lease checks it again
   before the first chown.
3. A bind mount under a root can show a system tree there (``mount --bind /usr
   /tmp/x``). The real path of such a tree is under the root, so the last check looks at
   what the mounts crossed between the root and the tree show: the device and path
   within its file system of each (from ``/proc/self/mountinfo``), and the (device,
   inode) of every directory on the way, compared with the system trees'. A bind of a
   system tree, of a directory in one, or of ``/`` itself is refused.

Directories gatewayd made itself for one run (an agent run's work directory, mode 0700,
its own) are *own* roots: nothing of the host is in them, so they need not pass check 1
(the default ``agent_dir`` lies in /var/lib); checks 2 and 3 still apply beneath them.

gatewayd's own directories (:class:`OwnDirectory`: the state directory, the agent
directory, the audit log's and the control socket's) are never lent, whatever the roots
say: a tree that holds one is refused (the sandbox would write the audit log, the
cogni-tool copy every run executes, other runs' directories), and so is a tree beneath the
state or agent directory (another run's files), outside an own root. A lendable root
above the state directory is fine (the default ``/tmp`` holds the tests' state
directories): the check is on each tree, on real paths, so a symlink or ``..`` in a
setting or a workspace path changes nothing.
"""

from __future__ import annotations

import os
import posixpath
import stat
from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Final

from gatewayd.errors import GatewayError
from gatewayd.protocol import ErrorCode

# The roots' rules live apart, so a client reads them without this module's imports;
# the names stay importable from here, where the rest of lending is.
from gatewayd.sandbox.lendroots import (  # noqa: F401 (re-exported)
    DEFAULT_LENDABLE_ROOTS,
    NEVER_ROOTS,
    SYSTEM_TREES,
    is_clean_absolute,
    is_within,
    real_root_problem,
    root_problem,
)

# What an own root must look like: a directory of gatewayd's own user that nobody else
# may enter (as gatewayd makes an agent run's work directory).
_OWN_ROOT_FORBIDDEN_BITS: Final = 0o077
# The system trees a message names as examples.
_EXAMPLES: Final = ("/usr", "/etc", "/opt", "/root", "/var/lib")
SETTING_HINT: Final = "lendable_roots (option --lendable-root, variable GATEWAYD_LENDABLE_ROOTS)"
PROC_SELF_MOUNTINFO: Final = "/proc/self/mountinfo"


class NotLendable(GatewayError):
    """A workspace or ``rw`` policy path lies under no lendable root, or is a system tree
    in disguise; nothing was lent. The caller's request, not gatewayd's fault."""

    code = ErrorCode.BAD_REQUEST


# --- mounts (pure) -----------------------------------------------------------------------


@dataclass(frozen=True, slots=True, kw_only=True)
class Mount:
    """One line of mountinfo: file system ``device`` (major:minor), the directory of it
    that is mounted (``root``), and where (``point``)."""

    device: str
    root: str
    point: str


def parse_mountinfo(text: str) -> tuple[Mount, ...]:
    """The mounts of a mountinfo text, in its order (a later mount at the same point
    hides an earlier one). Lines too short to hold the fields are skipped."""
    return tuple(mount for line in text.splitlines() if (mount := _parse_line(line)) is not None)


def _parse_line(line: str) -> Mount | None:
    fields = line.split(" ")
    if len(fields) > 4:
        return Mount(device=fields[2], root=unescape(fields[3]), point=unescape(fields[4]))
    return None


def unescape(field: str) -> str:
    """mountinfo writes space, tab, newline and backslash as octal escapes."""
    return (
        field.replace("\\040", " ")
        .replace("\\011", "\t")
        .replace("\\012", "\n")
        .replace("\\134", "\\")
    )


def locate(mounts: Sequence[Mount], path: str) -> tuple[str, str]:
    """Where ``path`` is: (device, its path within that file system), through the mount
    that holds it (the deepest mount point at or above it, the last one mounted there).

    An absolute path is looked up directory by directory, from itself up to ``/``, in
    the table's mount points (:func:`_shown_at`): a lookup per level of the path instead
    of a comparison with every mount (a start judges a few dozen paths against a table
    that grows with every live run's mounts)."""
    best: Mount | None = None
    shown = _shown_at(mounts) if is_clean_absolute(path) else None
    if shown is not None:
        # Every mount point at or above a clean path is one of its directories.
        probe = path
        while (best := shown.get(probe)) is None and probe != "/":
            probe = posixpath.dirname(probe)
    else:
        for mount in mounts:
            if is_within(path, mount.point) and (
                best is None or len(mount.point) >= len(best.point)
            ):
                best = mount
    if best is None:
        return ("", path)
    rest = posixpath.relpath(path, best.point)
    return (best.device, posixpath.normpath(posixpath.join(best.root, rest)))


def _shown_at(mounts: Sequence[Mount]) -> dict[str, Mount] | None:
    """Each mount point of ``mounts`` and the mount it shows (the last one mounted there),
    kept for the table (a changed table, parsed again, is a new tuple); None when a
    point is not a clean absolute path (then only a comparison with each mount says
    which ones hold a path)."""
    last = _MEMO.points
    if last is not None and last[0] is mounts:
        return last[1]
    points: dict[str, Mount] = {}
    for mount in mounts:
        points[mount.point] = mount  # a later mount at a point replaces an earlier one
    clean = all(is_clean_absolute(point) for point in points)
    shown = points if clean else None
    if isinstance(mounts, tuple):  # a tuple only: it cannot change in place
        _MEMO.points = (mounts, shown)
    return shown


def system_tree_shown(mounts: Sequence[Mount], path: str) -> str | None:
    """The system tree whose files ``path`` shows (at, beneath or above it, on the same
    file system), or None. ``/`` counts only when ``path`` shows all of it: a bind of
    another directory of the root file system shows none of the system."""
    device, where = locate(mounts, path)
    places = _system_places(mounts)
    if (device, where) == places.root:
        return "/"
    for tree, (tree_device, tree_where) in places.trees:
        if device == tree_device and (is_within(where, tree_where) or is_within(tree_where, where)):
            return tree
    return None


@dataclass(frozen=True, slots=True, kw_only=True)
class _SystemPlaces:
    """Where ``/`` and each system tree are (:func:`locate`) in one mount table."""

    mounts: Sequence[Mount]
    root: tuple[str, str]
    trees: tuple[tuple[str, tuple[str, str]], ...]
    # What the table shows at :data:`_SYSTEM_PROBES` (None: no view, see _shown_at).
    view: tuple[Mount | None, ...] | None = None


class _MountMemo:
    """The last mount table read (its text and its parse: an unchanged table is the same
    tuple) and what was worked out from the tables read. A run's start judges its trees
    several times (the run's creation, each lease), and locating the 22 system trees
    again each time took most of a start's time in the event loop once the host had a
    few dozen mounts (every live run adds some). Each run's own mounts (its namespace,
    its session's view) change the table between two judgements of one start, yet they
    move no system tree and no root: so the places and the verdicts are kept by what
    they depend on (:func:`_view`: the mounts at the paths they look up), not by the
    table. Each attribute is replaced whole, so threads judging at once see one or the
    other; the verdicts' dict alone is added to in place, one entry at a time."""

    table: tuple[str, tuple[Mount, ...]] | None = None
    # Each line of that table and its parse (:func:`mounts_of`).
    lines: dict[str, Mount | None] | None = None
    places: _SystemPlaces | None = None
    # Each mount point of that table and what it shows (:func:`_shown_at`).
    points: tuple[Sequence[Mount], dict[str, Mount] | None] | None = None
    # Each configured root's verdict (:func:`_root_verdict`), by its real path and
    # gatewayd's private directories, with the view it was made in: every judge asks it
    # again of each root.
    verdicts: dict[tuple[str, _Reserved], tuple[_View, str | None]] | None = None


_MEMO: Final = _MountMemo()
# The verdicts kept: a daemon asks of its few configured roots under its one set of
# private directories, so more means something asks of ever new paths; the memo then
# starts afresh rather than grow.
_MAX_VERDICTS: Final = 256


def _above(path: str) -> tuple[str, ...]:
    """A clean absolute ``path`` and each directory above it, up to ``/``: the mount
    points :func:`locate` looks up for it."""
    found = [path]
    while path != "/":
        path = posixpath.dirname(path)
        found.append(path)
    return tuple(found)


# The mount points the system trees' places depend on (:func:`_system_places`).
_SYSTEM_PROBES: Final = tuple(sorted({p for tree in ("/", *SYSTEM_TREES) for p in _above(tree)}))

# What a table shows at some mount points (None: no mount there), in their order.
_View = tuple[Mount | None, ...]


def _view(shown: dict[str, Mount], probes: tuple[str, ...]) -> _View:
    """What ``shown`` mounts at each of ``probes``: :func:`locate` of a clean path
    depends on the table only through this, at the path's :func:`_above`, so two tables
    with one view give it one answer."""
    return tuple(shown.get(probe) for probe in probes)


def _system_places(mounts: Sequence[Mount]) -> _SystemPlaces:
    last = _MEMO.places
    if last is not None and last.mounts is mounts:
        return last
    shown = _shown_at(mounts)
    view = None if shown is None else _view(shown, _SYSTEM_PROBES)
    if last is not None and view is not None and last.view == view:
        # Another table (a run's namespace or view mounted since), the same places.
        places = replace(last, mounts=mounts)
    else:
        places = _SystemPlaces(
            mounts=mounts,
            root=locate(mounts, "/"),
            trees=tuple((tree, locate(mounts, tree)) for tree in SYSTEM_TREES),
            view=view,
        )
    if isinstance(mounts, tuple):  # a tuple only: it cannot change in place
        _MEMO.places = places
    return places


_Reserved = tuple[tuple[str, Path], ...]  # gatewayd's private directories, by setting


def _root_verdict(mounts: Sequence[Mount], real: str, private: _Reserved) -> str | None:
    """Why the configured root at ``real`` is no root in the mount table ``mounts``
    (:func:`root_problem`, then a system tree it shows), or None. The first is pure in
    its arguments, and the second depends on the table only through its view at the
    system trees' places and at the root's (:func:`_view`), so the verdict is kept with
    that view and made again when the view differs (a mount at or above the root or a
    system tree, or gone from there); the root's real path is the caller's to find each
    time (a symlink may change it without a mount)."""
    shown = _shown_at(mounts)
    if shown is None or not is_clean_absolute(real):
        return _make_verdict(mounts, real, private)  # no view to keep it by
    view = _view(shown, _SYSTEM_PROBES) + _view(shown, _above(real))
    memo = _MEMO.verdicts
    if memo is None or len(memo) >= _MAX_VERDICTS:
        memo = _MEMO.verdicts = {}
    key = (real, private)
    kept = memo.get(key)
    if kept is not None and kept[0] == view:
        return kept[1]
    problem = _make_verdict(mounts, real, private)
    memo[key] = (view, problem)
    return problem


def _make_verdict(mounts: Sequence[Mount], real: str, private: _Reserved) -> str | None:
    problem = root_problem(real, private)
    if problem is None and (system := system_tree_shown(mounts, real)) is not None:
        problem = f"it shows the system tree {system} (a mount)"
    return problem


def mounts_crossed(mounts: Sequence[Mount], root: str, tree: str) -> list[str]:
    """Mount points strictly beneath ``root`` and at or above ``tree``."""
    return sorted(
        {
            mount.point
            for mount in mounts
            if mount.point != root and is_within(mount.point, root) and is_within(tree, mount.point)
        }
    )


# --- the check (reads the host) ------------------------------------------------------------

# How a tree is opened to be judged: whatever its name leads to, a symlink as itself (so
# the descriptor says what it opened, and nothing through a symlink is ever judged).
TREE_FLAGS: Final = os.O_PATH | os.O_NOFOLLOW | os.O_CLOEXEC


@dataclass(frozen=True, slots=True, kw_only=True)
class OwnDirectory:
    """One of gatewayd's own directories, by its real ``path`` and the ``setting`` that
    places it (``state_dir``, ``audit_path's directory``...); ``private``: nothing
    beneath it may be lent either (it holds other runs' files), not only nothing that
    holds it."""

    setting: str
    path: Path
    private: bool


@dataclass(frozen=True, slots=True, kw_only=True)
class LendableRoots:
    """The roots a run's trees may be lent beneath: the operator's ``configured`` ones,
    and ``own`` directories gatewayd made for this run alone; ``reserved`` are
    gatewayd's own directories, never lent whatever the roots say (see the module's
    doc)."""

    configured: tuple[Path, ...] = tuple(Path(root) for root in DEFAULT_LENDABLE_ROOTS)
    own: tuple[Path, ...] = ()
    reserved: tuple[OwnDirectory, ...] = ()

    def require(self, tree: Path, *, what: str = "") -> tuple[int, int]:
        """Refuse ``tree`` unless it may be lent; returns the (device, inode) of the
        directory checked, so the caller can make sure it lends that one.

        The tree is opened once (``O_PATH``, no symlink at its end) and judged by the
        kernel's name for what was opened (:meth:`judge`), so a symlink or ``..``
        anywhere in ``tree`` is judged where it leads.

        Error handling: :class:`NotLendable` naming the tree, the roots and the setting
        to change.
        """
        fd = open_tree(tree, f"{what} {tree}".strip())
        try:
            return self.judge(fd, tree, what=what)
        finally:
            os.close(fd)

    def judge(self, fd: int, tree: Path, *, what: str = "") -> tuple[int, int]:
        """:meth:`require` for the directory open at ``fd`` (opened from ``tree``, as
        :func:`open_tree` does): the directory judged is the one the descriptor holds,
        wherever its path leads by now, so a caller that goes on with ``fd`` acts on
        exactly what was judged. Returns its (device, inode)."""
        label = f"{what} {tree}".strip()
        real = os.readlink(f"/proc/self/fd/{fd}")
        st = os.fstat(fd)
        shown = label if real == str(tree) else f"{label} (really {real})"
        mounts = _read_mounts(shown)
        roots, unusable = self._usable(mounts)
        for root in roots:
            if real == root:
                raise NotLendable(
                    f"{shown} is a lendable root itself; a root is never lent whole (it "
                    "holds what every user keeps there): use a directory beneath it"
                )
        beneath = [root for root in roots if is_within(real, root)]
        if not beneath:
            raise NotLendable(
                f"{shown} lies under no lendable root, and gatewayd lends (chowns to the "
                f"run's uid) only directories strictly beneath one of: "
                f"{', '.join(str(r) for r in self.configured) or '(none)'}"
                + "".join(f"; {note}" for note in unusable)
                + f". Use a directory there, or add a root above it to {SETTING_HINT}; a "
                f"system tree ({', '.join(_EXAMPLES)}, ...) can never be one"
            )
        root = max(beneath, key=len)
        for point in mounts_crossed(mounts, root, real):
            system = system_tree_shown(mounts, point)
            if system is not None:
                raise NotLendable(
                    f"{shown}: {point} is a mount that shows the system tree {system}, "
                    "which is never lent; lend a directory of its own, not a bind mount of "
                    "the system"
                )
        _refuse_system_identity(shown, Path(root), Path(real))
        self._refuse_own_directories(shown, real)
        return (st.st_dev, st.st_ino)

    def _refuse_own_directories(self, shown: str, real: str) -> None:
        """No tree may hold one of gatewayd's own directories, nor lie in a private one
        (outside a directory gatewayd made for this run): all on real paths."""
        own = [os.path.realpath(root) for root in self.own]
        for directory in self.reserved:
            path = str(directory.path)
            if is_within(path, real):
                raise NotLendable(
                    f"{shown} holds gatewayd's own {directory.setting} {path}, which a "
                    "sandbox never writes: use a directory that neither holds nor lies in "
                    "gatewayd's own directories"
                )
            if (
                directory.private
                and is_within(real, path)
                and not any(is_within(real, root) and real != root for root in own)
            ):
                raise NotLendable(
                    f"{shown} lies in gatewayd's own {directory.setting} {path}, which "
                    "holds other runs' files and is never lent: use a directory outside "
                    "gatewayd's own directories"
                )

    def _usable(self, mounts: Sequence[Mount]) -> tuple[list[str], list[str]]:
        """The real paths of the roots that are roots here, and why each other configured
        root is not: a configured root must pass the configuration's check on its real
        path too (a symlink to /usr is no root) and must not be a mount showing a system
        tree; an own root must be a directory of gatewayd's user nobody else may enter."""
        usable: list[str] = []
        unusable: list[str] = []
        private = tuple((d.setting, d.path) for d in self.reserved if d.private)
        for root in self.configured:
            real = os.path.realpath(root)
            problem = _root_verdict(mounts, real, private)
            if problem is None:
                usable.append(real)
            else:
                unusable.append(f"{root} is no root here: {problem}")
        for root in self.own:
            try:
                st = os.lstat(root)
            except OSError as exc:
                unusable.append(f"gatewayd's own {root} is no root here: {exc.strerror}")
                continue
            if (
                stat.S_ISDIR(st.st_mode)
                and st.st_uid == os.geteuid()
                and not st.st_mode & _OWN_ROOT_FORBIDDEN_BITS
            ):
                usable.append(os.path.realpath(root))
            else:
                unusable.append(
                    f"gatewayd's own {root} is no root here: it must be a directory of "
                    f"uid {os.geteuid()} that nobody else may enter (mode 0700)"
                )
        return usable, unusable


def open_tree(tree: Path, label: str) -> int:
    """An ``O_PATH`` descriptor of the directory at ``tree`` (no symlink at its end), to
    judge and then act on that directory alone.

    Error handling: :class:`NotLendable` saying why ``label`` cannot be lent (what was
    opened says it, not a second look at a name that may have changed since)."""
    try:
        fd = os.open(tree, TREE_FLAGS)
    except OSError as exc:
        raise NotLendable(f"{label} cannot be lent: {exc.strerror}; name a directory") from exc
    mode = os.fstat(fd).st_mode
    if stat.S_ISDIR(mode):
        return fd
    os.close(fd)
    why = "it is a symlink" if stat.S_ISLNK(mode) else "it is not a directory"
    raise NotLendable(f"{label} cannot be lent: {why}; name a directory")


def _read_mounts(shown: str) -> tuple[Mount, ...]:
    """The mount table as it is now (read every time; parsed again only if it changed)."""
    try:
        with open(PROC_SELF_MOUNTINFO, encoding="utf-8", errors="surrogateescape") as info:
            text = info.read()
    except OSError as exc:  # no way to tell a bind mount of /usr: fail closed
        raise NotLendable(
            f"{shown} cannot be checked for bind mounts of system trees: "
            f"{PROC_SELF_MOUNTINFO}: {exc.strerror}"
        ) from exc
    return mounts_of(text)


def mounts_of(text: str) -> tuple[Mount, ...]:
    """:func:`parse_mountinfo` of a mountinfo text read just now, parsed again only when
    it differs from the last one: the same text gives the same tuple, which keeps what
    was worked out from it (:class:`_MountMemo`)."""
    last = _MEMO.table
    if last is not None and last[0] == text:
        return last[1]
    # A run's own mounts change a line or two of the table: the others' parse is kept
    # by their text (a line read again says what it said).
    known = _MEMO.lines or {}
    parsed = [(line, known.get(line) or _parse_line(line)) for line in text.splitlines()]
    mounts = tuple(mount for _, mount in parsed if mount is not None)
    _MEMO.lines = dict(parsed)
    _MEMO.table = (text, mounts)
    return mounts


def _refuse_system_identity(shown: str, root: Path, real: Path) -> None:
    """No directory from beneath ``root`` down to ``real`` may be a system tree itself
    (the same device and inode): a bind mount of one, whatever mountinfo says."""
    identities: dict[tuple[int, int], str] = {}
    for tree in ("/", *SYSTEM_TREES):
        try:
            st = os.stat(tree)
        except OSError:
            continue
        identities.setdefault((st.st_dev, st.st_ino), tree)
    for directory in (real, *real.parents):
        if directory == root or root not in directory.parents:
            break
        st = os.stat(directory)
        system = identities.get((st.st_dev, st.st_ino))
        if system is not None:
            raise NotLendable(
                f"{shown}: {directory} is the system tree {system} (a bind mount of it), "
                "which is never lent"
            )
