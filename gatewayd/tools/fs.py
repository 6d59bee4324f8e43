"""The host file tools: ``fs.read``, ``fs.write``, ``fs.edit``, ``fs.list``, ``fs.stat``.

Each tool is an argument Struct (its JSON Schema is what ``tools.list`` shows), a
pure request (``read_request(args)`` …) saying which visible paths it touches and how,
within the files its manifest declares (every path the run's grants allow: read for
``fs.read``, ``fs.list`` and ``fs.stat``, read and write for ``fs.write`` and
``fs.edit``), and an async runner
that does the blocking I/O in a worker thread (the daemon serves every run on one
trio loop). Every open goes through :mod:`gatewayd.hostpaths.beneath`, so no path
component can lead outside the grant's root; results and messages carry visible
paths only. The rules (symlinks, hard links, special files, sizes) are written
down for agents and operators in ``docs/tools.md``.
"""

from __future__ import annotations

import base64
import codecs
import contextlib
import fnmatch
import functools
import os
import secrets
import stat
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import PurePosixPath
from typing import Annotated, Any, Final, Literal

import msgspec
import trio

from gatewayd.errors import InvalidArguments, PolicyViolation, ToolFailed
from gatewayd.files import fsync_dir_fd, write_all
from gatewayd.hostpaths.beneath import (
    HARD_LINK_REASON,
    BeneathRoot,
    describe_mode,
    hard_link_refusal,
    hard_linked,
    open_child_dir,
    require_single_link_regular,
    translate_oserror,
)
from gatewayd.policy.capabilities import (
    EVERY_PATH,
    Capabilities,
    CapabilityRequest,
    FileCapability,
)
from gatewayd.policy.paths import (
    MAX_PATH_BYTES,
    PathAccess,
    PathGrant,
    PathMode,
    ResolvedPath,
    shown,
)
from gatewayd.tools.builtin import builtin_tool
from gatewayd.tools.clock import iso_utc
from gatewayd.tools.registry import Tool, ToolContext

# --- limits ------------------------------------------------------------------

# A page of a source file; more lines are one more call away.
DEFAULT_READ_LINES: Final = 2000
# The largest page an agent may ask for; the output cap usually bites first.
MAX_READ_LINES: Final = 20_000
# Offsets are line numbers; beyond this they are certainly a mistake.
MAX_READ_OFFSET: Final = 1 << 31
# fs.read scans the whole file (to count lines and check it is text) with a bounded
# buffer; without a grant limit, this bounds how long one call holds a worker thread.
TOOL_MAX_READ_FILE_BYTES: Final = 64 << 20
# Appends grow files without bound otherwise; a file fs.read could not read back
# is of no use to the agent, so writes share the read limit.
TOOL_MAX_WRITE_FILE_BYTES: Final = TOOL_MAX_READ_FILE_BYTES
# fs.edit holds the file, and the edited copy, in memory.
TOOL_MAX_EDIT_FILE_BYTES: Final = 16 << 20
# fs.write content arrives in one request frame (1 MiB), so it can never be longer.
MAX_WRITE_CONTENT_CHARS: Final = 1 << 20
# Read size per system call while scanning.
READ_CHUNK_BYTES: Final = 64 << 10
# Room in the run's output cap for the result's other fields and the response
# envelope around the content (the path is counted separately).
OUTPUT_HEADROOM_BYTES: Final = 1024
# Enough to recognise every image signature below.
IMAGE_SNIFF_BYTES: Final = 12
DEFAULT_LIST_LIMIT: Final = 1000
MAX_LIST_LIMIT: Final = 10_000
# Directory entries one fs.list may look at, matching or not: a "**" over a huge
# tree (node_modules, .git) must end in bounded time, with truncated=true.
LIST_MAX_VISITED_ENTRIES: Final = 100_000
# Nesting fs.list descends into; each level holds one descriptor open.
LIST_MAX_DEPTH: Final = 32
MAX_PATTERN_CHARS: Final = 1024
# Mode of files fs.write creates (the daemon's umask still applies); a replaced
# file keeps its own permission bits.
NEW_FILE_MODE: Final = 0o644
# Temporary files live next to their target so the final rename is atomic; the
# random part makes the name unguessable, O_EXCL makes a planted one harmless.
TEMP_PREFIX: Final = ".cogni-tmp-"
TEMP_NAME_ATTEMPTS: Final = 8

_READ_OPEN_FLAGS: Final = os.O_RDONLY | os.O_NONBLOCK | os.O_NOCTTY  # a FIFO must not block

_IMAGE_SIGNATURES: Final = (
    (b"\x89PNG\r\n\x1a\n", "image/png"),
    (b"\xff\xd8\xff", "image/jpeg"),
    (b"GIF87a", "image/gif"),
    (b"GIF89a", "image/gif"),
)

PathArg = Annotated[
    str,
    msgspec.Meta(
        min_length=1,
        max_length=MAX_PATH_BYTES,  # characters here; the policy counts bytes
        description=(
            "File path as seen in the sandbox: absolute (e.g. /workspace/src/app.py) "
            "or relative to /workspace."
        ),
    ),
]


# --- argument types ------------------------------------------------------------


class ReadArgs(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """Read a UTF-8 text file (a page of lines) or a PNG/JPEG/GIF/WebP image."""

    path: PathArg
    offset: Annotated[
        int,
        msgspec.Meta(
            ge=0, le=MAX_READ_OFFSET, description="First line to return, 0-based (default 0)."
        ),
    ] = 0
    limit: Annotated[
        int,
        msgspec.Meta(
            ge=1,
            le=MAX_READ_LINES,
            description=f"Most lines to return (default {DEFAULT_READ_LINES}).",
        ),
    ] = DEFAULT_READ_LINES


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


# --- requests: the paths the policy decides on -------------------------------

# What the file tools declare: any path, bounded by each run's grants.
READS_FILES: Final = Capabilities(files=(FileCapability(path=EVERY_PATH, mode=PathMode.RO),))
WRITES_FILES: Final = Capabilities(files=(FileCapability(path=EVERY_PATH, mode=PathMode.RW),))


def read_request(args: ReadArgs) -> CapabilityRequest:
    return CapabilityRequest(paths=(PathAccess(path=args.path, access="read"),))


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


def list_request(args: ListArgs) -> CapabilityRequest:
    return CapabilityRequest(paths=(PathAccess(path=args.path, access="read", metadata_only=True),))


def stat_request(args: StatArgs) -> CapabilityRequest:
    # Metadata only: a suffix rule must not refuse a stat of a directory (or of a
    # grant's own root); it governs whose contents may be read.
    return CapabilityRequest(paths=(PathAccess(path=args.path, access="read", metadata_only=True),))


# --- shared pieces -------------------------------------------------------------


def _check_stop(stop: threading.Event | None) -> None:
    """End an abandoned read or list at its next step (nobody waits for the result)."""
    if stop is not None and stop.is_set():
        raise ToolFailed("the call was stopped (timed out or cancelled) before it finished")


def _json_len(text: str) -> int:
    """Bytes ``text`` takes inside a JSON string (escapes included, quotes not)."""
    return len(msgspec.json.encode(text)) - 2


def _output_budget(max_output_bytes: int, visible: str) -> int:
    """JSON bytes of content (text or base64) one result may carry."""
    return max(0, max_output_bytes - OUTPUT_HEADROOM_BYTES - _json_len(visible))


def _size_limit(grant: PathGrant, tool_cap: int) -> tuple[int, str]:
    """The byte limit for one file, and who sets it (for the message)."""
    if grant.max_file_bytes is not None and grant.max_file_bytes <= tool_cap:
        return grant.max_file_bytes, f"the limit for files in '{grant.visible_root}'"
    return tool_cap, "the gateway's limit for this tool"


def _too_large(visible: str, size: int, limit: int, who: str) -> PolicyViolation:
    return PolicyViolation(f"'{shown(visible)}' is {size} bytes, over {who} of {limit} bytes")


def _check_size(target: ResolvedPath, size: int, tool_cap: int) -> None:
    limit, who = _size_limit(target.grant, tool_cap)
    if size > limit:
        raise _too_large(target.visible, size, limit, who)


def _encode_text(text: str, what: str) -> bytes:
    try:
        return text.encode("utf-8")
    except UnicodeEncodeError:
        raise InvalidArguments(
            f"{what} contains an unpaired surrogate and is not valid UTF-8; send UTF-8 text"
        ) from None


def _read_up_to(fd: int, limit: int) -> bytes | None:
    """The rest of the file, or ``None`` if it holds more than ``limit`` bytes
    (it may have grown since ``fstat``)."""
    chunks: list[bytes] = []
    total = 0
    while chunk := os.read(fd, READ_CHUNK_BYTES):
        total += len(chunk)
        if total > limit:
            return None
        chunks.append(chunk)
    return b"".join(chunks)


def sniff_image(head: bytes) -> str | None:
    """The image MIME type ``head`` (the file's first bytes) starts with, if any."""
    for signature, mime in _IMAGE_SIGNATURES:
        if head.startswith(signature):
            return mime
    if head[:4] == b"RIFF" and head[8:12] == b"WEBP":
        return "image/webp"
    return None


# --- fs.read -------------------------------------------------------------------

TruncatedBy = Literal["lines", "bytes"]


@dataclass(slots=True)
class LineWindow:
    """Collects lines ``offset .. offset+limit`` of a byte stream, within a JSON byte budget.

    Lines end after ``\\n`` (kept in the content). Memory is bounded by the budget:
    a line is buffered only while it is in the window, and never past ``budget + 1``
    bytes (a longer one cannot fit anyway).
    """

    offset: int
    limit: int
    budget: int
    pieces: list[str] = field(default_factory=list)
    used: int = 0
    output_lines: int = 0
    line_index: int = 0
    truncated_by: TruncatedBy | None = None
    _current: bytearray = field(default_factory=bytearray)
    _line_open: bool = False

    def _wanted(self, index: int) -> bool:
        return self.offset <= index < self.offset + self.limit

    def feed(self, chunk: bytes) -> None:
        start = 0
        while start < len(chunk):
            newline = chunk.find(b"\n", start)
            end = len(chunk) if newline < 0 else newline + 1
            self._line_open = True
            if self.truncated_by is None and self._wanted(self.line_index):
                room = self.budget + 1 - len(self._current)
                self._current += chunk[start : min(end, start + max(room, 0))]
            if newline < 0:
                return
            self._end_line()
            start = end

    def finish(self) -> None:
        if self._line_open:
            self._end_line()  # a last line without a trailing newline

    def _end_line(self) -> None:
        index = self.line_index
        self.line_index += 1
        self._line_open = False
        if index >= self.offset + self.limit:
            if self.truncated_by is None:
                self.truncated_by = "lines"
            return
        if index < self.offset or self.truncated_by is not None:
            return
        overflow = len(self._current) > self.budget
        text = bytes(self._current).decode("utf-8", "ignore" if overflow else "strict")
        self._current.clear()
        cost = _json_len(text)
        if not overflow and self.used + cost <= self.budget:
            self.pieces.append(text)
            self.used += cost
            self.output_lines += 1
            return
        self.truncated_by = "bytes"
        if self.output_lines == 0:
            # The first line alone is longer than the whole budget: give what fits.
            prefix = _fit_prefix(text, self.budget - self.used)
            if prefix:
                self.pieces.append(prefix)
                self.output_lines = 1


def _fit_prefix(text: str, budget: int) -> str:
    """The longest prefix of ``text`` whose JSON form fits in ``budget`` bytes."""
    low, high = 0, min(len(text), budget)
    while low < high:
        mid = (low + high + 1) // 2
        if _json_len(text[:mid]) <= budget:
            low = mid
        else:
            high = mid - 1
    return text[:low]


def _binary_result(target: ResolvedPath, size: int) -> dict[str, Any]:
    return {
        "type": "binary",
        "path": target.visible,
        "bytes": size,
        "note": (
            "not UTF-8 text (NUL bytes or invalid UTF-8), so no content is returned; "
            "fs.read returns UTF-8 text and PNG, JPEG, GIF or WebP images"
        ),
    }


def _read_image(
    fd: int, head: bytes, *, mime: str, size: int, target: ResolvedPath, budget: int
) -> dict[str, Any]:
    # base64 takes 4 bytes per 3; the whole image must fit in one result.
    raw_budget = budget // 4 * 3
    if size > raw_budget:
        raise PolicyViolation(
            f"'{shown(target.visible)}' is a {mime} image of {size} bytes; as base64 it "
            f"needs {-(-size // 3) * 4} bytes, more than the {budget} bytes a tool result "
            f"may hold here (images up to {raw_budget} bytes can be read)"
        )
    rest = _read_up_to(fd, raw_budget - len(head)) if len(head) <= raw_budget else None
    if rest is None:
        raise ToolFailed(f"'{shown(target.visible)}' grew while it was being read; try again")
    data = head + rest
    return {
        "type": "image",
        "path": target.visible,
        "mimeType": mime,
        "bytes": len(data),
        "base64": base64.b64encode(data).decode("ascii"),
    }


def _read_text(
    fd: int,
    head: bytes,
    *,
    args: ReadArgs,
    size: int,
    target: ResolvedPath,
    budget: int,
    stop: threading.Event | None,
) -> dict[str, Any]:
    limit, who = _size_limit(target.grant, TOOL_MAX_READ_FILE_BYTES)
    window = LineWindow(offset=args.offset, limit=args.limit, budget=budget)
    decoder = codecs.getincrementaldecoder("utf-8")("strict")
    total = 0
    chunk = head
    while chunk:
        _check_stop(stop)
        total += len(chunk)
        if total > limit:
            raise _too_large(target.visible, total, limit, who)
        if b"\0" in chunk:
            return _binary_result(target, size)
        try:
            decoder.decode(chunk)
        except UnicodeDecodeError:
            return _binary_result(target, size)
        window.feed(chunk)
        chunk = os.read(fd, READ_CHUNK_BYTES)
    try:
        decoder.decode(b"", final=True)
    except UnicodeDecodeError:
        return _binary_result(target, size)
    window.finish()
    total_lines = window.line_index
    if args.offset > 0 and args.offset >= total_lines:
        last = (
            "it is empty, so use offset 0"
            if total_lines == 0
            else f"offsets are 0-based, so the last line is offset {total_lines - 1}"
        )
        raise InvalidArguments(
            f"offset {args.offset} is past the end of '{shown(target.visible)}', which has "
            f"{total_lines} lines; {last}"
        )
    return {
        "type": "text",
        "path": target.visible,
        "content": "".join(window.pieces),
        "bytes": total,
        "totalLines": total_lines,
        "offset": args.offset,
        "outputLines": window.output_lines,
        "truncated": window.truncated_by is not None,
        "truncatedBy": window.truncated_by,
    }


def read_file(
    args: ReadArgs,
    target: ResolvedPath,
    max_output_bytes: int,
    *,
    stop: threading.Event | None = None,
) -> dict[str, Any]:
    """fs.read, blocking. A symlink at the end is followed (inside the root) unless the
    grant restricts suffixes: there a link ``notes.md -> key.pem`` would dodge the rule.
    ``stop`` set (the call was abandoned) ends the scan at the next chunk."""
    with BeneathRoot(target) as root:
        fd = root.open_file(_READ_OPEN_FLAGS, follow_final=not target.grant.suffixes)
    try:
        st = require_single_link_regular(fd, target.visible)
        _check_size(target, st.st_size, TOOL_MAX_READ_FILE_BYTES)
        budget = _output_budget(max_output_bytes, target.visible)
        head = os.read(fd, READ_CHUNK_BYTES)
        mime = sniff_image(head[:IMAGE_SNIFF_BYTES])
        if mime is not None:
            return _read_image(fd, head, mime=mime, size=st.st_size, target=target, budget=budget)
        return _read_text(
            fd, head, args=args, size=st.st_size, target=target, budget=budget, stop=stop
        )
    except OSError as exc:
        raise translate_oserror(exc, target.visible) from None
    finally:
        os.close(fd)


# --- fs.write and fs.edit --------------------------------------------------------


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
        _check_size(target, st.st_size + len(data), TOOL_MAX_WRITE_FILE_BYTES)
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
    _check_size(target, len(data), TOOL_MAX_WRITE_FILE_BYTES)
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
        fd = root.open_file(_READ_OPEN_FLAGS, follow_final=False)
    try:
        st = require_single_link_regular(fd, visible)
        _check_size(read_target, st.st_size, TOOL_MAX_EDIT_FILE_BYTES)
        limit, who = _size_limit(read_target.grant, TOOL_MAX_EDIT_FILE_BYTES)
        data = _read_up_to(fd, limit)
        if data is None:
            raise _too_large(visible, st.st_size, limit, who)
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
    _check_size(write_target, len(new_data), TOOL_MAX_EDIT_FILE_BYTES)
    with BeneathRoot(write_target) as root:
        parent_fd, name = root.open_parent()
        try:
            replace_file(
                parent_fd, name, new_data, write_target.visible, expected=(st.st_dev, st.st_ino)
            )
        finally:
            os.close(parent_fd)
    return {"path": write_target.visible, "replacements": 1, "bytes": len(new_data)}


# --- fs.list ---------------------------------------------------------------------


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
            _check_stop(self.stop)
            try:
                st = os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
            except OSError:
                continue  # gone since it was listed
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


def list_dir(
    args: ListArgs, target: ResolvedPath, *, stop: threading.Event | None = None
) -> dict[str, Any]:
    """fs.list, blocking. The listed directory itself may be reached through a symlink
    inside the root (openat2); nothing below it is ever followed. ``stop`` set (the
    call was abandoned) ends the walk at the next entry."""
    glob = Glob.parse(args.pattern)
    with BeneathRoot(target) as root:
        path_fd = root.open_file(os.O_PATH, follow_final=True)
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
    listing = _Listing(glob=glob, base=PurePosixPath(target.visible), limit=args.limit, stop=stop)
    try:
        listing.walk(dir_fd, (), glob.start())
    except OSError as exc:
        raise translate_oserror(exc, target.visible) from None
    finally:
        os.close(dir_fd)
    return {"path": target.visible, "entries": listing.entries, "truncated": listing.truncated}


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


# --- runners -------------------------------------------------------------------------


async def in_thread_abandoned_on_cancel(
    call: Callable[[threading.Event], dict[str, Any]],
) -> dict[str, Any]:
    """Run a call that changes nothing (fs.read, fs.list, fs.stat) in a worker thread.

    A cancel (the run's call_timeout_s, the run ending) answers at once: the thread is
    abandoned (a thread cannot be interrupted), ``stop`` is set, and the read or list
    loop ends at its next chunk or entry; its result is dropped.
    """
    stop = threading.Event()
    try:
        return await trio.to_thread.run_sync(call, stop, abandon_on_cancel=True)
    finally:
        stop.set()


async def in_thread_to_completion(call: Callable[[], dict[str, Any]]) -> dict[str, Any]:
    """Run a call that writes (fs.write, fs.edit) in a worker thread, to its end.

    Not abandoned on cancel: a write that went on after the caller was told "stopped"
    would be an effect nobody knows of. A cancel that arrives once the thread has
    started waits for it, and the write's own result comes back, late (each write is
    bounded by the tool's size limits).
    """
    return await trio.to_thread.run_sync(call)


async def run_read(args: ReadArgs, ctx: ToolContext) -> dict[str, Any]:
    target = ctx.resolved[0]
    return await in_thread_abandoned_on_cancel(
        lambda stop: read_file(args, target, ctx.max_output_bytes, stop=stop)
    )


async def run_write(args: WriteArgs, ctx: ToolContext) -> dict[str, Any]:
    return await in_thread_to_completion(functools.partial(write_file, args, ctx.resolved[0]))


async def run_edit(args: EditArgs, ctx: ToolContext) -> dict[str, Any]:
    read_target, write_target = ctx.resolved
    return await in_thread_to_completion(
        functools.partial(edit_file, args, read_target, write_target)
    )


async def run_list(args: ListArgs, ctx: ToolContext) -> dict[str, Any]:
    Glob.parse(args.pattern)  # refuse a bad pattern before any I/O
    target = ctx.resolved[0]
    return await in_thread_abandoned_on_cancel(lambda stop: list_dir(args, target, stop=stop))


async def run_stat(_args: StatArgs, ctx: ToolContext) -> dict[str, Any]:
    target = ctx.resolved[0]
    return await in_thread_abandoned_on_cancel(lambda _stop: stat_path(target))


FS_READ: Tool[ReadArgs] = builtin_tool(
    name="fs.read",
    summary=(
        "Read a page of lines from a UTF-8 text file (offset/limit), or a PNG, JPEG, GIF "
        "or WebP image as base64."
    ),
    args_type=ReadArgs,
    run=run_read,
    requests=read_request,
    capabilities=READS_FILES,
    side_effects=False,
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
