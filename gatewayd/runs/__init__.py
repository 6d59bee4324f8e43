"""Runs: the run model, the registry of live runs, and their lifecycle.

- :mod:`.model` - the request, the spec, the run, its states and the ``TRANSITIONS`` table;
- :mod:`.registry` - the runs one daemon serves, each with its private directory;
- :mod:`.lifecycle` - :class:`~gatewayd.runs.lifecycle.RunManager`: start, isolate, serve,
  exec, finish, end;
- :mod:`.services` - in-sandbox services (``cogni-tool serve``, the egress proxy);
- :mod:`.reload` - policy and configuration reload (SIGHUP);
- :mod:`.startup` - the host probe, a crashed daemon's leftovers, the open-file limit.

This namespace re-exports the model and the registry only: the dispatcher, the server
and the tools read those, and the lifecycle serves runs through the dispatcher, so it is
imported from :mod:`gatewayd.runs.lifecycle` itself (re-exporting it here would make
every reader of the run model import the dispatcher: an import cycle).
"""

from gatewayd.runs.model import (
    MAX_PATH_CHARS,
    TRANSITIONS,
    ChildKind,
    ChildSpec,
    Grant,
    IllegalTransition,
    MadeFor,
    ModelBudget,
    Run,
    RunLimits,
    RunRequest,
    RunSpec,
    RunState,
    format_validation_error,
    new_run_id,
)
from gatewayd.runs.registry import RunRegistry

__all__ = [
    "MAX_PATH_CHARS",
    "TRANSITIONS",
    "ChildKind",
    "ChildSpec",
    "Grant",
    "IllegalTransition",
    "MadeFor",
    "ModelBudget",
    "Run",
    "RunLimits",
    "RunRegistry",
    "RunRequest",
    "RunSpec",
    "RunState",
    "format_validation_error",
    "new_run_id",
]
