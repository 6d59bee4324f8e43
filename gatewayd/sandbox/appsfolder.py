"""The workspace's apps folder when a run's sandbox is made and when it ends.

No run sees the folder (:mod:`gatewayd.policy.appsfolder` says why); the plan covers it
with an empty read-only tmpfs (:mod:`gatewayd.sandbox.plan`). For that, when the sandbox
is made (:func:`prepare_apps_folder`):

* **Absent**: gatewayd makes it, empty, its workspace owner's, so the cover has a mount
  point. Without a cover the sandbox could make ``apps/`` itself and plant an app in it
  for the next discovery; with one it can neither make, remove nor rename it (a mount
  point). A record in the run's directory says so, and the folder is removed again when
  the run ends if it is still the empty directory made (:func:`remove_made_folder`; after
  a crash, the next start does it: :func:`remove_leftover_folder`). An empty apps folder
  holds no app, so one left behind is harmless. Made in a view that is a mount for the
  run alone (an overlay session's), the record is not flushed: the record reaches the
  folder only through that mount (its path and the mount's device), so it can serve
  only after a crash of gatewayd alone with the mount still there, when the page cache
  keeps it. A reboot takes the mount, not the folder: it stays in the session's upper
  directory on disk, and no record, flushed or not, reaches it there.
* **A symlink, or anything but a directory**: the run is refused. A symlink would make
  another directory the apps folder, and the cover would be mounted through it.
* **A directory**: every file in it with more than one link must have all its names
  inside it, or the run is refused (:class:`AppsFolderRefused`). A hard link is the file
  under another name, and a mount over ``apps/`` does not hide that name: a file of the
  folder linked into the workspace (``ln apps/x/data/notes.md ws/n``) is read through it
  by anyone its mode lets read it. Nothing on the inode says where its other names are,
  so the folder is walked and each inode's names in it counted: fewer than its link
  count means a name outside. The folder is walked, not the workspace: it is small
  (manifests, scripts, each app's data) where a workspace may hold millions of files,
  and a name anywhere outside (in the workspace, in an absolute policy path) counts.
  Nothing a run does makes such a link: the sandbox has no path to the folder's files
  (``link(2)`` needs one, and the cover hides them all), an app's sandbox sees the
  workspace read-only (and a link across mounts fails, ``EXDEV``), and no fs tool makes
  links; so the check at the start holds for the whole run. Only the host makes them.

Another workspace's apps folder recorded as holding apps (the run holds none: its
creation refused that) gets the same hard-link check when the run's sandbox is made
(:func:`refuse_linked_folders`): a file of it linked into the run's workspace would be
read through that name.

A folder that was there before the run is never lent (the caller fences its (device,
inode) out of the lease): its files keep their owner and mode, and the run's uid owns
nothing in it. One made for the run is empty, and is lent with the workspace like any
directory in it (the run still cannot reach it: the cover hides it).

Safe against a hostile folder: nothing is followed (every open is ``O_NOFOLLOW``,
relative to a descriptor of its parent), and the walk's depth is bounded.
"""

from __future__ import annotations

import errno
import json
import os
import stat
from collections.abc import Collection, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Final

from gatewayd.errors import GatewayError
from gatewayd.files import write_all, write_atomically
from gatewayd.policy.appsfolder import APPS_DIR_NAME
from gatewayd.protocol import ErrorCode

# In the run's directory: the apps folder gatewayd made for the run, to remove at its end.
MADE_RECORD: Final = "apps-folder.json"
# The folder gatewayd makes: what fs.write gives the directories it makes.
MADE_FOLDER_MODE: Final = 0o755
# The walk holds one descriptor per level it is in. Manifests, scripts and app data are
# a few levels deep (a node_modules tree a few dozen); deeper than this, the folder is
# refused rather than walked part-way: a name outside in the unwalked part would go
# unseen.
APPS_WALK_MAX_DEPTH: Final = 128

_DIR_FLAGS: Final = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC

Identity = tuple[int, int]  # (st_dev, st_ino)


class AppsFolderRefused(GatewayError):
    """The workspace's apps folder cannot be hidden from the run's sandbox as it is (the
    run's request, its workspace, is at fault); nothing was made."""

    code = ErrorCode.BAD_REQUEST


@dataclass(frozen=True, slots=True, kw_only=True)
class MadeFolder:
    """The apps folder gatewayd made for a run: its path and (device, inode)."""

    path: str
    device: int
    inode: int

    @property
    def identity(self) -> Identity:
        return (self.device, self.inode)

    def to_json(self) -> str:
        return json.dumps({"path": self.path, "device": self.device, "inode": self.inode})

    @classmethod
    def from_json(cls, text: str) -> MadeFolder:
        raw = json.loads(text)
        return cls(path=str(raw["path"]), device=int(raw["device"]), inode=int(raw["inode"]))


@dataclass(frozen=True, slots=True, kw_only=True)
class AppsFolder:
    """The apps folder a run's sandbox covers: its (device, inode), and whether gatewayd
    made it for the run (then it is removed at the run's end)."""

    identity: Identity
    made: MadeFolder | None


def prepare_apps_folder(
    workspace_fd: int, workspace: Path, run_dir: Path, *, durable_record: bool = True
) -> AppsFolder:
    """Make sure ``workspace``'s apps folder is a directory the sandbox may be given a
    cover over (see the module doc). ``workspace_fd``: the workspace directory the
    sandbox binds (an ``O_PATH`` descriptor is enough). ``durable_record`` False: the
    workspace is a mount made for the run alone, which no reboot leaves mounted; the
    record of a folder made in it is then renamed into place but not flushed (a power
    cut may leave it empty or cut short: unreadable, passed over). Blocking.

    Error handling: :class:`AppsFolderRefused` for a folder that is not a directory, is
    nested too deep, or holds a file with a name outside it; OSError when the host
    refuses to make or read it.
    """
    shown = workspace / APPS_DIR_NAME
    try:
        st = os.stat(APPS_DIR_NAME, dir_fd=workspace_fd, follow_symlinks=False)
    except FileNotFoundError:
        made = _make_folder(workspace_fd, shown, run_dir, durable_record=durable_record)
        return AppsFolder(identity=made.identity, made=made)
    if not stat.S_ISDIR(st.st_mode):
        kind = "a symlink" if stat.S_ISLNK(st.st_mode) else "not a directory"
        raise AppsFolderRefused(
            f"the workspace's apps folder {shown} is {kind}; it must be a directory (or "
            "absent), since no run may see it and the sandbox hides a directory there: "
            "move it away, then start the run again"
        )
    fd = os.open(APPS_DIR_NAME, _DIR_FLAGS, dir_fd=workspace_fd)
    try:
        opened = os.fstat(fd)
        if (opened.st_dev, opened.st_ino) != (st.st_dev, st.st_ino):
            raise AppsFolderRefused(
                f"the workspace's apps folder {shown} was replaced while it was checked; "
                "start the run again"
            )
        linked = _outside_link(fd, shown)
    finally:
        os.close(fd)
    if linked is not None:
        rel, links, inside = linked
        raise AppsFolderRefused(
            f"the workspace's apps folder holds {rel}, a file with {links} names of which "
            f"{inside} lie in the folder: another name of it (in the workspace or a policy "
            "path) would show an app's file to the run, which no cover over the folder "
            "hides. Remove the other names (or make them copies), then start the run again"
        )
    return AppsFolder(identity=(st.st_dev, st.st_ino), made=None)


def refuse_linked_folders(folders: Sequence[Path], devices: Collection[int]) -> None:
    """Refuse the run when a file of another workspace's apps folder (``folders``: real
    paths, from gatewayd's record) has a name outside that folder; only folders on a
    device in ``devices`` (those of the run's bind sources) are walked, since a hard
    link never crosses file systems. The check :func:`prepare_apps_folder` makes of the
    run's own folder: a run holds no other workspace's folder (the run's creation refused
    that), but a file of one linked into the run's workspace or a policy path would be
    read through that name, which no refusal by path sees. A folder that is absent or no
    directory is skipped: no file of it to link. Blocking.

    Error handling: :class:`AppsFolderRefused` naming the file and the fix.
    """
    for folder in folders:
        try:
            # Followed as recorded: the directory an install into that workspace fills.
            fd = os.open(folder, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        except OSError:
            continue
        try:
            if os.fstat(fd).st_dev not in devices:
                continue
            linked = _outside_link(fd, folder)
        finally:
            os.close(fd)
        if linked is not None:
            rel, links, inside = linked
            raise AppsFolderRefused(
                f"the apps folder {folder} of another workspace holds {rel}, a file with "
                f"{links} names of which {inside} lie in the folder: another name of it on "
                "the file system the run's workspace or policy paths lie on could show that "
                "app's file to the run, which no check by path sees. Remove the other names "
                "(or make them copies), then start the run again"
            )


def _make_folder(
    workspace_fd: int, path: Path, run_dir: Path, *, durable_record: bool
) -> MadeFolder:
    os.mkdir(APPS_DIR_NAME, MADE_FOLDER_MODE, dir_fd=workspace_fd)
    st = os.stat(APPS_DIR_NAME, dir_fd=workspace_fd, follow_symlinks=False)
    made = MadeFolder(path=str(path), device=st.st_dev, inode=st.st_ino)
    try:
        owner = os.fstat(workspace_fd)
        if (owner.st_uid, owner.st_gid) != (st.st_uid, st.st_gid):
            # The workspace owner's, like everything else in it (then lent with it).
            os.chown(
                APPS_DIR_NAME,
                owner.st_uid,
                owner.st_gid,
                dir_fd=workspace_fd,
                follow_symlinks=False,
            )
        _write_record(run_dir / MADE_RECORD, made.to_json().encode(), durable=durable_record)
    except BaseException:
        remove_made_folder(workspace_fd, made)
        raise
    return made


def _write_record(path: Path, data: bytes, *, durable: bool) -> None:
    """The made folder's record: durable (:func:`write_atomically`), or a temporary file
    renamed into place with no fsync: whole after a crash of gatewayd alone (the page
    cache keeps it), maybe empty or cut short after a power cut (its name may be made
    durable by another file's flush before its bytes reach the disk), which
    :func:`remove_leftover_folder` passes over as unreadable."""
    if durable:
        write_atomically(path, data)
        return
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    try:
        write_all(fd, data)
    finally:
        os.close(fd)
    os.replace(tmp, path)


def _outside_link(folder_fd: int, shown: Path) -> tuple[str, int, int] | None:
    """The first file in the folder with a name outside it: (its path as shown, its
    link count, its names inside), or None. Depth-first, one descriptor per level."""
    names: dict[Identity, int] = {}
    first: dict[Identity, tuple[str, int]] = {}
    # One frame per directory on the current path: its descriptor, its path as shown,
    # and the names still to visit.
    frames = [(os.open(".", _DIR_FLAGS, dir_fd=folder_fd), str(shown), os.listdir(folder_fd))]
    try:
        while frames:
            fd, path, todo = frames[-1]
            if not todo:
                os.close(fd)
                frames.pop()
                continue
            name = todo.pop()
            try:
                st = os.stat(name, dir_fd=fd, follow_symlinks=False)
            except FileNotFoundError:
                continue
            if stat.S_ISDIR(st.st_mode):
                if len(frames) >= APPS_WALK_MAX_DEPTH:
                    raise AppsFolderRefused(
                        f"the workspace's apps folder {shown} is nested deeper than "
                        f"{APPS_WALK_MAX_DEPTH} directories ({path}/{name}); gatewayd checks "
                        "every file in it for hard links before a run and walks no deeper: "
                        "flatten it, then start the run again"
                    )
                child = os.open(name, _DIR_FLAGS, dir_fd=fd)
                frames.append((child, f"{path}/{name}", os.listdir(child)))
            elif st.st_nlink > 1:
                identity = (st.st_dev, st.st_ino)
                names[identity] = names.get(identity, 0) + 1
                first.setdefault(identity, (f"{path}/{name}", st.st_nlink))
    finally:
        for fd, _, _ in frames:
            os.close(fd)
    for identity, (path, links) in sorted(first.items(), key=lambda item: item[1][0]):
        if names[identity] < links:
            return path, links, names[identity]
    return None


def remove_made_folder(workspace_fd: int, made: MadeFolder) -> bool:
    """Remove the apps folder gatewayd made, if it is still that directory (its device
    and inode) and empty (an app installed meanwhile stays); returns whether it was
    removed. A directory made anew there may reuse the inode and go too, which is as
    harmless as one left behind: an empty apps folder holds no app. Blocking."""
    try:
        st = os.stat(APPS_DIR_NAME, dir_fd=workspace_fd, follow_symlinks=False)
        if (st.st_dev, st.st_ino) != made.identity or not stat.S_ISDIR(st.st_mode):
            return False
        os.rmdir(APPS_DIR_NAME, dir_fd=workspace_fd)
    except OSError as exc:
        if exc.errno not in (errno.ENOENT, errno.ENOTEMPTY, errno.EEXIST):
            raise
        return False
    return True


def remove_leftover_folder(run_dir: Path) -> bool:
    """After a crash: remove the apps folder a run's record in ``run_dir`` says gatewayd
    made, as :func:`remove_made_folder` would have; whether it was removed. Blocking."""
    try:
        made = MadeFolder.from_json((run_dir / MADE_RECORD).read_text())
    except FileNotFoundError:
        return False
    except (OSError, ValueError, KeyError, TypeError):
        return False  # an unreadable record: the empty folder it named is harmless
    try:
        workspace_fd = os.open(
            os.path.dirname(made.path), os.O_PATH | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
        )
    except OSError:
        return False
    try:
        return remove_made_folder(workspace_fd, made)
    finally:
        os.close(workspace_fd)
