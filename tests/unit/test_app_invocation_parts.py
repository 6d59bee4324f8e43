"""The pure parts of an app's invocation: its arguments, the child's review rules and
prompt, the app's sandbox plan (its own folder beneath the covered apps folder, the
workspace read-only), the conversation's path base and the data folder's change list."""

from __future__ import annotations

import dataclasses
from typing import Any

import msgspec
import pytest

from gatewayd.apps.invoke import MAX_ATTACHMENTS, MAX_PROMPT_CHARS, _changed, _decode
from gatewayd.conversation import ConversationLimits, rebase_path
from gatewayd.errors import ArgumentsRejected
from gatewayd.policy.paths import PathMode
from gatewayd.policy.review_section import ReviewSection
from gatewayd.review.prompt import build_review_prompt
from gatewayd.review.ruleset import RuleSet, ruleset_hash
from gatewayd.sandbox.plan import (
    COVER_TMPFS_BYTES,
    SANDBOX_SOCKET,
    Bind,
    PlanError,
    PolicyMount,
    RemountRo,
    RoBind,
    Tmpfs,
    validate,
)
from tests.unit.test_sandbox_plan import make_plan

WORKSPACE = "/srv/work/project"
APPS = f"{WORKSPACE}/apps"
APP = f"{APPS}/note-taker"


# --- the tool's arguments --------------------------------------------------------------


def test_a_prompt_and_workspace_attachments_decode() -> None:
    args = _decode({"prompt": "note: x", "attachments": ["docs/a.md", "/workspace/b.md"]})
    assert args.prompt == "note: x" and args.attachments == ("docs/a.md", "/workspace/b.md")


@pytest.mark.parametrize(
    ("raw", "words"),
    [
        ({}, "prompt"),
        ({"prompt": "   "}, "prompt: tell the app what to do (it is empty)"),
        ({"prompt": "x" * (MAX_PROMPT_CHARS + 1)}, f"at most {MAX_PROMPT_CHARS} characters"),
        (
            {"prompt": "x", "attachments": ["a"] * (MAX_ATTACHMENTS + 1)},
            f"at most {MAX_ATTACHMENTS} paths",
        ),
        ({"prompt": "x", "attachments": ["/etc/passwd"]}, "is not a path in the workspace"),
        ({"prompt": "x", "attachments": ["../outside"]}, "is not a path in the workspace"),
        ({"prompt": "x", "attachments": ["/workspace/../etc"]}, "is not a path in the workspace"),
        ({"prompt": "x", "extra": 1}, "unknown field"),
        ({"prompt": 5}, "Expected `str`"),
    ],
)
def test_bad_arguments_are_refused_naming_the_field(raw: dict[str, Any], words: str) -> None:
    with pytest.raises(ArgumentsRejected) as caught:
        _decode(raw)
    assert words in str(caught.value)


# --- the review under the app's rules ---------------------------------------------------

SECTION = ReviewSection.model_validate(
    {"mode": "llm", "model": "reviewer", "rules": {"allow": ["Writing in data/"], "deny": []}}
)


def test_the_reviewer_is_told_whose_rules_it_applies() -> None:
    rules = RuleSet.from_section(SECTION, subject='the app "note-taker"')
    prompt = build_review_prompt("fs.write", {"path": "/app/data/x"}, rules)
    assert 'the app "note-taker", an AI agent' in prompt.system
    assert 'These are the rules of the app "note-taker".' in prompt.system
    assert "Writing in data/" in prompt.system


def test_each_app_has_its_own_decisions_even_with_the_same_rules() -> None:
    # The decision cache is keyed by the rule set's hash: two apps never share a verdict.
    one = ruleset_hash(SECTION, subject='the app "a"')
    other = ruleset_hash(SECTION, subject='the app "b"')
    assert len({one, other, ruleset_hash(SECTION)}) == 3
    # A policy's hash is what it was before apps had subjects.
    assert RuleSet.from_section(SECTION).digest == ruleset_hash(SECTION)


# --- the app's sandbox -------------------------------------------------------------------

APP_MOUNTS = [
    PolicyMount(host=APP, visible="/app", mode=PathMode.RO),
    PolicyMount(host=f"{APP}/data", visible="/app/data", mode=PathMode.RW),
]


def app_plan(**overrides: Any) -> Any:
    kwargs: dict[str, Any] = {
        "policy_paths": APP_MOUNTS,
        "covered_trees": (APPS,),
        "exposed_trees": (APP,),
        "workspace_read_only": True,
        "cwd": "/app",
    }
    kwargs.update(overrides)
    return make_plan(**kwargs)


def test_the_app_sees_its_folder_the_workspace_read_only_and_the_apps_folder_covered() -> None:
    plan = app_plan()
    validate(plan)
    steps = list(plan.steps)
    assert RoBind(src=WORKSPACE, dest="/workspace") in steps
    assert Bind(src=WORKSPACE, dest="/workspace") not in steps
    assert RoBind(src=APP, dest="/app") in steps
    assert Bind(src=f"{APP}/data", dest="/app/data") in steps
    assert any(step.dest == "/workspace/apps" for step in steps)  # the cover is still there
    assert plan.cwd == "/app"


def test_without_its_exposure_the_app_folder_may_not_be_bound() -> None:
    with pytest.raises(PlanError, match="which the sandbox never sees"):
        validate(app_plan(exposed_trees=()))


def test_an_exposure_shows_only_its_own_tree() -> None:
    other = PolicyMount(host=f"{APPS}/other", visible="/other", mode=PathMode.RO)
    with pytest.raises(PlanError, match="which the sandbox never sees"):
        validate(app_plan(policy_paths=[*APP_MOUNTS, other]))


@pytest.mark.parametrize("exposed", [APPS, WORKSPACE, "/srv/elsewhere", f"{APP}/../x"])
def test_an_exposed_tree_must_lie_strictly_beneath_a_covered_one(exposed: str) -> None:
    with pytest.raises(PlanError, match="strictly beneath a covered tree"):
        validate(app_plan(exposed_trees=(exposed,)))


def test_a_plan_that_drops_the_exposure_check_is_refused() -> None:
    plan = app_plan()
    forged = dataclasses.replace(plan, exposed_trees=(APPS,))
    with pytest.raises(PlanError):
        validate(forged)


# --- the conversation's paths and the change list ---------------------------------------


@pytest.mark.parametrize(
    ("args", "listing", "expected"),
    [
        ({"path": "data/n.md"}, False, {"path": "/app/data/n.md"}),
        ({"path": "/workspace/x"}, False, {"path": "/workspace/x"}),
        ({"path": "../workspace/x"}, False, {"path": "/app/../workspace/x"}),
        ({"path": ""}, False, {"path": "/app"}),
        ({}, True, {"path": "/app"}),
        ({}, False, {}),
        ({"path": 5}, False, {"path": 5}),
    ],
)
def test_relative_paths_start_at_the_base(
    args: dict[str, Any], listing: bool, expected: dict[str, Any]
) -> None:
    assert rebase_path(args, "/app", listing=listing) == expected


def test_the_change_list_holds_added_changed_and_removed_entries_not_directory_times() -> None:
    file, directory = 0o100000, 0o040000
    before = {"a.md": (file, 1, 1), "b.md": (file, 1, 1), "d": (directory, 0, 1)}
    after = {"a.md": (file, 2, 2), "c.md": (file, 1, 1), "d": (directory, 0, 9)}
    assert _changed(before, after) == ["a.md", "b.md", "c.md"]


def test_conversation_limits_must_be_positive() -> None:
    with pytest.raises(ValueError, match="positive"):
        ConversationLimits(turns=0, tokens=1, wall_s=1)
    with pytest.raises(ValueError, match="at least 1"):
        ConversationLimits(turns=1, tokens=1, wall_s=1, tool_calls=0)


def test_the_arguments_schema_is_what_tools_list_shows() -> None:
    from gatewayd.apps.invoke import _ARGS_SCHEMA

    definition = _ARGS_SCHEMA["$defs"]["AppArgs"]
    assert definition["required"] == ["prompt"]
    assert set(definition["properties"]) == {"prompt", "attachments"}
    assert msgspec.json.encode(_ARGS_SCHEMA)


@pytest.mark.parametrize(
    ("patterns", "ids", "expected"),
    [
        (("app_*",), None, True),
        (("app_note_taker",), None, True),
        (("*",), None, True),
        (("fs.*", "model.chat"), None, False),
        (("app_*",), ("fs.read",), False),
        (("app_*",), ("fs.read", "app_note_taker"), True),
    ],
)
def test_the_chat_endpoint_runs_for_a_run_that_may_call_apps(
    patterns: tuple[str, ...], ids: tuple[str, ...] | None, expected: bool
) -> None:
    from gatewayd.policy import RunRules
    from gatewayd.runs.services import may_call_apps

    rules = RunRules(tool_patterns=patterns, run_tool_ids=ids, grants=())
    assert may_call_apps(rules) is expected


def test_an_app_whose_caller_reads_part_of_the_workspace_sees_only_that_part() -> None:
    docs = PolicyMount(host=f"{WORKSPACE}/docs", visible="/workspace/docs", mode=PathMode.RO)
    plan = app_plan(policy_paths=[docs, *APP_MOUNTS], whole_workspace=False)
    validate(plan)
    steps = list(plan.steps)
    assert not [s for s in steps if isinstance(s, Bind | RoBind) and s.src == WORKSPACE]
    at = steps.index(Tmpfs(dest="/workspace", size_bytes=COVER_TMPFS_BYTES))
    shown = steps.index(RoBind(src=f"{WORKSPACE}/docs", dest="/workspace/docs"))
    closed = steps.index(RemountRo(dest="/workspace"))
    assert at < shown < closed


def test_an_apps_sandbox_has_no_run_socket_and_a_plan_must_agree() -> None:
    plan = app_plan(gateway_socket=False)
    validate(plan)
    assert not [s for s in plan.steps if s.dest == SANDBOX_SOCKET]
    (socket,) = [s for s in app_plan().steps if s.dest == SANDBOX_SOCKET]
    with pytest.raises(PlanError, match="must not mount it"):
        validate(dataclasses.replace(plan, steps=(*plan.steps, socket)))
    with pytest.raises(PlanError, match="must mount it once"):
        validate(dataclasses.replace(plan, gateway_socket=True))


# --- the app's models, as its caller grants them ----------------------------------------


def caller_with(policy_yaml: str) -> Any:
    from pathlib import Path

    import trio

    from gatewayd.policy import RunRules, TokenBucket
    from gatewayd.policy.model import load_policy_text
    from gatewayd.runs import Grant, Run, RunRequest, RunSpec

    policy = load_policy_text(policy_yaml, "caller.yaml")
    request = RunRequest(
        workspacePath="/w",
        policy="caller",
        actorId="a",
        tenantId="t",
        grant=Grant(allowSandbox=True),
    )
    spec = RunSpec(
        runId="r" * 32,
        request=request,
        workspace=Path("/w"),
        policy=policy,
        policy_source="caller.yaml",
        grants=(),
        rules=RunRules(tool_patterns=(), run_tool_ids=None, grants=()),
    )
    return Run(
        spec=spec,
        directory=Path("/r"),
        socket_path=Path("/r/s"),
        bucket=TokenBucket(rate=1.0, burst=1),
        limiter=trio.CapacityLimiter(1),
    )


def manifest_with(front: str) -> Any:
    from gatewayd.apps.manifest import parse_manifest

    return parse_manifest(
        f"---\nname: notes\ntitle: Notes\ndescription: Notes.\n{front}---\n\n"
        "## System Prompt\n\nKeep notes.\n\n## Rules\n\n### Allow\n- Reading\n\n### Deny\n",
        "APP.md",
    )


GRANTS_MODEL = "version: 1\nname: caller\nmodel_access: {models: [m]}\n"
KNOWN = frozenset({"m", "r"})


@pytest.mark.parametrize(
    ("front", "policy", "known", "words"),
    [
        (
            "",
            "version: 1\nname: caller\n",
            KNOWN,
            "names no model, and this run's policy grants none",
        ),
        ("model: other\n", GRANTS_MODEL, KNOWN, "which this run's policy does not grant"),
        ("", GRANTS_MODEL, KNOWN, "has no reviewer: every call of an app is reviewed"),
        (
            "review_model: m\n",
            GRANTS_MODEL,
            frozenset({"r"}),
            "model alias 'm' of app 'notes' is not in",
        ),
    ],
)
def test_an_app_that_cannot_run_for_its_caller_says_why(
    front: str, policy: str, known: frozenset[str], words: str
) -> None:
    from gatewayd.apps.child import AppUnavailable, app_models

    with pytest.raises(AppUnavailable) as caught:
        app_models(manifest_with(front), caller_with(policy), known)
    assert words in str(caught.value)


def test_the_callers_review_model_reviews_an_app_that_names_none() -> None:
    from gatewayd.apps.child import app_models

    policy = GRANTS_MODEL + 'review: {mode: "off", model: r}\n'
    models = app_models(manifest_with(""), caller_with(policy), KNOWN)
    assert (models.model, models.reviewer) == ("m", "r")
