"""The run lifecycle's transition table, every pair of states.

The legal moves are written out here again, by hand, on purpose: a change to
``TRANSITIONS`` must be a change to this list too, so a run's lifecycle never widens by
accident. Every (from, to) pair is then tried on a run: a legal move happens; an illegal
one raises ``IllegalTransition`` and leaves the run FAILED where the table lets it fail
from there (fail closed), and where it did not (ENDED, or FAILED itself), as it was.
"""

from __future__ import annotations

import itertools
from pathlib import Path
from typing import Final

import pytest
import trio

from gatewayd.policy import RunRules, TokenBucket, load_policy_text
from gatewayd.runs import TRANSITIONS, IllegalTransition, Run, RunRequest, RunSpec, RunState

RUN_ID: Final = "0123456789abcdef0123456789abcdef"

S = RunState
# The lifecycle: made, served, ended; FAILED from anywhere not yet ended, and only to
# ENDED from there (its directory and socket are still removed).
LEGAL: Final = frozenset(
    {
        (S.CREATED, S.SERVING),
        (S.CREATED, S.ENDING),
        (S.CREATED, S.FAILED),
        (S.SERVING, S.ENDING),
        (S.SERVING, S.FAILED),
        (S.ENDING, S.ENDED),
        (S.ENDING, S.FAILED),
        (S.FAILED, S.ENDED),
    }
)
EVERY_PAIR: Final = list(itertools.product(RunState, RunState))


def run_in(state: RunState) -> Run:
    """A run (no directory, no socket: neither is made) standing in ``state``."""
    policy = load_policy_text("version: 1\nname: run-states\n", "run-states.yaml")
    spec = RunSpec(
        runId=RUN_ID,
        request=RunRequest(
            workspacePath="/nonexistent/ws", policy=policy.name, actorId="a", tenantId="t"
        ),
        workspace=Path("/nonexistent/ws"),
        policy=policy,
        policy_source="run-states.yaml",
        grants=(),
        rules=RunRules(tool_patterns=(), run_tool_ids=None, grants=()),
    )
    return Run(
        spec=spec,
        directory=Path("/nonexistent/run"),
        socket_path=Path("/nonexistent/run/gateway.sock"),
        state=state,
        bucket=TokenBucket(rate=1, burst=1),
        limiter=trio.CapacityLimiter(1),
    )


def test_the_table_is_the_lifecycle_written_here() -> None:
    assert set(TRANSITIONS) == set(RunState), "every state has a row"
    table = {(old, new) for old, moves in TRANSITIONS.items() for new in moves}
    assert table == LEGAL


@pytest.mark.parametrize(("old", "new"), EVERY_PAIR, ids=[f"{o}->{n}" for o, n in EVERY_PAIR])
def test_every_move_is_made_or_refused_by_the_table(old: RunState, new: RunState) -> None:
    run = run_in(old)
    if (old, new) in LEGAL:
        run.move_to(new)
        assert run.state is new
        return
    with pytest.raises(IllegalTransition) as raised:
        run.move_to(new)
    assert str(raised.value) == f"run {RUN_ID}: {old} -> {new} is not allowed"
    # Fail closed: the run is FAILED where it may fail from; nowhere else does it move.
    assert run.state is (S.FAILED if (old, S.FAILED) in LEGAL else old)


def test_every_live_state_can_fail_and_every_state_reaches_ended() -> None:
    """No run can be stuck: from any state, some path of legal moves ends it."""
    for state in (S.CREATED, S.SERVING, S.ENDING):
        assert (state, S.FAILED) in LEGAL
    for start in RunState:
        reached, frontier = {start}, [start]
        while frontier:
            here = frontier.pop()
            for old, new in LEGAL:
                if old is here and new not in reached:
                    reached.add(new)
                    frontier.append(new)
        assert S.ENDED in reached, start
    assert not TRANSITIONS[S.ENDED], "ENDED is final"


@pytest.mark.parametrize(
    "path",
    [
        (S.SERVING, S.ENDING, S.ENDED),  # served, then ended
        (S.ENDING, S.ENDED),  # ended before it was served
        (S.SERVING, S.FAILED, S.ENDED),  # failed while serving, then cleaned up
    ],
    ids=["served", "never-served", "failed"],
)
def test_a_run_lives_along_the_table(path: tuple[RunState, ...]) -> None:
    run = run_in(S.CREATED)
    for state in path:
        run.move_to(state)
        assert run.state is state
