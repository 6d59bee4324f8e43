"""``fs.read``: a page of lines of a UTF-8 text file, or an image as base64.

The file is scanned whole, in bounded chunks, to count its lines and to check that it
is text; only the lines asked for, within the run's output cap, are kept.
"""

from __future__ import annotations

import base64
import codecs
import os
import threading
from dataclasses import dataclass, field
from typing import Annotated, Any, Final, Literal

import msgspec

from gatewayd.errors import InvalidArguments, PolicyViolation, ToolFailed
from gatewayd.hostpaths.beneath import BeneathRoot, require_single_link_regular, translate_oserror
from gatewayd.policy.capabilities import CapabilityRequest
from gatewayd.policy.paths import PathAccess, ResolvedPath, shown
from gatewayd.tools.builtin import builtin_tool
from gatewayd.tools.fs.bounds import (
    READ_CHUNK_BYTES,
    READ_OPEN_FLAGS,
    READS_FILES,
    TOOL_MAX_READ_FILE_BYTES,
    PathArg,
    check_size,
    read_up_to,
    size_limit,
    too_large,
)
from gatewayd.tools.fs.threads import check_stop, in_thread_abandoned_on_cancel
from gatewayd.tools.registry import Tool, ToolContext

# A page of a source file; more lines are one more call away.
DEFAULT_READ_LINES: Final = 2000
# The largest page an agent may ask for; the output cap usually bites first.
MAX_READ_LINES: Final = 20_000
# Offsets are line numbers; beyond this they are certainly a mistake.
MAX_READ_OFFSET: Final = 1 << 31
# Room in the run's output cap for the result's other fields and the response
# envelope around the content (the path is counted separately).
OUTPUT_HEADROOM_BYTES: Final = 1024
# Enough to recognise every image signature below.
IMAGE_SNIFF_BYTES: Final = 12

_IMAGE_SIGNATURES: Final = (
    (b"\x89PNG\r\n\x1a\n", "image/png"),
    (b"\xff\xd8\xff", "image/jpeg"),
    (b"GIF87a", "image/gif"),
    (b"GIF89a", "image/gif"),
)


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


def read_request(args: ReadArgs) -> CapabilityRequest:
    return CapabilityRequest(paths=(PathAccess(path=args.path, access="read"),))


def _json_len(text: str) -> int:
    """Bytes ``text`` takes inside a JSON string (escapes included, quotes not)."""
    return len(msgspec.json.encode(text)) - 2


def _output_budget(max_output_bytes: int, visible: str) -> int:
    """JSON bytes of content (text or base64) one result may carry."""
    return max(0, max_output_bytes - OUTPUT_HEADROOM_BYTES - _json_len(visible))


def sniff_image(head: bytes) -> str | None:
    """The image MIME type ``head`` (the file's first bytes) starts with, if any."""
    for signature, mime in _IMAGE_SIGNATURES:
        if head.startswith(signature):
            return mime
    if head[:4] == b"RIFF" and head[8:12] == b"WEBP":
        return "image/webp"
    return None


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
    rest = read_up_to(fd, raw_budget - len(head)) if len(head) <= raw_budget else None
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
    limit, who = size_limit(target.grant, TOOL_MAX_READ_FILE_BYTES)
    window = LineWindow(offset=args.offset, limit=args.limit, budget=budget)
    decoder = codecs.getincrementaldecoder("utf-8")("strict")
    total = 0
    chunk = head
    while chunk:
        check_stop(stop)
        total += len(chunk)
        if total > limit:
            raise too_large(target.visible, total, limit, who)
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


def open_for_read(target: ResolvedPath, flags: int = READ_OPEN_FLAGS) -> int:
    """The descriptor fs.read reads ``target`` through (the caller closes it). A symlink
    at the end is followed (inside the root) unless the grant restricts suffixes: there
    a link ``notes.md -> key.pem`` would dodge the rule. ``sandbox.query`` passes
    ``O_PATH``: the same resolution, without opening the file itself (opening a FIFO
    would wake its writer)."""
    with BeneathRoot(target) as root:
        return root.open_file(flags, follow_final=not target.grant.suffixes)


def read_file(
    args: ReadArgs,
    target: ResolvedPath,
    max_output_bytes: int,
    *,
    stop: threading.Event | None = None,
) -> dict[str, Any]:
    """fs.read, blocking (opened by :func:`open_for_read`). ``stop`` set (the call was
    abandoned) ends the scan at the next chunk."""
    fd = open_for_read(target)
    try:
        st = require_single_link_regular(fd, target.visible)
        check_size(target, st.st_size, TOOL_MAX_READ_FILE_BYTES)
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


async def run_read(args: ReadArgs, ctx: ToolContext) -> dict[str, Any]:
    target = ctx.resolved[0]
    return await in_thread_abandoned_on_cancel(
        lambda stop: read_file(args, target, ctx.max_output_bytes, stop=stop)
    )


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
