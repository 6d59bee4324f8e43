"""Comparing two directory trees into a :class:`WorkspaceDiff`.

Rules (also in docs/workspaces.md):

* Entries are compared without following symlinks. A regular file is compared by
  content; a symlink by its target (a symlink counts as a file whose content is the
  target). Mode and time changes are not reported.
* Binary: a NUL byte in the first :data:`BINARY_SNIFF_BYTES`, or not valid UTF-8.
  Binary files, and text files over :data:`MAX_HUNK_FILE_BYTES`, are listed in
  ``binary`` and get no hunk.
* Bounded: files are hashed in chunks, and ``unified`` stops at
  :data:`MAX_UNIFIED_CHARS` (the sandbox decides how much it writes, not gatewayd's
  memory).
* Rename: a removed and an added entry of the same kind with identical content
  (sha256) are paired, in sorted order, one to one; the pair has no hunk.
* Directories present on one side only are listed with a trailing ``/``.
* A symlink added, changed or renamed whose target leads out of the tree (absolute,
  climbing above it: :func:`~gatewayd.workspace.commit_rules.link_leads_out`) is named
  in ``links_out`` with its target, besides its usual place.

The caller says which subtrees to look at (``scopes``): the whole tree for the host
backend, only what the overlay's upper directory touches for the overlay backend.
"""

from __future__ import annotations

import codecs
import difflib
import errno
import hashlib
import os
import stat
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Final, Literal

from gatewayd.workspace.commit_rules import link_leads_out
from gatewayd.workspace.session import DIR_FLAGS, WorkspaceDiff, open_dirs, read_all

# Like git: a NUL byte in the first 8 KiB marks a file as binary.
BINARY_SNIFF_BYTES: Final = 8192
NO_NEWLINE: Final = "\\ No newline at end of file\n"
# Files are hashed in chunks of this size: memory per file, whatever its size.
READ_CHUNK_BYTES: Final = 1 << 20
# A text file larger than this gets no hunk (it is listed in ``binary``): difflib needs
# both sides in memory, several times over.
MAX_HUNK_FILE_BYTES: Final = 4 << 20
# ``unified`` stops growing here; further text files are named in a last line.
MAX_UNIFIED_CHARS: Final = 16 << 20

Kind = Literal["file", "link", "dir"]


def _kind_of(mode: int) -> Kind | None:
    if stat.S_ISDIR(mode):
        return "dir"
    if stat.S_ISLNK(mode):
        return "link"
    if stat.S_ISREG(mode):
        return "file"
    return None  # FIFOs, sockets, devices: not workspace content


def open_parent(root: Path, rel: str) -> tuple[int, str]:
    """A descriptor of ``rel``'s parent beneath ``root``, every component opened with
    O_NOFOLLOW, and ``rel``'s last name. Raises OSError (ELOOP, ENOTDIR) when a component
    is a symlink: the sandbox may still be changing the tree, and gatewayd, which runs as
    root, must never read through a link it planted (``dir -> /etc``)."""
    *dirs, name = rel.split("/")
    return open_dirs(root, dirs), name


def entry_kind(root: Path, rel: str) -> Kind | None:
    """The kind of ``root/rel`` (no symlink followed), None when absent or special."""
    if not rel:
        return _kind_of(os.lstat(root).st_mode)
    try:
        parent, name = open_parent(root, rel)
    except (FileNotFoundError, NotADirectoryError):
        return None
    try:
        return _kind_of(os.stat(name, dir_fd=parent, follow_symlinks=False).st_mode)
    except (FileNotFoundError, NotADirectoryError):
        return None
    finally:
        os.close(parent)


def walk_entries(root: Path, scope: str) -> dict[str, Kind]:
    """Every entry at and below ``root/scope`` (relative names), without following links.

    Descriptor-based (``os.fwalk``), so a directory swapped for a symlink while we walk
    is not entered.
    """
    found: dict[str, Kind] = {}
    kind = entry_kind(root, scope)
    if kind is None:
        return found
    if scope:
        found[scope] = kind
    if kind != "dir":
        return found
    if scope:
        parent, name = open_parent(root, scope)
        try:
            top = os.open(name, DIR_FLAGS, dir_fd=parent)
        finally:
            os.close(parent)
    else:
        top = os.open(root, DIR_FLAGS)
    try:
        for rel, st in walk_below(top, scope):
            child = _kind_of(st.st_mode)
            if child is not None:
                found[rel] = child
    finally:
        os.close(top)
    return found


def walk_below(top: int, scope: str) -> Iterator[tuple[str, os.stat_result]]:
    """Each entry below the directory open at ``top`` (``scope``: its relative name, ""
    for the root) with its ``lstat``, named relative to the root; links are not followed
    and an entry that vanishes while we walk is left out. ``top`` stays the caller's."""
    for dirpath, dirnames, filenames, dir_fd in os.fwalk(".", dir_fd=top, follow_symlinks=False):
        rel_dir = os.path.normpath(os.path.join(scope, dirpath)) if scope else dirpath
        rel_dir = os.path.normpath(rel_dir)
        for name in dirnames + filenames:
            rel = name if rel_dir == "." else f"{rel_dir}/{name}"
            try:
                st = os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
            except FileNotFoundError:
                continue
            yield rel, st


def content(root: Path, rel: str, kind: Kind) -> bytes:
    """The bytes a file holds, or a symlink's target; no symlink on the way is followed."""
    if kind == "link":
        parent, name = open_parent(root, rel)
        try:
            return os.fsencode(os.readlink(name, dir_fd=parent))
        finally:
            os.close(parent)
    fd = _open_regular(root, rel)
    try:
        return read_all(fd)
    finally:
        os.close(fd)


def _open_regular(root: Path, rel: str) -> int:
    """A read descriptor of the regular file ``root/rel``, no symlink followed anywhere;
    OSError EINVAL when it is no longer a regular file (the caller closes it)."""
    parent, name = open_parent(root, rel)
    try:
        fd = os.open(
            name, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, dir_fd=parent
        )
    finally:
        os.close(parent)
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise OSError(errno.EINVAL, f"{rel} is no longer a regular file")
    return fd


def is_binary(data: bytes) -> bool:
    """NUL in the first 8 KiB, or not UTF-8."""
    if b"\0" in data[:BINARY_SNIFF_BYTES]:
        return True
    try:
        data.decode("utf-8")
    except UnicodeDecodeError:
        return True
    return False


def unified_hunks(old: bytes | None, new: bytes | None, rel_old: str, rel_new: str) -> str:
    """``diff -u`` text for one text file (``None``: the side does not exist)."""
    old_lines = (old or b"").decode("utf-8").splitlines(keepends=True)
    new_lines = (new or b"").decode("utf-8").splitlines(keepends=True)
    lines = difflib.unified_diff(
        old_lines,
        new_lines,
        fromfile="/dev/null" if old is None else f"a/{rel_old}",
        tofile="/dev/null" if new is None else f"b/{rel_new}",
    )
    out = []
    for line in lines:
        out.append(line)
        if not line.endswith("\n"):
            out.append("\n" + NO_NEWLINE)
    return "".join(out)


@dataclass(frozen=True, slots=True)
class _Print:
    """What the diff needs of one file or link, read once in chunks (constant memory)."""

    kind: Kind
    size: int
    digest: bytes
    text: bool  # no NUL in the first 8 KiB and valid UTF-8


def fingerprint(root: Path, rel: str, kind: Kind) -> _Print:
    """sha256, size and text-ness of ``root/rel``, read in chunks: a sandbox's 10 GiB
    file costs gatewayd one chunk of memory, not 10 GiB."""
    if kind == "link":
        data = content(root, rel, kind)
        return _Print(kind, len(data), hashlib.sha256(data).digest(), not is_binary(data))
    fd = _open_regular(root, rel)
    try:
        sha = hashlib.sha256()
        decoder = codecs.getincrementaldecoder("utf-8")()
        text, size = True, 0
        while chunk := os.read(fd, READ_CHUNK_BYTES):
            if size < BINARY_SNIFF_BYTES and b"\0" in chunk[: BINARY_SNIFF_BYTES - size]:
                text = False
            if text:
                try:
                    decoder.decode(chunk)
                except UnicodeDecodeError:
                    text = False
            sha.update(chunk)
            size += len(chunk)
        if text:
            try:
                decoder.decode(b"", final=True)
            except UnicodeDecodeError:
                text = False
        return _Print(kind, size, sha.digest(), text)
    finally:
        os.close(fd)


def compare_trees(old_root: Path, new_root: Path, scopes: Iterable[str]) -> WorkspaceDiff:
    """The diff from ``old_root`` to ``new_root``, looking only beneath ``scopes``.

    Memory stays bounded whatever the trees hold: files are compared by sha256 read in
    chunks; a text file gets a hunk only up to :data:`MAX_HUNK_FILE_BYTES` (a larger one
    is listed in ``binary``, without a hunk), and hunks stop once ``unified`` reaches
    :data:`MAX_UNIFIED_CHARS` (a last line says which files were left out).
    """
    old: dict[str, Kind] = {}
    new: dict[str, Kind] = {}
    for scope in scopes:
        old.update(walk_entries(old_root, scope))
        new.update(walk_entries(new_root, scope))

    added: list[str] = []
    removed: list[str] = []
    modified: list[str] = []
    old_prints: dict[str, _Print] = {}
    new_prints: dict[str, _Print] = {}
    for rel in sorted(set(old) | set(new)):
        before, after = old.get(rel), new.get(rel)
        if before == "dir" and after == "dir":
            continue
        if before is not None and before == after:
            a, b = fingerprint(old_root, rel, before), fingerprint(new_root, rel, after)
            if a.digest != b.digest:
                modified.append(rel)
                old_prints[rel], new_prints[rel] = a, b
            continue
        # Kinds differ or one side is missing: a removal and/or an addition.
        if before == "dir":
            removed.append(rel + "/")
        elif before is not None:
            removed.append(rel)
            old_prints[rel] = fingerprint(old_root, rel, before)
        if after == "dir":
            added.append(rel + "/")
        elif after is not None:
            added.append(rel)
            new_prints[rel] = fingerprint(new_root, rel, after)

    renamed = _pair_renames(added, removed, old_prints, new_prints)
    links_out: list[tuple[str, str]] = []
    for rel in sorted({*added, *modified, *(after for _before, after in renamed)}):
        if new.get(rel) == "link":
            target = os.fsdecode(content(new_root, rel, "link"))
            if link_leads_out(rel, target) is not None:
                links_out.append((rel, target))

    binary: list[str] = []
    hunks: list[str] = []
    left_out: list[str] = []
    budget = MAX_UNIFIED_CHARS
    for rel in sorted(set(added) | set(removed) | set(modified)):
        if rel.endswith("/"):
            continue
        sides = [p for p in (old_prints.get(rel), new_prints.get(rel)) if p is not None]
        if not all(p.text and p.size <= MAX_HUNK_FILE_BYTES for p in sides):
            binary.append(rel)
            continue
        if budget <= 0:
            left_out.append(rel)
            continue
        before_data = content(old_root, rel, old[rel]) if rel in old_prints else None
        after_data = content(new_root, rel, new[rel]) if rel in new_prints else None
        hunk = unified_hunks(before_data, after_data, rel, rel)
        hunks.append(hunk)
        budget -= len(hunk)
    if left_out:
        hunks.append(
            f"# {len(left_out)} more changed text file(s) without hunks: the diff reached "
            f"{MAX_UNIFIED_CHARS} characters ({', '.join(left_out[:20])})\n"
        )
    return WorkspaceDiff(
        unified="".join(hunks),
        added=added,
        removed=removed,
        modified=modified,
        renamed=renamed,
        binary=binary,
        links_out=links_out,
    )


def _pair_renames(
    added: list[str],
    removed: list[str],
    old_prints: dict[str, _Print],
    new_prints: dict[str, _Print],
) -> list[tuple[str, str]]:
    """Pair removed and added entries of one kind with identical sha256, in sorted order."""
    by_digest: dict[tuple[Kind, bytes], list[str]] = {}
    for rel in removed:
        if rel.endswith("/"):
            continue
        key = (old_prints[rel].kind, old_prints[rel].digest)
        by_digest.setdefault(key, []).append(rel)
    renamed: list[tuple[str, str]] = []
    for rel in list(added):
        if rel.endswith("/"):
            continue
        key = (new_prints[rel].kind, new_prints[rel].digest)
        candidates = by_digest.get(key)
        if candidates:
            source = candidates.pop(0)
            renamed.append((source, rel))
            added.remove(rel)
            removed.remove(source)
    return renamed
