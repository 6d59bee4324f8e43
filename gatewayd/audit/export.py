"""``gatewayd audit export``: the chosen entries as JSON lines or CSV.

JSON lines are the lines exactly as written (hash included), so an export can be
checked entry by entry with the hash recipe. CSV has a fixed set of columns
(:data:`CSV_COLUMNS`, in the log's key order, plus ``segment``, ``line`` and
``broken``); nested fields (``argsSummary``, ``peer``, ``detail``, ``review``) are
compact JSON text. Text that a spreadsheet would take for a formula (it starts with
``=``, ``+``, ``-``, ``@``, a tab or a carriage return) gets a leading ``'``: the
sandbox chooses some of these strings.
"""

from __future__ import annotations

import csv
import enum

from gatewayd.audit.jsonform import dumps

# typing's flag without importing typing: the readers start without it
TYPE_CHECKING = False
if TYPE_CHECKING:
    from collections.abc import Iterable
    from typing import Any, Final, TextIO

    from gatewayd.audit.query import Record


class ExportFormat(enum.StrEnum):
    JSONL = "jsonl"
    CSV = "csv"


CSV_COLUMNS: Final = (
    "seq",
    "time",
    "kind",
    "runId",
    "toolCallId",
    "tool",
    "argsDigest",
    "argsSummary",
    "decision",
    "errorCode",
    "safeMessage",
    "durationMs",
    "outputDigest",
    "outputBytes",
    "peer",
    "event",
    "detail",
    "review",
    "degraded",
    "prev",
    "hash",
    "segment",
    "line",
    "broken",
)
_FORMULA_START: Final = ("=", "+", "-", "@", "\t", "\r")


def _cell(value: Any) -> str | int | float:
    if value is None:
        return ""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int | float):
        return value
    text = value if isinstance(value, str) else dumps(value)
    return "'" + text if text.startswith(_FORMULA_START) else text


def write_jsonl(records: Iterable[Record], out: TextIO) -> int:
    """Each record's line as written (a broken line as ``{"segment","line","broken"}``);
    returns how many were written."""
    count = 0
    for record in records:
        if record.entry is not None:
            out.write(record.raw.decode("utf-8", "replace"))
        else:
            out.write(dumps(record.as_dict()))
        out.write("\n")
        count += 1
    return count


def write_csv(records: Iterable[Record], out: TextIO) -> int:
    """A header, then one row per record; returns how many rows were written."""
    writer = csv.writer(out, lineterminator="\n")
    writer.writerow(CSV_COLUMNS)
    count = 0
    for record in records:
        row = dict(record.entry or {"broken": record.as_dict()["broken"]})
        row["segment"], row["line"] = record.segment, record.line
        writer.writerow([_cell(row.get(column)) for column in CSV_COLUMNS])
        count += 1
    return count
