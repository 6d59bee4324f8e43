"""``gatewayd audit show``: the log as a table a reviewer can read.

Reading is not verifying: ``show`` prints what the lines say, and marks lines that
are not entries at all rather than skipping them. Run ``gatewayd audit verify`` to
know whether the chain is intact. Text from the log is printed with control
characters escaped, so a logged string cannot drive the reviewer's terminal.
"""

from __future__ import annotations

from gatewayd.audit.jsonform import dumps
from gatewayd.audit.line import MAX_LINE_BYTES, parse_object

# typing's flag without importing typing: the readers start without it
TYPE_CHECKING = False
if TYPE_CHECKING:
    from collections.abc import Callable, Iterable, Iterator, Mapping
    from pathlib import PurePath
    from typing import Any, Final

# Column widths: seq, time (to the millisecond), run id prefix, tool, decision or
# kind, error code, duration; the message takes what is left of a 160-column line.
_WIDTHS: Final = (7, 23, 12, 18, 8, 14, 9)
_MESSAGE_CHARS: Final = 60
_HEADERS: Final = ("SEQ", "TIME (UTC)", "RUN", "TOOL", "WHAT", "ERROR", "MS", "MESSAGE")
# C0 and C1 controls and DEL become visible escapes (terminal injection).
_CONTROL: Final = {c: f"\\x{c:02x}" for c in (*range(0x20), *range(0x7F, 0xA0))}


def read_entries(path: str | PurePath) -> Iterator[dict[str, Any]]:
    """Every line of the log as a dict, in file order.

    A line that is not a JSON object is yielded as ``{"line": N, "broken": reason}``
    so a table shows it instead of silently leaving it out.
    """
    with open(path, "rb") as file:
        for no, raw in enumerate(iter(lambda: file.readline(MAX_LINE_BYTES + 1), b""), 1):
            value = parse_object(raw)
            if value is not None:
                yield value
            else:
                yield {"line": no, "broken": "not a JSON object (run 'gatewayd audit verify')"}


def _printable(value: Any) -> str:
    return str(value).translate(_CONTROL)


def _fit(value: Any, width: int, *, mark: str = "…") -> str:
    text = "" if value is None else _printable(value)
    return text if len(text) <= width else text[: width - len(mark)] + mark


def _is_denied(entry: Mapping[str, Any]) -> bool:
    return entry.get("decision") == "deny" or entry.get("errorCode") is not None


def _message(entry: Mapping[str, Any]) -> str:
    if "broken" in entry:
        where = f"{entry['segment']} " if entry.get("segment") else ""
        return f"{where}line {entry.get('line')}: {entry['broken']}"
    if entry.get("kind") == "event":
        detail = entry.get("detail")
        tail = "" if detail is None else " " + dumps(detail)
        return f"{entry.get('event')}{tail}"
    if entry.get("safeMessage"):
        return str(entry["safeMessage"])
    if entry.get("outputBytes") is not None:
        return f"{entry['outputBytes']} bytes out"
    if entry.get("argsSummary") is not None:
        return dumps(entry["argsSummary"])
    return ""


def format_row(entry: Mapping[str, Any]) -> str:
    """One row of the table (``tail`` prints rows as they come)."""
    return _row(entry)


def table_header() -> str:
    """The table's two header lines."""
    header = " ".join(
        [
            h.rjust(w) if h in ("SEQ", "MS") else h.ljust(w)
            for h, w in zip(_HEADERS, _WIDTHS, strict=False)
        ]
        + [_HEADERS[-1]]
    )
    return header + "\n" + "-" * len(header)


def _row(entry: Mapping[str, Any]) -> str:
    broken = "broken" in entry
    time_text = str(entry.get("time", "")).replace("T", " ")[: _WIDTHS[1]]  # to the ms
    duration = entry.get("durationMs")
    cells = (
        "?" if broken else entry.get("seq"),
        time_text,
        entry.get("runId"),
        entry.get("tool"),
        "BROKEN" if broken else entry.get("decision") or entry.get("kind"),
        entry.get("errorCode"),
        f"{duration:.1f}" if isinstance(duration, int | float) else None,
    )
    fitted = [_fit(cell, width).ljust(width) for cell, width in zip(cells, _WIDTHS, strict=True)]
    fitted[2] = _fit(cells[2], _WIDTHS[2], mark="").ljust(_WIDTHS[2])  # an id prefix
    fitted[0] = fitted[0].strip().rjust(_WIDTHS[0])
    fitted[-1] = fitted[-1].strip().rjust(_WIDTHS[-1])
    return " ".join([*fitted, _fit(_message(entry), _MESSAGE_CHARS)]).rstrip()


def format_table(
    entries: Iterable[Mapping[str, Any]],
    *,
    run_id: str | None = None,
    denied_only: bool = False,
    keep: Callable[[Mapping[str, Any]], bool] | None = None,
) -> str:
    """A fixed-width table of ``entries``.

    ``run_id`` keeps the entries of runs whose id equals it or starts with it (the
    table shows id prefixes); ``denied_only`` keeps entries with decision ``deny`` or
    an errorCode; ``keep`` is any other test (``EntryFilter.keeps``). Broken lines
    are always shown.
    """
    rows = [table_header()]
    shown = total = 0
    for entry in entries:
        total += 1
        if "broken" not in entry:
            run = entry.get("runId")
            if run_id is not None and not (isinstance(run, str) and run.startswith(run_id)):
                continue
            if denied_only and not _is_denied(entry):
                continue
            if keep is not None and not keep(entry):
                continue
        rows.append(_row(entry))
        shown += 1
    rows.append(f"{shown} of {total} entries shown")
    return "\n".join(rows)
