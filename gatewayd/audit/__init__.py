"""The append-only, hash-chained audit log (see docs/audit.md).

Public names are re-exported here; the modules behind them are:
``line`` (hash primitives), ``entry`` (schema and limits), ``events`` (the registry of
event names), ``chain`` (the recipe), ``head`` (the head file), ``tail`` (finding the
end of an existing log), ``opening`` (opening the log's files, locking them, reading
where its chain ends), ``writer`` (the trio writer with group commit and size-based
rotation), ``segments`` (closed segment names), ``verify`` and ``show`` (the CLI's
readers), ``query`` (reading every segment, the filters), ``report`` (stats, a run's
result bundle), ``export`` and ``follow`` (``tail -f``).

The names are loaded when first used (``__getattr__``), each from its module: a reader
such as `gatewayd audit verify` then loads the reading modules only, not the writer and
what it brings (trio, the metrics); the imports below are what a type checker and the
import contracts see.
"""

# typing's flag without importing typing: the readers start without it
TYPE_CHECKING = False
if TYPE_CHECKING:
    from gatewayd.audit.chain import GENESIS, ChainPosition
    from gatewayd.audit.entry import (
        MAX_ARGS_SUMMARY_BYTES,
        MAX_DETAIL_BYTES,
        MAX_SAFE_MESSAGE_CHARS,
        Decision,
        EntryFields,
        EntryKind,
        Peer,
    )
    from gatewayd.audit.events import AuditEvent
    from gatewayd.audit.head import HeadRecord, head_path, read_head
    from gatewayd.audit.line import MAX_LINE_BYTES
    from gatewayd.audit.opening import AuditOpenError
    from gatewayd.audit.show import format_table, read_entries
    from gatewayd.audit.verify import Problem, ProblemKind, VerifyReport, verify_file
    from gatewayd.audit.writer import AuditLog, AuditWriteError, open_audit_log

__all__ = [
    "GENESIS",
    "MAX_ARGS_SUMMARY_BYTES",
    "MAX_DETAIL_BYTES",
    "MAX_LINE_BYTES",
    "MAX_SAFE_MESSAGE_CHARS",
    "AuditEvent",
    "AuditLog",
    "AuditOpenError",
    "AuditWriteError",
    "ChainPosition",
    "Decision",
    "EntryFields",
    "EntryKind",
    "HeadRecord",
    "Peer",
    "Problem",
    "ProblemKind",
    "VerifyReport",
    "format_table",
    "head_path",
    "open_audit_log",
    "read_entries",
    "read_head",
    "verify_file",
]

# Public name -> the module that defines it.
_HOMES = {
    "GENESIS": "chain",
    "ChainPosition": "chain",
    "MAX_ARGS_SUMMARY_BYTES": "entry",
    "MAX_DETAIL_BYTES": "entry",
    "MAX_LINE_BYTES": "line",
    "MAX_SAFE_MESSAGE_CHARS": "entry",
    "Decision": "entry",
    "EntryFields": "entry",
    "EntryKind": "entry",
    "Peer": "entry",
    "AuditEvent": "events",
    "HeadRecord": "head",
    "head_path": "head",
    "read_head": "head",
    "AuditOpenError": "opening",
    "format_table": "show",
    "read_entries": "show",
    "Problem": "verify",
    "ProblemKind": "verify",
    "VerifyReport": "verify",
    "verify_file": "verify",
    "AuditLog": "writer",
    "AuditWriteError": "writer",
    "open_audit_log": "writer",
}


def __getattr__(name: str) -> object:
    home = _HOMES.get(name)
    if home is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    import importlib

    value = getattr(importlib.import_module(f"{__name__}.{home}"), name)
    globals()[name] = value  # looked up once
    return value
