"""The policy's ``workspace`` section: which virtual workspace a run works on, and what
becomes of it when the run ends.

```yaml
workspace:
  mode: overlay              # host | overlay | agentfs; unset: the daemon's workspace_mode
  request_modes: [overlay]   # the modes a run request may choose (default: all three)
  on_end: keep               # keep (default) | commit | discard
  keep_for_s: 604800         # how long a kept session waits for commit/discard (7 days)
  max_delta_mb: 512          # what the run may write beside the base; unset: no limit
  commit_git_metadata: false # may a commit write .git (hooks, config)? default: never
```

``commit_git_metadata``: a commit leaves every ``.git`` path out of the base (a hook or
a config there would run on the host the next time git runs in it) unless this is true;
the session records the value when it opens (:mod:`gatewayd.workspace.commit_rules`).
Mode ``host`` cannot leave anything out: the run writes the directory itself.

Only the model lives here; the run's choice among request, policy and configuration is
:mod:`gatewayd.runs.workspaces`', the sessions themselves :mod:`gatewayd.workspace`'s.
"""

from __future__ import annotations

from typing import Annotated, Final, Literal

from pydantic import Field, field_validator

from gatewayd.policy.section import Section

WorkspaceModeName = Literal["host", "overlay", "agentfs"]
OnEndName = Literal["keep", "commit", "discard"]
WORKSPACE_MODES: Final[tuple[WorkspaceModeName, ...]] = ("host", "overlay", "agentfs")
# The mode a run gets when neither its request, its policy nor the daemon's
# configuration names one: the host directory stays untouched until a commit.
DEFAULT_WORKSPACE_MODE: Final[WorkspaceModeName] = "overlay"
# A week: a run's changes wait over a weekend for someone to look at them.
DEFAULT_KEEP_FOR_S: Final = 7 * 24 * 3600
# Ninety days: a kept session holds its delta (disk, or memory for a limited overlay)
# and, for host mode, a whole snapshot; past a quarter it is forgotten work, not a review.
MAX_KEEP_FOR_S: Final = 90 * 24 * 3600
# A mebibyte: below it even a small edit of one file copied up would not fit.
MIN_DELTA_MB: Final = 1
# A tebibyte: a bound, so a misplaced digit is an error rather than "no limit".
MAX_DELTA_MB: Final = 1 << 20

KeepSeconds = Annotated[int, Field(strict=True, ge=1, le=MAX_KEEP_FOR_S)]
DeltaMegabytes = Annotated[int, Field(strict=True, ge=MIN_DELTA_MB, le=MAX_DELTA_MB)]


class WorkspaceSection(Section):
    """How the policy's runs see their workspace (see the module doc)."""

    # None: the daemon's workspace_mode (configuration), whose default is overlay.
    mode: WorkspaceModeName | None = None
    # Empty: a request may name no mode (it gets the policy's or the daemon's).
    request_modes: tuple[WorkspaceModeName, ...] = WORKSPACE_MODES
    on_end: OnEndName = "keep"
    keep_for_s: KeepSeconds = DEFAULT_KEEP_FOR_S
    max_delta_mb: DeltaMegabytes | None = None
    # Off: a run's commit never writes git metadata into the base (see the module doc).
    commit_git_metadata: bool = Field(default=False, strict=True)

    @field_validator("request_modes")
    @classmethod
    def _each_mode_once(cls, value: tuple[WorkspaceModeName, ...]) -> tuple[WorkspaceModeName, ...]:
        if len(set(value)) != len(value):
            raise ValueError("request_modes lists a mode twice")
        return value
