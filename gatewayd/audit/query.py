"""Reading a whole (rotated) log, and choosing entries from it: the reviewer's filters.

:func:`read_log` yields every line of every segment in chain order, as it is written
(``raw``) and as a dict; a line that is not a JSON object is kept as a *broken*
record, never skipped. :class:`EntryFilter` holds the filters of ``gatewayd audit
show|export|stats`` and decides per entry; actor, tenant and the app a run invoked are
facts of a run (its ``run_created`` event, and the ``app_invoked`` entry naming it as
the child run), so filtering on them needs the runs' index first (:func:`run_index`,
one extra pass). Reading is not verifying: run ``verify``.
"""

from __future__ import annotations

import fnmatch
import functools
import os
from collections.abc import Mapping

from gatewayd.audit.line import MAX_LINE_BYTES, parse_object
from gatewayd.audit.plainrecord import PlainRecord
from gatewayd.audit.segments import log_files

# typing's flag without importing typing: the readers start without it
TYPE_CHECKING = False
if TYPE_CHECKING:
    from collections.abc import Iterable, Iterator, MutableMapping
    from pathlib import PurePath
    from typing import Any, Final

BROKEN_REASON: Final = "not a JSON object (run 'gatewayd audit verify')"


class Record(PlainRecord):
    """One line of the log: the file it is in, its 1-based line number, its bytes
    (without the newline) and its entry (None for a broken line). (The records of this
    module are plain classes: the readers make each at their start, and a dataclass
    costs ten times as much to make.)"""

    __slots__ = ("entry", "line", "raw", "segment")

    def __init__(self, segment: str, line: int, raw: bytes, entry: dict[str, Any] | None) -> None:
        self.segment = segment
        self.line = line
        self.raw = raw
        self.entry = entry

    def as_dict(self) -> dict[str, Any]:
        """The entry, or ``{"segment", "line", "broken"}`` for a broken line."""
        if self.entry is not None:
            return self.entry
        return {"segment": self.segment, "line": self.line, "broken": BROKEN_REASON}


def read_file(path: str | PurePath) -> Iterator[Record]:
    """Every line of one file, in order."""
    name = os.path.basename(path)
    with open(path, "rb") as file:
        for no, raw in enumerate(iter(lambda: file.readline(MAX_LINE_BYTES + 1), b""), 1):
            content = raw[:-1] if raw.endswith(b"\n") else raw
            yield Record(name, no, content, parse_object(content))


def read_log(path: str | PurePath, *, since_seq: int = 0) -> Iterator[Record]:
    """Every line of the log whose active file is ``path``: closed segments first.

    ``since_seq``: start at the segment holding that seq, leaving out the closed segments
    wholly before it (a reader of recent entries need not read the log's whole history);
    lines of that segment before the seq are still yielded.

    Error handling: FileNotFoundError when there is no log at all (neither the file
    nor a segment of it); other OSErrors from reading pass through.
    """
    files = log_files(os.fspath(path))
    if not files:
        raise FileNotFoundError(2, "no audit log", os.fspath(path))
    start = 0
    if since_seq > 0:
        # The newest file whose first entry is at or before the seq holds it; a file
        # whose first line is unreadable is passed over (the search reads on, older).
        for index in range(len(files) - 1, -1, -1):
            first = _first_seq(files[index])
            if first is not None and first <= since_seq:
                start = index
                break
    for file in files[start:]:
        yield from read_file(file)


def _first_seq(path: str) -> int | None:
    for record in read_file(path):
        seq = record.entry.get("seq") if record.entry is not None else None
        return seq if isinstance(seq, int) else None
    return None


# -- time -------------------------------------------------------------------------


def parse_time(text: str) -> str:
    """An ISO 8601 time as the log writes it (RFC 3339 UTC, microseconds), so entries
    compare as text. A time without a zone is UTC; a date alone is its midnight.

    Error handling: ValueError saying what was given and what is accepted.
    """
    import datetime as dt  # here: only a filter on time needs it

    try:
        when = dt.datetime.fromisoformat(text.strip())
    except ValueError:
        raise ValueError(
            f"not an ISO 8601 time: {text!r}; write e.g. 2026-11-22T13:40:00Z, "
            "2026-11-22T14:40:00+01:00 or 2026-11-22 (UTC when no zone is given)"
        ) from None
    if when.tzinfo is None:
        when = when.replace(tzinfo=dt.UTC)
    return when.astimezone(dt.UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


def time_ns_of(text: str) -> int | None:
    """Nanoseconds since the epoch of an entry's ``time``, or None if it is not one."""
    import datetime as dt  # here: only the figures need it

    try:
        when = dt.datetime.strptime(text, "%Y-%m-%dT%H:%M:%S.%fZ").replace(tzinfo=dt.UTC)
    except (TypeError, ValueError):
        return None
    return (int(when.timestamp()) * 1_000_000 + when.microsecond) * 1000


# -- runs -------------------------------------------------------------------------


class RunFacts(PlainRecord):
    """What the log says about who a run was for (its ``run_created`` event), and, for
    an app's invocation, the app's id (``detail.app`` of its ``run_created``, or of the
    ``app_invoked`` entry naming it as ``childRunId``)."""

    __slots__ = ("actor", "app", "tenant")

    def __init__(self, actor: str | None, tenant: str | None, app: str | None = None) -> None:
        self.actor = actor
        self.tenant = tenant
        self.app = app

    def with_app(self, app: str) -> RunFacts:
        return RunFacts(self.actor, self.tenant, app)


def run_index(records: Iterable[Record]) -> dict[str, RunFacts]:
    """Run id -> actor, tenant and app, from the ``run_created`` and ``app_invoked``
    events."""
    runs: dict[str, RunFacts] = {}
    index_runs(runs, records)
    return runs


def _text(value: Any) -> str | None:
    return value if isinstance(value, str) else None


def index_runs(runs: MutableMapping[str, RunFacts], records: Iterable[Record]) -> None:
    """Add what ``records`` say about runs to ``runs`` (``tail -f`` adds each new entry).

    An app's child run is named by the caller's ``app_invoked`` entry, written before
    the child's ``run_created``: the app is kept whichever comes first.
    """
    # Here: the event registry costs every reader's start about 2 ms to build, and only
    # the filters on a run's facts need it.
    from gatewayd.audit.events import AuditEvent

    for record in records:
        entry = record.entry
        event = entry.get("event") if entry is not None else None
        if entry is None or event not in (AuditEvent.RUN_CREATED, AuditEvent.APP_INVOKED):
            continue
        detail = entry.get("detail")
        if not isinstance(detail, Mapping):
            continue
        app = _text(detail.get("app"))
        if event == AuditEvent.APP_INVOKED:
            child = _text(detail.get("childRunId"))
            if child is not None and app is not None:
                runs[child] = runs.get(child, RunFacts(None, None)).with_app(app)
            continue
        run = _text(entry.get("runId"))
        if run is not None:
            known = runs.get(run)
            runs[run] = RunFacts(
                _text(detail.get("actorId")),
                _text(detail.get("tenantId")),
                app if app is not None else (known.app if known is not None else None),
            )


# -- the filter ---------------------------------------------------------------------


def is_denied(entry: Mapping[str, Any]) -> bool:
    """A call gatewayd refused, or any entry with an error code."""
    return entry.get("decision") == "deny" or entry.get("errorCode") is not None


def error_code_of(entry: Mapping[str, Any]) -> str | None:
    """The entry's error code; for an event without one, its ``detail.errorCode``
    (``exec_ended`` keeps a command's timeout or OOM there)."""
    code = entry.get("errorCode")
    if code is None and entry.get("kind") == "event":
        detail = entry.get("detail")
        code = detail.get("errorCode") if isinstance(detail, Mapping) else None
    return code if isinstance(code, str) else None


class EntryFilter:
    """The reviewer's filters; an entry is kept when it passes every one that is set.

    ``run``: the run id or a prefix of it. ``tool``: a name or shell pattern
    (``fs.*``). ``decision``: ``allow``/``deny``. ``kind``: ``call``/``result``/
    ``event``. ``event``: an event name. ``error_code``: the entry's error code (or
    an event's ``detail.errorCode``). ``since``/``until``: times as :func:`parse_time`
    makes them, ``since <= time < until``. ``actor``/``tenant``: of the entry's run
    (its ``run_created`` event), or of a refused run's own event. ``app``: an app id
    (:func:`keeps_app`). ``denied``: only denied or failed entries (:func:`is_denied`).
    """

    __slots__ = (
        "actor",
        "app",
        "decision",
        "denied",
        "error_code",
        "event",
        "kind",
        "run",
        "since",
        "tenant",
        "tool",
        "until",
    )

    def __init__(
        self,
        *,
        run: str | None = None,
        tool: str | None = None,
        decision: str | None = None,
        kind: str | None = None,
        event: str | None = None,
        error_code: str | None = None,
        since: str | None = None,
        until: str | None = None,
        actor: str | None = None,
        tenant: str | None = None,
        app: str | None = None,
        denied: bool = False,
    ) -> None:
        self.run = run
        self.tool = tool
        self.decision = decision
        self.kind = kind
        self.event = event
        self.error_code = error_code
        self.since = since
        self.until = until
        self.actor = actor
        self.tenant = tenant
        self.app = app
        self.denied = denied

    @property
    def needs_runs(self) -> bool:
        """Whether deciding needs :func:`run_index` (actor, tenant or app is set)."""
        return self.actor is not None or self.tenant is not None or self.app is not None

    def keeps(self, entry: Mapping[str, Any], runs: Mapping[str, RunFacts]) -> bool:
        """Whether ``entry`` passes (``runs`` from :func:`run_index` when needed)."""
        run = entry.get("runId")
        if self.run is not None and not (isinstance(run, str) and run.startswith(self.run)):
            return False
        if self.tool is not None:
            tool = entry.get("tool")
            if not (isinstance(tool, str) and fnmatch.fnmatchcase(tool, self.tool)):
                return False
        if self.decision is not None and entry.get("decision") != self.decision:
            return False
        if self.kind is not None and entry.get("kind") != self.kind:
            return False
        if self.event is not None and entry.get("event") != self.event:
            return False
        if self.error_code is not None and error_code_of(entry) != self.error_code:
            return False
        when = entry.get("time")
        if self.since is not None and not (isinstance(when, str) and when >= self.since):
            return False
        if self.until is not None and not (isinstance(when, str) and when < self.until):
            return False
        if (self.actor is not None or self.tenant is not None) and not self._keeps_party(
            entry, runs
        ):
            return False
        if self.app is not None and not keeps_app(entry, runs, self.app):
            return False
        return not (self.denied and not is_denied(entry))

    def _keeps_party(self, entry: Mapping[str, Any], runs: Mapping[str, RunFacts]) -> bool:
        run = entry.get("runId")
        facts = runs.get(run) if isinstance(run, str) else None
        if facts is None:  # a refused run has no id: its event names the party
            detail = entry.get("detail")
            if not isinstance(detail, Mapping):
                return False
            actor, tenant = detail.get("actorId"), detail.get("tenantId")
            facts = RunFacts(
                actor if isinstance(actor, str) else None,
                tenant if isinstance(tenant, str) else None,
            )
        if self.actor is not None and facts.actor != self.actor:
            return False
        return self.tenant is None or facts.tenant == self.tenant


@functools.cache
def _app_names(app: str) -> tuple[str, str]:
    """The tool an app is called by, and its folder as an ``app_skipped`` names it
    (imported here, once: the manifest's parser is not every audit command's cost)."""
    from gatewayd.apps.manifest import tool_name_of
    from gatewayd.policy.appsfolder import APPS_DIR_NAME

    return tool_name_of(app), f"{APPS_DIR_NAME}/{app}"


def keeps_app(entry: Mapping[str, Any], runs: Mapping[str, RunFacts], app: str) -> bool:
    """Whether ``entry`` is about the app ``app`` (a valid app id): its ``detail.app``
    or ``review.app`` is ``app`` (the app's own events, the reviewed calls it makes),
    it is an entry of a run that was one of its invocations (``runs`` from
    :func:`run_index`), a caller's call of its tool ``app_<id>``, or an ``app_skipped``
    of its folder ``apps/<id>``."""
    for key in ("detail", "review"):
        part = entry.get(key)
        if isinstance(part, Mapping) and part.get("app") == app:
            return True
    run = entry.get("runId")
    facts = runs.get(run) if isinstance(run, str) else None
    if facts is not None and facts.app == app:
        return True
    tool, folder = _app_names(app)
    if entry.get("tool") == tool:
        return True
    from gatewayd.audit.events import AuditEvent  # here, as in index_runs

    if entry.get("event") == AuditEvent.APP_SKIPPED:
        detail = entry.get("detail")
        file = detail.get("file") if isinstance(detail, Mapping) else None
        return isinstance(file, str) and (file == folder or file.startswith(folder + "/"))
    return False


def select(path: str | PurePath, where: EntryFilter) -> Iterator[Record]:
    """The records of the log at ``path`` that ``where`` keeps; broken lines always."""
    runs = run_index(read_log(path)) if where.needs_runs else {}
    for record in read_log(path):
        if record.entry is None or where.keeps(record.entry, runs):
            yield record
