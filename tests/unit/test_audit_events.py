"""Every audit event name gatewayd writes is a member of one registry (``AuditEvent``):
the writer refuses any other name, the entry's type says so, gatewayd's source holds no
event name as a bare string, and docs/audit.md's "Events" table lists exactly the
registry. Reading stays lenient: a log holding another snake_case name still reads."""

from __future__ import annotations

import ast
import re
import typing
from pathlib import Path
from typing import Any

import pytest

from gatewayd.audit import AuditEvent, EntryFields, open_audit_log, read_entries, verify_file
from gatewayd.audit.entry import EventName, build_body, format_time
from gatewayd.audit.entryform import decode_body
from gatewayd.audit.events import REGISTERED_EVENTS
from gatewayd.audit.line import GENESIS_HASH

ROOT = Path(__file__).resolve().parents[2]
DOC = ROOT / "docs" / "audit.md"
EVENTS_HEADING = "Events"
_NAME_RE = re.compile(r"`([^`]+)`")
_EVENT_NAME_RE = re.compile(typing.get_args(EventName)[1].pattern)


# --- the registry ---------------------------------------------------------------------------


def test_the_registered_names_are_exactly_the_members_values() -> None:
    assert {m.value for m in AuditEvent} == REGISTERED_EVENTS
    assert len(AuditEvent) == len(REGISTERED_EVENTS)  # no two members share a name


@pytest.mark.parametrize("event", list(AuditEvent))
def test_every_registered_name_is_one_a_reader_accepts(event: AuditEvent) -> None:
    assert _EVENT_NAME_RE.fullmatch(event.value)


def test_the_entry_type_takes_only_a_registered_event() -> None:
    # What lets mypy catch a bare string at a call site.
    hints = typing.get_type_hints(EntryFields)
    assert hints["event"] == AuditEvent | None


# --- the writer -----------------------------------------------------------------------------


@pytest.mark.parametrize(
    "event",
    [
        "mark",  # snake_case, but not registered
        "bench_probe",
        "run_create",  # one letter off a registered name
        "RUN_CREATED",  # a member's name is not its value
        "Run Created",
        "",
        42,
    ],
)
async def test_the_writer_refuses_an_unregistered_event_and_records_nothing(
    tmp_path: Path, event: Any
) -> None:
    path = tmp_path / "audit.jsonl"
    async with open_audit_log(path, fsync=False) as log:
        before = log.last_seq
        with pytest.raises(ValueError, match="is not an AuditEvent"):
            log.record("event", event=event)
        with pytest.raises(ValueError, match="is not an AuditEvent"):
            await log.append("event", event=event, detail={"i": 1})
        assert log.last_seq == before
    assert verify_file(path).ok
    assert [e["event"] for e in read_entries(path)] == ["audit_open", "audit_close"]


async def test_the_writer_takes_every_registered_event_as_member_or_as_its_name(
    tmp_path: Path,
) -> None:
    path = tmp_path / "audit.jsonl"
    async with open_audit_log(path, fsync=False) as log:
        for event in AuditEvent:
            await log.append("event", event=event)
            await log.append("event", event=event.value)  # type: ignore[arg-type]
    written = [e["event"] for e in read_entries(path)][1:-1]
    assert written == [name for event in AuditEvent for name in (event.value, event.value)]
    assert verify_file(path).ok


def test_reading_accepts_a_name_no_version_of_gatewayd_registered() -> None:
    body = build_body(1, format_time(0), "event", {"event": "mark"}, GENESIS_HASH)
    assert decode_body(body).event == "mark"


# --- no bare strings in gatewayd ------------------------------------------------------------


def _bare_event_names(tree: ast.AST) -> list[tuple[int, str]]:
    """Registered names written as string literals where an event name goes: an
    ``event=`` argument, an ``"event"`` key of a dict, or a comparison."""
    found = []
    for node in ast.walk(tree):
        values: list[ast.expr] = []
        if isinstance(node, ast.Call):
            values = [k.value for k in node.keywords if k.arg == "event"]
        elif isinstance(node, ast.Dict):
            values = [
                v
                for k, v in zip(node.keys, node.values, strict=True)
                if isinstance(k, ast.Constant) and k.value == "event"
            ]
        elif isinstance(node, ast.Compare):
            values = [node.left, *node.comparators]
        for value in values:
            if isinstance(value, ast.Constant) and value.value in REGISTERED_EVENTS:
                found.append((value.lineno, value.value))
    return found


# A registered name anywhere in a module's text: only such a module can hold one as a
# literal, and parsing the others too tripled the check's time.
_ANY_EVENT_RE = re.compile("|".join(map(re.escape, sorted(REGISTERED_EVENTS))))


def test_gatewayd_names_every_event_through_the_registry() -> None:
    registry = ROOT / "gatewayd" / "audit" / "events.py"
    texts = {path: path.read_text() for path in sorted((ROOT / "gatewayd").rglob("*.py"))}
    bare = [
        f"{path.relative_to(ROOT)}:{line}: {name!r}"
        for path, text in texts.items()
        if path != registry and _ANY_EVENT_RE.search(text)
        for line, name in _bare_event_names(ast.parse(text))
    ]
    assert not bare, "use AuditEvent, not a bare string:\n" + "\n".join(bare)


@pytest.mark.parametrize(
    "source",
    [
        'log.record("event", event="run_created")',
        'fields = {"event": "exec_ended"}',
        'if entry.get("event") == "exec_started": pass',
    ],
)
def test_the_bare_string_check_finds_each_form(source: str) -> None:
    assert len(_bare_event_names(ast.parse(source))) == 1


# --- docs/audit.md --------------------------------------------------------------------------


def documented_events(text: str) -> list[str]:
    """Every event name in the first column of the "Events" section's table."""
    names: list[str] = []
    inside = False
    for line in text.splitlines():
        if line.startswith("#"):
            inside = line.lstrip("#").strip() == EVENTS_HEADING
        elif inside and line.startswith("| `"):
            names += _NAME_RE.findall(line.split("|")[1])
    return names


def test_the_docs_list_every_registered_event_once_and_nothing_else() -> None:
    names = documented_events(DOC.read_text())
    assert sorted(names) == sorted(REGISTERED_EVENTS)
    assert len(names) == len(set(names))


@pytest.mark.parametrize("event", list(AuditEvent))
def test_the_docs_check_misses_an_event_whose_row_is_removed(event: AuditEvent) -> None:
    lines = DOC.read_text().splitlines()
    kept = [
        line
        for line in lines
        if not (line.startswith("| `") and f"`{event.value}`" in line.split("|")[1])
    ]
    assert len(kept) == len(lines) - 1
    assert event.value not in documented_events("\n".join(kept))


def test_the_docs_check_sees_a_row_for_an_event_nobody_writes() -> None:
    text = DOC.read_text().replace("| `audit_close` |", "| `audit_closed` |")
    names = documented_events(text)
    assert "audit_closed" in names and "audit_close" not in names
