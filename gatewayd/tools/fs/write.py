"""``fs.write`` and ``fs.edit``: the file tools that change files.

A whole-file write goes to a fresh temporary file beside its target and is renamed over
it (:func:`replace_file`), so nothing at the name is ever written through; an append
checks the descriptor it opened. Both run to their end once started
(:func:`~gatewayd.tools.fs.threads.in_thread_to_completion`).
"""

from __future__ import annotations

import contextlib
import functools
import os
import secrets
import stat
from typing import Annotated, Any, Final

import msgspec

from gatewayd.errors import InvalidArguments, PolicyViolation, ToolFailed
from gatewayd.files import fsync_dir_fd, write_all
from gatewayd.hostpaths.beneath import (
    BeneathRoot,
    describe_mode,
    hard_link_refusal,
    hard_linked,
    require_single_link_regular,
    translate_oserror,
)
from gatewayd.policy.capabilities import CapabilityRequest
from gatewayd.policy.paths import PathAccess, ResolvedPath, shown
from gatewayd.tools.builtin import builtin_tool
from gatewayd.tools.fs.bounds import (
    READ_OPEN_FLAGS,
    TOOL_MAX_READ_FILE_BYTES,
    WRITES_FILES,
    PathArg,
    check_size,
    read_up_to,
    size_limit,
    too_large,
)
from gatewayd.tools.fs.threads import in_thread_to_completion
from gatewayd.tools.registry import Tool, ToolContext

# Appends grow files without bound otherwise; a file fs.read could not read back
# is of no use to the agent, so writes share the read limit.
TOOL_MAX_WRITE_FILE_BYTES: Final = TOOL_MAX_READ_FILE_BYTES
# fs.edit holds the file, and the edited copy, in memory.
TOOL_MAX_EDIT_FILE_BYTES: Final = 16 << 20
# fs.write content arrives in one request frame (1 MiB), so it can never be longer.
MAX_WRITE_CONTENT_CHARS: Final = 1 << 20
# Mode of files fs.write creates (the daemon's umask still applies); a replaced
# file keeps its own permission bits.
NEW_FILE_MODE: Final = 0o644
# Temporary files live next to their target so the final rename is atomic; the
# random part makes the name unguessable, O_EXCL makes a planted one harmless.
TEMP_PREFIX: Final = ".cogni-tmp-"
TEMP_NAME_ATTEMPTS: Final = 8


class WriteArgs(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """Write a text file (replacing it whole, or appending); missing parent directories are made."""

    path: PathArg
    content: Annotated[
        str,
        msgspec.Meta(max_length=MAX_WRITE_CONTENT_CHARS, description="The text to write (UTF-8)."),
    ]
    append: Annotated[
        bool,
        msgspec.Meta(description="Add to the end of the file instead of replacing it."),
    ] = False


class EditArgs(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """Replace the one occurrence of ``old`` in a text file with ``new``."""

    path: PathArg
    old: Annotated[
        str,
        msgspec.Meta(
            min_length=1,
            max_length=MAX_WRITE_CONTENT_CHARS,
            description=(
                "Exact text to replace (whitespace included); must occur exactly once, "
                "so include enough surrounding lines."
            ),
        ),
    ]
    new: Annotated[
        str,
        msgspec.Meta(max_length=MAX_WRITE_CONTENT_CHARS, description="Replacement text."),
    ]


def write_request(args: WriteArgs) -> CapabilityRequest:
    # An append's final size depends on the file; the runner checks it.
    size = None if args.append else len(args.content.encode("utf-8", "surrogatepass"))
    return CapabilityRequest(paths=(PathAccess(path=args.path, access="write", size=size),))


def edit_request(args: EditArgs) -> CapabilityRequest:
    # Both: an edit reads the file and writes it back (the new size is known only then).
    return CapabilityRequest(
        paths=(
            PathAccess(path=args.path, access="read"),
            PathAccess(path=args.path, access="write"),
        )
    )


def _encode_text(text: str, what: str) -> bytes:
    try:
        return text.encode("utf-8")
    except UnicodeEncodeError:
        raise InvalidArguments(
            f"{what} contains an unpaired surrogate and is not valid UTF-8; send UTF-8 text"
        ) from None


def _lstat_at(parent_fd: int, name: str, visible: str) -> os.stat_result | None:
    try:
        return os.stat(name, dir_fd=parent_fd, follow_symlinks=False)
    except FileNotFoundError:
        return None
    except OSError as exc:
        raise translate_oserror(exc, visible) from None


def _give_owner(fd: int, like: os.stat_result | None) -> None:
    """Make the file ``fd`` owned like ``like`` (its directory, or the file it replaces).

    In a workspace lent to a run's uid, a file the host tools make is then the run's
    like the rest (a command of the run can append to it, and the lease gives it back
    with the tree), not gatewayd's.
    """
    if like is not None and (like.st_uid, like.st_gid) != (os.geteuid(), os.getegid()):
        os.fchown(fd, like.st_uid, like.st_gid)


def _create_temp(parent_fd: int, visible: str) -> tuple[int, str]:
    for _ in range(TEMP_NAME_ATTEMPTS):
        name = f"{TEMP_PREFIX}{secrets.token_hex(16)}"
        try:
            fd = os.open(
                name,
                os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC,
                NEW_FILE_MODE,
                dir_fd=parent_fd,
            )
        except FileExistsError:
            continue
        except OSError as exc:
            raise translate_oserror(exc, visible) from None
        return fd, name
    raise ToolFailed(f"'{shown(visible)}': could not create a temporary file next to it")


def replaceable(
    parent_fd: int, name: str, visible: str
) -> tuple[os.stat_result | None, int | None]:
    """What is at ``name`` in ``parent_fd`` now (``lstat``; None: nothing), and the
    permission bits a file replacing it keeps (None: a new file's). Refused: a
    directory (:class:`ToolFailed`), a hard-linked file, a FIFO, socket or device
    (:class:`PolicyViolation`). A symlink is replaced, never written through. fs.write
    and fs.edit check this before they write; ``sandbox.query`` asks it for ``can_write``.
    """
    existing = _lstat_at(parent_fd, name, visible)
    mode: int | None = None
    if existing is not None:
        kind = existing.st_mode
        if stat.S_ISDIR(kind):
            raise ToolFailed(f"'{shown(visible)}' is a directory; name a file to write")
        if stat.S_ISREG(kind):
            if hard_linked(existing):
                raise hard_link_refusal(visible, "delete it and write anew")
            mode = stat.S_IMODE(kind) & 0o777  # never carry set-id bits over
        elif not stat.S_ISLNK(kind):
            raise PolicyViolation(
                f"'{shown(visible)}' is a {describe_mode(kind)}, not a regular file; "
                "only regular files can be read or written"
            )
    return existing, mode


def replace_file(
    parent_fd: int,
    name: str,
    data: bytes,
    visible: str,
    *,
    expected: tuple[int, int] | None = None,
) -> bool:
    """Atomically make ``name`` in ``parent_fd`` a regular file holding ``data``.

    The data goes to a fresh temporary file in the same directory (``O_EXCL``,
    unguessable name), is fsynced, and is renamed over the name. Whatever sits at
    the name at that moment — a symlink swapped in, a hard link — is replaced, never
    written through. Before that, what is there is checked: a directory, a special
    file or a hard-linked file is refused; a replaced file keeps its permission bits.
    ``expected`` (device, inode) refuses the write if the file changed since it was
    read (fs.edit). Returns whether the file was created.
    """
    existing, mode = replaceable(parent_fd, name, visible)
    if expected is not None and (
        existing is None or (existing.st_dev, existing.st_ino) != expected
    ):
        raise ToolFailed(f"'{shown(visible)}' changed while it was being edited; try again")
    fd, temp = _create_temp(parent_fd, visible)
    try:
        try:
            # A replaced file keeps its owner; a new one takes its directory's.
            _give_owner(fd, existing if mode is not None else os.fstat(parent_fd))
            if mode is not None:
                os.fchmod(fd, mode)
            write_all(fd, data)
            os.fsync(fd)
        finally:
            os.close(fd)
        os.rename(temp, name, src_dir_fd=parent_fd, dst_dir_fd=parent_fd)
    except BaseException as exc:
        with contextlib.suppress(OSError):
            os.unlink(temp, dir_fd=parent_fd)
        if isinstance(exc, OSError):
            raise translate_oserror(exc, visible) from None
        raise
    # Best effort: the rename is done, and some file systems refuse a directory fsync.
    with contextlib.suppress(OSError):
        fsync_dir_fd(parent_fd)
    return existing is None


def _append(root: BeneathRoot, parent_fd: int, name: str, data: bytes) -> bool:
    """Append ``data``; every check is on the opened descriptor. Returns whether created."""
    target = root.target
    flags = os.O_WRONLY | os.O_APPEND | os.O_NONBLOCK | os.O_NOCTTY
    try:
        # O_EXCL never follows a symlink, and tells us whether we made the file.
        fd = os.open(
            name,
            flags | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC,
            NEW_FILE_MODE,
            dir_fd=parent_fd,
        )
        created = True
        try:
            _give_owner(fd, os.fstat(parent_fd))
        except OSError as exc:
            os.close(fd)
            raise translate_oserror(exc, target.visible) from None
    except FileExistsError:
        fd = root.open_name(parent_fd, name, flags)
        created = False
    except OSError as exc:
        raise translate_oserror(exc, target.visible) from None
    try:
        st = require_single_link_regular(fd, target.visible)
        check_size(target, st.st_size + len(data), TOOL_MAX_WRITE_FILE_BYTES)
        write_all(fd, data)
        os.fsync(fd)
    except OSError as exc:
        raise translate_oserror(exc, target.visible) from None
    finally:
        os.close(fd)
    return created


def write_file(args: WriteArgs, target: ResolvedPath) -> dict[str, Any]:
    """fs.write, blocking."""
    data = _encode_text(args.content, "content")
    # Before anything is created (an append leaves at least this much).
    check_size(target, len(data), TOOL_MAX_WRITE_FILE_BYTES)
    with BeneathRoot(target) as root:
        parent_fd, name = root.open_parent(create=True)
        try:
            if args.append:
                created = _append(root, parent_fd, name, data)
            else:
                created = replace_file(parent_fd, name, data, target.visible)
        finally:
            os.close(parent_fd)
    return {"path": target.visible, "bytes": len(data), "created": created}


def _count_matches(text: str, old: str) -> int:
    """How often ``old`` occurs, overlaps included as far as telling 1 from 2+ needs."""
    count = text.count(old)
    if count == 1 and text.find(old, text.find(old) + 1) >= 0:
        return 2  # 'aa' in 'aaa': two overlapping matches, still ambiguous
    return count


def edit_file(
    args: EditArgs, read_target: ResolvedPath, write_target: ResolvedPath
) -> dict[str, Any]:
    """fs.edit, blocking. Neither step goes through a symlink (it is a write)."""
    visible = read_target.visible
    # Read under the write rules (no symlink anywhere): refuse before reading, not after.
    with BeneathRoot(read_target, follow_symlinks=False) as root:
        fd = root.open_file(READ_OPEN_FLAGS, follow_final=False)
    try:
        st = require_single_link_regular(fd, visible)
        check_size(read_target, st.st_size, TOOL_MAX_EDIT_FILE_BYTES)
        limit, who = size_limit(read_target.grant, TOOL_MAX_EDIT_FILE_BYTES)
        data = read_up_to(fd, limit)
        if data is None:
            raise too_large(visible, st.st_size, limit, who)
    except OSError as exc:
        raise translate_oserror(exc, visible) from None
    finally:
        os.close(fd)
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError:
        raise ToolFailed(
            f"'{shown(visible)}' is not UTF-8 text; fs.edit edits text files only"
        ) from None
    old = args.old
    matches = _count_matches(text, old)
    if matches == 0:
        raise InvalidArguments(
            f"'old' was not found in '{shown(visible)}'; it must match the file's text "
            "exactly, whitespace and line breaks included (fs.read shows the current text)"
        )
    if matches > 1:
        raise InvalidArguments(
            f"'old' matches {matches} times in '{shown(visible)}'; include more context "
            "so it matches exactly once"
        )
    new_data = _encode_text(text.replace(old, args.new, 1), "new")
    check_size(write_target, len(new_data), TOOL_MAX_EDIT_FILE_BYTES)
    with BeneathRoot(write_target) as root:
        parent_fd, name = root.open_parent()
        try:
            replace_file(
                parent_fd, name, new_data, write_target.visible, expected=(st.st_dev, st.st_ino)
            )
        finally:
            os.close(parent_fd)
    return {"path": write_target.visible, "replacements": 1, "bytes": len(new_data)}


async def run_write(args: WriteArgs, ctx: ToolContext) -> dict[str, Any]:
    return await in_thread_to_completion(functools.partial(write_file, args, ctx.resolved[0]))


async def run_edit(args: EditArgs, ctx: ToolContext) -> dict[str, Any]:
    read_target, write_target = ctx.resolved
    return await in_thread_to_completion(
        functools.partial(edit_file, args, read_target, write_target)
    )


FS_WRITE: Tool[WriteArgs] = builtin_tool(
    name="fs.write",
    summary="Write (replace) or append to a text file; missing parent directories are made.",
    args_type=WriteArgs,
    run=run_write,
    requests=write_request,
    capabilities=WRITES_FILES,
)
FS_EDIT: Tool[EditArgs] = builtin_tool(
    name="fs.edit",
    summary="Replace one exact, unique occurrence of a piece of text in a file.",
    args_type=EditArgs,
    run=run_edit,
    requests=edit_request,
    capabilities=WRITES_FILES,
)
