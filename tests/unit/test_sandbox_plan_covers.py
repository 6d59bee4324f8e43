"""Covered trees in the bubblewrap plan (a run's: the workspace's apps folder), checked
without starting a process: where the covers go, every refusal of validate(), and a
property over drawn policy paths: a plan either is refused or hides the tree wherever a
bind shows it. The sandbox's own view: tests/integration/test_apps_folder_sandbox.py."""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gatewayd.policy.paths import PathMode
from gatewayd.sandbox.plan import (
    COGNI_TOOL_VISIBLE_DIR,
    COVER_TMPFS_BYTES,
    Bind,
    PlanError,
    PolicyMount,
    RemountRo,
    RoBind,
    SandboxPlan,
    Step,
    Tmpfs,
    render_argv,
    validate,
)
from tests.hypothesis_counts import examples
from tests.unit.test_sandbox_plan import fds_for, make_plan, within

WORKSPACE = "/srv/work/project"
APPS = f"{WORKSPACE}/apps"


def covered(**overrides: Any) -> SandboxPlan:
    return make_plan(covered_trees=(APPS,), **overrides)


def with_steps(plan: SandboxPlan, steps: list[Step]) -> SandboxPlan:
    return dataclasses.replace(plan, steps=tuple(steps))


def test_the_workspaces_apps_folder_gets_an_empty_read_only_tmpfs_after_every_bind() -> None:
    plan = covered()
    validate(plan)
    steps = list(plan.steps)
    at = steps.index(Tmpfs(dest="/workspace/apps", size_bytes=COVER_TMPFS_BYTES))
    assert steps[at + 1] == RemountRo(dest="/workspace/apps")
    binds = [i for i, s in enumerate(steps) if isinstance(s, Bind | RoBind)]
    workspace = steps.index(Bind(src=WORKSPACE, dest="/workspace"))
    assert workspace < at
    # After the workspace and every policy path; only gatewayd's own binds follow.
    assert [steps[i].dest for i in binds if i > at] == [
        COGNI_TOOL_VISIBLE_DIR,
        "/run/cogni/gateway.sock",
    ]
    argv = render_argv(plan, data_fds=fds_for(plan))
    i = argv.index("/workspace/apps")
    assert argv[i - 3 : i + 3] == [
        "--size",
        str(COVER_TMPFS_BYTES),
        "--tmpfs",
        "/workspace/apps",
        "--remount-ro",
        "/workspace/apps",
    ]


def test_a_plan_without_covered_trees_is_as_before() -> None:
    plan = make_plan()
    assert plan.covered_trees == ()
    assert not [s for s in plan.steps if s.dest.endswith("/apps")]


@pytest.mark.parametrize(
    ("mount", "cover"),
    [
        # The workspace itself, seen a second time elsewhere.
        (PolicyMount(host=WORKSPACE, visible="/mnt/again", mode=PathMode.RO), "/mnt/again/apps"),
        # A read-only tree holding the workspace.
        (PolicyMount(host="/srv/work", visible="/data/work", mode=PathMode.RO), None),
    ],
)
def test_every_bind_showing_the_folder_gets_a_cover_there(
    mount: PolicyMount, cover: str | None
) -> None:
    plan = covered(policy_paths=[mount])
    validate(plan)
    where = cover or "/data/work/project/apps"
    dests = [s.dest for s in plan.steps]
    assert dests.count(where) == 2  # its tmpfs and its remount
    assert dests.count("/workspace/apps") == 2


def test_a_plan_missing_a_cover_is_refused() -> None:
    plan = covered()
    steps = [s for s in plan.steps if s.dest != "/workspace/apps"]
    with pytest.raises(PlanError) as caught:
        validate(with_steps(plan, steps))
    assert "shows /workspace/apps, a covered tree the sandbox never sees; the plan must " in str(
        caught.value
    )


def test_a_cover_left_writable_is_refused() -> None:
    plan = covered()
    steps = [s for s in plan.steps if s != RemountRo(dest="/workspace/apps")]
    with pytest.raises(PlanError, match=r"must be made read-only by the very next step"):
        validate(with_steps(plan, steps))


def test_a_cover_that_is_not_a_tmpfs_is_refused() -> None:
    plan = covered()
    steps = [
        RoBind(src="/srv/other", dest=s.dest) if isinstance(s, Tmpfs) and s.dest.endswith("apps")
        else s
        for s in plan.steps
    ]  # fmt: skip
    with pytest.raises(PlanError, match=r"must cover it with a tmpfs after that bind"):
        validate(with_steps(plan, steps))


@pytest.mark.parametrize("dest", ["/workspace/apps/x", "/workspace/apps/x/data"])
def test_a_mount_through_the_cover_is_refused(dest: str) -> None:
    plan = covered()
    steps = list(plan.steps)
    steps.insert(len(steps) - 2, RoBind(src="/srv/other", dest=dest))
    with pytest.raises(PlanError) as caught:
        validate(with_steps(plan, steps))
    assert "mounts at or beneath /workspace/apps, through the cover" in str(caught.value)


@pytest.mark.parametrize("host", [APPS, f"{APPS}/note-taker", f"{APPS}/note-taker/data"])
def test_a_bind_of_the_folder_or_anything_in_it_is_refused(host: str) -> None:
    plan = covered(policy_paths=[PolicyMount(host=host, visible="/mnt/x", mode=PathMode.RO)])
    with pytest.raises(PlanError) as caught:
        validate(plan)
    assert f"binds {host}, at or beneath {APPS}, which the sandbox never sees" in str(caught.value)


@pytest.mark.parametrize("host", ["/srv/work", "/srv"])
def test_a_writable_bind_holding_the_folder_below_a_directory_of_its_own_is_refused(
    host: str,
) -> None:
    # /data/up/project could be renamed inside the sandbox (it is no mount point), taking
    # the folder where the host's tools, which find it by its path, would not look.
    plan = covered(policy_paths=[PolicyMount(host=host, visible="/data/up", mode=PathMode.RW)])
    with pytest.raises(PlanError) as caught:
        validate(plan)
    first = APPS[len(host) :].strip("/").split("/")[0]
    assert f"is writable and holds {APPS}, a covered tree, below a directory the sandbox " in (
        str(caught.value)
    )
    assert f"could rename ({first}): bind it read-only" in str(caught.value)
    validate(covered(policy_paths=[PolicyMount(host=host, visible="/data/up", mode=PathMode.RO)]))


@pytest.mark.parametrize("tree", ["relative/apps", "/srv/../apps", "/srv/apps/", ""])
def test_a_covered_tree_must_be_a_clean_absolute_path(tree: str) -> None:
    plan = dataclasses.replace(make_plan(), covered_trees=(tree,))
    with pytest.raises(PlanError, match=r"covered tree .* must be an absolute, normalized path"):
        validate(plan)


# --- property: drawn policy paths either are refused or the folder stays covered ---------

# Safe choices repeated so that a good share of the drawn plans validate.
HOSTS = ["/srv/work", WORKSPACE, f"{WORKSPACE}/docs", "/srv/other"] * 3 + [
    APPS, f"{APPS}/x", "/srv"
]  # fmt: skip
VISIBLE = ["/workspace/docs", "/mnt/a", "/data", "/data/b"] * 3 + [
    "/workspace/apps", "/workspace/apps/x", "/srv"
]  # fmt: skip


@st.composite
def mounts(draw: st.DrawFn) -> PolicyMount:
    return PolicyMount(
        host=draw(st.sampled_from(HOSTS)),
        visible=draw(st.sampled_from(VISIBLE)),
        mode=draw(st.sampled_from(list(PathMode))),
    )


def _covers_of(plan: SandboxPlan) -> list[tuple[int, str]]:
    """(index of the bind, where it shows the folder) for every bind holding it."""
    found = []
    for index, step in enumerate(plan.steps):
        if isinstance(step, Bind | RoBind) and step.src != APPS and within(APPS, step.src):
            found.append((index, f"{step.dest}/{APPS[len(step.src) + 1 :]}".replace("//", "/")))
    return found


@settings(max_examples=examples(300), deadline=None)
@given(st.lists(mounts(), max_size=3))
def test_any_policy_paths_are_refused_or_leave_the_folder_covered(
    drawn: list[PolicyMount],
) -> None:
    try:
        plan = covered(policy_paths=drawn)
        render_argv(plan, data_fds=fds_for(plan))
    except PlanError:
        return
    steps = plan.steps
    for step in steps:
        if isinstance(step, Bind | RoBind):
            assert not within(step.src, APPS), step  # nothing of the folder is bound
    shown = _covers_of(plan)
    assert shown  # the workspace itself always shows it
    for bind_index, where in shown:
        # The last mount at or above where it shows (a remount mounts nothing): the
        # cover, after the bind, made read-only by the next step.
        last = max(
            i for i, s in enumerate(steps) if within(where, s.dest) and not isinstance(s, RemountRo)
        )
        assert steps[last] == Tmpfs(dest=where, size_bytes=COVER_TMPFS_BYTES), (where, steps)
        assert steps[last + 1] == RemountRo(dest=where)
        assert last > bind_index
        # Nothing is mounted beneath it after the cover.
        assert not [s for s in steps[last:] if s.dest != where and within(s.dest, where)]
