"""``fs.list`` and ``fs.stat``: the file tools that describe directory entries.

Both tell the same facts of an entry (:class:`EntryFacts`), and only those of an inode
that is the grant's own; neither follows a symlink below the path it was given. Neither
shows the workspace's apps folder (:mod:`gatewayd.policy.appsfolder`): the policy refuses
it as a path, and ``fs.list`` leaves it out of every listing and never enters it, so not
even the names of the apps reach a run.
"""

from __future__ import annotations

import fnmatch
import os
import stat
import threading
from dataclasses import dataclass, field
from pathlib import PurePosixPath
from typing import Annotated, Any, Final

import msgspec

from gatewayd.errors import InvalidArguments, ToolFailed
from gatewayd.hostpaths.beneath import (
    HARD_LINK_REASON,
    BeneathRoot,
    hard_linked,
    open_child_dir,
    translate_oserror,
)
from gatewayd.policy.appsfolder import in_apps_folder
from gatewayd.policy.capabilities import CapabilityRequest
from gatewayd.policy.paths import MAX_PATH_BYTES, PathAccess, ResolvedPath, shown
from gatewayd.tools.builtin import builtin_tool
from gatewayd.tools.clock import iso_utc
from gatewayd.tools.fs.bounds import READS_FILES, PathArg
from gatewayd.tools.fs.threads import check_stop, in_thread_abandoned_on_cancel
from gatewayd.tools.registry import Tool, ToolContext

DEFAULT_LIST_LIMIT: Final = 1000
MAX_LIST_LIMIT: Final = 10_000
# Directory entries one fs.list may look at, matching or not: a "**" over a huge
# tree (node_modules, .git) must end in bounded time, with truncated=true.
LIST_MAX_VISITED_ENTRIES: Final = 100_000
# Nesting fs.list descends into; each level holds one descriptor open.
LIST_MAX_DEPTH: Final = 32
MAX_PATTERN_CHARS: Final = 1024


class ListArgs(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """List a directory's entries matching a glob; symlinks are reported, never followed.

    A file with more than one hard link is listed without its size (``hardLinked``).
    """

    path: Annotated[
        str,
        msgspec.Meta(
            min_length=1,
            max_length=MAX_PATH_BYTES,  # characters here; the policy counts bytes
            description="Directory to list (default '.', i.e. /workspace).",
        ),
    ] = "."
    pattern: Annotated[
        str,
        msgspec.Meta(
            min_length=1,
            max_length=MAX_PATTERN_CHARS,
            description=(
                "Glob relative to path: '*' (default: the directory's own entries), "
                "'*.py', 'src/*.ts', '**/*.md' ('**' spans any number of directories)."
            ),
        ),
    ] = "*"
    limit: Annotated[
        int,
        msgspec.Meta(
            ge=1,
            le=MAX_LIST_LIMIT,
            description=f"Most entries to return (default {DEFAULT_LIST_LIMIT}).",
        ),
    ] = DEFAULT_LIST_LIMIT


class StatArgs(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """Describe one path (type, size, mtime, mode); a symlink is described, not followed.

    A file with more than one hard link is described by its type only (``hardLinked``).
    """

    path: PathArg


def list_request(args: ListArgs) -> CapabilityRequest:
    return CapabilityRequest(paths=(PathAccess(path=args.path, access="read", metadata_only=True),))


def stat_request(args: StatArgs) -> CapabilityRequest:
    # Metadata only: a suffix rule must not refuse a stat of a directory (or of a
    # grant's own root); it governs whose contents may be read.
    return CapabilityRequest(paths=(PathAccess(path=args.path, access="read", metadata_only=True),))


# --- fs.list -----------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Glob:
    """A ``/``-separated glob; ``**`` spans zero or more directories.

    Matching runs as a small automaton over path components: a state is the index
    of the next segment to match, so the walk knows, per directory, whether anything
    below it can still match (and skips it when not).
    """

    segments: tuple[str, ...]

    @classmethod
    def parse(cls, pattern: str) -> Glob:
        """Validate and split; refuses what could name something outside ``path``."""
        segments = tuple(pattern.split("/"))
        # '**/**' matches what '**' does; collapsing the run keeps the automaton's
        # state set (and the work per entry) small for a pattern of many '**'.
        segments = tuple(
            seg
            for index, seg in enumerate(segments)
            if not (seg == "**" and index > 0 and segments[index - 1] == "**")
        )
        if (
            "\0" in pattern
            or pattern.startswith("/")
            or any(seg in ("", ".", "..") for seg in segments)
        ):
            raise InvalidArguments(
                f"pattern {pattern[:MAX_PATTERN_CHARS]!r} is not allowed: use a glob relative "
                "to 'path' such as '*.py', 'src/*.ts' or '**/*.md' (no '..' or '.' segments, "
                "no leading '/', no empty segments, no NUL)"
            )
        return cls(segments)

    def _closure(self, states: set[int]) -> frozenset[int]:
        pending = list(states)
        while pending:
            state = pending.pop()
            if state < len(self.segments) and self.segments[state] == "**":
                following = state + 1
                if following not in states:
                    states.add(following)
                    pending.append(following)
        return frozenset(states)

    def start(self) -> frozenset[int]:
        return self._closure({0})

    def step(self, states: frozenset[int], name: str) -> frozenset[int]:
        following: set[int] = set()
        for state in states:
            if state >= len(self.segments):
                continue
            segment = self.segments[state]
            if segment == "**":
                following.add(state)
            elif fnmatch.fnmatchcase(name, segment):
                following.add(state + 1)
        return self._closure(following)

    def accepts(self, states: frozenset[int]) -> bool:
        return len(self.segments) in states

    def can_descend(self, states: frozenset[int]) -> bool:
        return any(state < len(self.segments) for state in states)


def _entry_type(mode: int) -> str:
    if stat.S_ISREG(mode):
        return "file"
    if stat.S_ISDIR(mode):
        return "dir"
    if stat.S_ISLNK(mode):
        return "symlink"
    return "other"


# fs.stat's word on an entry whose facts are withheld, saying why and what helps.
HARD_LINK_NOTE: Final = (
    f"one of several hard links to the same file: {HARD_LINK_REASON}, so its size, time "
    "and mode are not shown and fs.read and fs.write refuse it (a copy has a single link)"
)


@dataclass(frozen=True, slots=True, kw_only=True)
class EntryFacts:
    """What fs.stat and fs.list may tell about one directory entry.

    Only facts of an inode that is the grant's own. A hard-linked entry may be a name
    for a file outside the grants, so it gets its type and ``hard_linked`` and nothing
    else (not even its link count). A symlink's size is the length of where it points,
    which may spell a host path, and a FIFO, socket or device has no contents to
    measure: neither gets a size.
    """

    type: str
    size: int | None
    mtime: str | None
    mode: str | None
    hard_linked: bool


def entry_facts(st: os.stat_result) -> EntryFacts:
    """The facts of ``st``, the ``lstat`` (or the root's ``fstat``) of one entry."""
    kind = _entry_type(st.st_mode)
    if hard_linked(st):
        return EntryFacts(type=kind, size=None, mtime=None, mode=None, hard_linked=True)
    return EntryFacts(
        type=kind,
        size=st.st_size if kind in ("file", "dir") else None,
        mtime=iso_utc(st.st_mtime_ns),
        mode=f"{stat.S_IMODE(st.st_mode):04o}",
        hard_linked=False,
    )


@dataclass(slots=True)
class _Listing:
    glob: Glob
    base: PurePosixPath
    limit: int
    stop: threading.Event | None = None
    # The apps folder, left out: where it lies beneath the listed directory (components,
    # its name in any case), and its (device, inode) while it exists.
    apps_at: tuple[str, ...] | None = None
    apps_id: tuple[int, int] | None = None
    entries: list[dict[str, Any]] = field(default_factory=list)
    visited: int = 0
    truncated: bool = False

    def walk(self, dir_fd: int, rel: tuple[str, ...], states: frozenset[int]) -> bool:
        """List one directory, depth first; False once ``limit`` entries are found.

        Past the visit cap no directory yields names any more, so the walk winds
        down having opened at most one directory per name already seen.
        """
        names: list[str] = []
        with os.scandir(dir_fd) as scan:
            for entry in scan:
                if self.visited >= LIST_MAX_VISITED_ENTRIES:
                    self.truncated = True
                    break
                self.visited += 1
                names.append(entry.name)
        for name in sorted(names):
            check_stop(self.stop)
            try:
                st = os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
            except OSError:
                continue  # gone since it was listed
            if in_apps_folder((*rel, name), self.apps_at) or (
                (st.st_dev, st.st_ino) == self.apps_id and stat.S_ISDIR(st.st_mode)
            ):
                continue  # neither listed nor entered
            following = self.glob.step(states, name)
            kind = _entry_type(st.st_mode)
            if self.glob.accepts(following):
                if len(self.entries) >= self.limit:
                    self.truncated = True
                    return False
                facts = entry_facts(st)
                listed: dict[str, Any] = {
                    "path": str(self.base.joinpath(*rel, name)),
                    "type": kind,
                    "size": facts.size if kind == "file" else None,
                }
                if facts.hard_linked:
                    listed["hardLinked"] = True
                self.entries.append(listed)
            if kind != "dir" or not self.glob.can_descend(following):
                continue
            if len(rel) + 1 >= LIST_MAX_DEPTH:
                self.truncated = True
                continue
            child = open_child_dir(dir_fd, name)
            if child is None:
                continue  # no longer a directory
            try:
                if not self.walk(child, (*rel, name), following):
                    return False
            finally:
                os.close(child)
        return True


def open_listed(target: ResolvedPath) -> tuple[int, tuple[int, int] | None]:
    """An ``O_PATH`` descriptor of what fs.list lists at ``target`` (the caller closes
    it; a final symlink inside the root is followed), and the apps folder's (device,
    inode) beneath the root while it exists. ``sandbox.query`` asks it too."""
    with BeneathRoot(target) as root:
        return root.open_file(os.O_PATH, follow_final=True), root.apps_id


def list_dir(
    args: ListArgs, target: ResolvedPath, *, stop: threading.Event | None = None
) -> dict[str, Any]:
    """fs.list, blocking. The listed directory itself may be reached through a symlink
    inside the root (openat2); nothing below it is ever followed. ``stop`` set (the
    call was abandoned) ends the walk at the next entry."""
    glob = Glob.parse(args.pattern)
    path_fd, apps_id = open_listed(target)
    try:
        if not stat.S_ISDIR(os.fstat(path_fd).st_mode):
            raise ToolFailed(
                f"'{shown(target.visible)}' is not a directory; fs.list lists directories, "
                "fs.stat describes a single path"
            )
        # "." of an already-open directory: no lookup, nothing to follow.
        dir_fd = os.open(".", os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC, dir_fd=path_fd)
    except OSError as exc:
        raise translate_oserror(exc, target.visible) from None
    finally:
        os.close(path_fd)
    listing = _Listing(
        glob=glob,
        base=PurePosixPath(target.visible),
        limit=args.limit,
        stop=stop,
        apps_at=_apps_beneath(target),
        apps_id=apps_id,
    )
    try:
        listing.walk(dir_fd, (), glob.start())
    except OSError as exc:
        raise translate_oserror(exc, target.visible) from None
    finally:
        os.close(dir_fd)
    return {"path": target.visible, "entries": listing.entries, "truncated": listing.truncated}


def _apps_beneath(target: ResolvedPath) -> tuple[str, ...] | None:
    """Where the apps folder lies beneath the listed directory, as components; None when
    it does not (the policy refused a directory at or beneath it already)."""
    apps = target.grant.apps_parts
    depth = len(target.parts)
    if apps is None or depth >= len(apps) or tuple(apps[:depth]) != target.parts:
        return None
    return apps[depth:]


# --- fs.stat -----------------------------------------------------------------------


def stat_path(target: ResolvedPath) -> dict[str, Any]:
    """fs.stat, blocking: ``lstat`` of the last component in its safely opened parent."""
    with BeneathRoot(target) as root:
        if target.parts:
            parent_fd, name = root.open_parent()
            try:
                st = os.stat(name, dir_fd=parent_fd, follow_symlinks=False)
            except OSError as exc:
                raise translate_oserror(exc, target.visible) from None
            finally:
                os.close(parent_fd)
        else:
            root_fd = root.open_dir()
            try:
                st = os.fstat(root_fd)
            finally:
                os.close(root_fd)
    # Neither a symlink's target nor its length is reported (see EntryFacts).
    facts = entry_facts(st)
    result: dict[str, Any] = {
        "path": target.visible,
        "type": facts.type,
        "size": facts.size,
        "mtime": facts.mtime,
        "mode": facts.mode,
    }
    if facts.hard_linked:
        result["hardLinked"] = True
        result["note"] = HARD_LINK_NOTE
    return result


async def run_list(args: ListArgs, ctx: ToolContext) -> dict[str, Any]:
    Glob.parse(args.pattern)  # refuse a bad pattern before any I/O
    target = ctx.resolved[0]
    return await in_thread_abandoned_on_cancel(lambda stop: list_dir(args, target, stop=stop))


async def run_stat(_args: StatArgs, ctx: ToolContext) -> dict[str, Any]:
    target = ctx.resolved[0]
    return await in_thread_abandoned_on_cancel(lambda _stop: stat_path(target))


FS_LIST: Tool[ListArgs] = builtin_tool(
    name="fs.list",
    summary="List a directory's entries that match a glob ('*', '*.py', '**/*.md').",
    args_type=ListArgs,
    run=run_list,
    requests=list_request,
    capabilities=READS_FILES,
    side_effects=False,
)
FS_STAT: Tool[StatArgs] = builtin_tool(
    name="fs.stat",
    summary="Type, size, modification time and mode of one path (symlinks are not followed).",
    args_type=StatArgs,
    run=run_stat,
    requests=stat_request,
    capabilities=READS_FILES,
    side_effects=False,
)
