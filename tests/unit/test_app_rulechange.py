"""One change to an app's rules, applied to its manifest (pure): every action, the
documented refusals with messages that help, addedBy written and read back, the caps, and
the managing tools that no wildcard grants and no app may shadow."""

from __future__ import annotations

import pytest

from gatewayd.apps.manifest import (
    MAX_ADDED_BY_CHARS,
    MAX_MANIFEST_BYTES,
    AppManifest,
    AppRule,
    AppRules,
    app_id_problem,
    parse_manifest,
)
from gatewayd.apps.rulechange import (
    MAX_LISTED_RULES,
    AppRuleChangeError,
    added_by_of,
    apply_rule_change,
    loosened_by,
    render_changed,
)
from gatewayd.cli.apps import RULE_ACTIONS
from gatewayd.policy.review_section import MAX_RULE_CHARS, MAX_RULES
from gatewayd.policy.rule_action import RuleAction
from gatewayd.policy.section import MANAGING_TOOLS, tool_pattern_matches
from gatewayd.protocol import ErrorCode
from gatewayd.review import rulebook
from tests.conftest import ROOT

NOTE_TAKER = (ROOT / "apps" / "examples" / "note-taker" / "APP.md").read_text()

SMALL = """---
name: notes
title: Notes
description: Keeps notes.
---

## System Prompt

Keep notes in data/.

## Rules

### Allow
- Reading files in data/
- Writing files in data/ <!-- addedBy: alice -->

### Deny
- Running commands
"""


@pytest.fixture
def manifest() -> AppManifest:
    return parse_manifest(SMALL, "APP.md")


def texts(manifest: AppManifest, side: str) -> list[str]:
    rules = manifest.rules.allow if side == "allow" else manifest.rules.deny
    return [rule.text for rule in rules]


def with_rules_added(
    manifest: AppManifest, *, allow: tuple[str, ...] = (), deny: tuple[str, ...] = ()
) -> AppManifest:
    """``manifest`` with these rules (no addedBy) after those of each side: what adding
    them one change at a time makes, in one step. A change validates every rule of the
    manifest again, so filling a side one change at a time takes seconds."""
    rules = AppRules(
        allow=(*manifest.rules.allow, *(AppRule(text=text) for text in allow)),
        deny=(*manifest.rules.deny, *(AppRule(text=text) for text in deny)),
    )
    return manifest.model_copy(update={"rules": rules})


# --- each action ------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("action", "rule", "allow", "deny"),
    [
        (
            RuleAction.ADD_DENY,
            "Deleting files",
            ["Reading files in data/", "Writing files in data/"],
            ["Running commands", "Deleting files"],
        ),
        (RuleAction.REMOVE_ALLOW, "Writing files in data/", ["Reading files in data/"], None),
        (
            RuleAction.ADD_ALLOW,
            "Listing the workspace",
            ["Reading files in data/", "Writing files in data/", "Listing the workspace"],
            None,
        ),
        (RuleAction.REMOVE_DENY, "Running commands", None, []),
    ],
)
def test_each_action_changes_its_side_and_nothing_else(
    manifest: AppManifest,
    action: RuleAction,
    rule: str,
    allow: list[str] | None,
    deny: list[str] | None,
) -> None:
    changed = apply_rule_change(manifest, action, rule, "bob")
    assert texts(changed, "allow") == (allow if allow is not None else texts(manifest, "allow"))
    assert texts(changed, "deny") == (deny if deny is not None else texts(manifest, "deny"))
    assert changed.model_dump(exclude={"rules"}) == manifest.model_dump(exclude={"rules"})
    assert manifest == parse_manifest(SMALL, "APP.md")  # the input is left as it was


def test_an_added_rule_carries_added_by_into_app_md_and_reads_back(
    manifest: AppManifest,
) -> None:
    changed = apply_rule_change(manifest, RuleAction.ADD_DENY, "Deleting files", "bob@example")
    text = render_changed(changed)
    assert "- Deleting files <!-- addedBy: bob@example -->" in text
    assert "- Writing files in data/ <!-- addedBy: alice -->" in text  # kept
    again = parse_manifest(text, "APP.md")
    assert again == changed
    assert again.rules.deny[-1].added_by == "bob@example"


def test_a_rule_without_added_by_is_written_without_a_marker(manifest: AppManifest) -> None:
    changed = apply_rule_change(manifest, RuleAction.ADD_DENY, "Deleting files", None)
    assert "- Deleting files\n" in render_changed(changed)


def test_the_shipped_example_survives_every_action_and_its_front_matter_is_kept() -> None:
    manifest = parse_manifest(NOTE_TAKER, "APP.md")
    changed = manifest
    for action, rule in [
        (RuleAction.ADD_DENY, "Deleting files in data/"),
        (RuleAction.REMOVE_ALLOW, "Reading files in the workspace that the caller attached"),
        (RuleAction.ADD_ALLOW, "Listing the workspace"),
        (RuleAction.REMOVE_DENY, "Running commands (exec)"),
    ]:
        changed = apply_rule_change(changed, action, rule, "ops")
        assert parse_manifest(render_changed(changed), "APP.md") == changed
    assert changed.limits == manifest.limits and changed.description == manifest.description
    assert changed.system_prompt == manifest.system_prompt


def test_a_rule_is_matched_by_its_text_with_its_lines_stripped(manifest: AppManifest) -> None:
    changed = apply_rule_change(manifest, RuleAction.REMOVE_DENY, "  Running commands \n", None)
    assert texts(changed, "deny") == []


# --- refusals ---------------------------------------------------------------------------


def test_adding_a_rule_already_there_is_an_error_saying_nothing_changed(
    manifest: AppManifest,
) -> None:
    with pytest.raises(AppRuleChangeError) as caught:
        apply_rule_change(manifest, RuleAction.ADD_ALLOW, "Reading files in data/", "bob")
    assert caught.value.code is ErrorCode.INVALID_ARGS
    assert str(caught.value) == (
        "app 'notes' already has the allow rule 'Reading files in data/'; nothing was changed"
    )


def test_the_same_text_on_the_other_side_is_not_already_there(manifest: AppManifest) -> None:
    changed = apply_rule_change(manifest, RuleAction.ADD_DENY, "Reading files in data/", None)
    assert "Reading files in data/" in texts(changed, "deny")


def test_removing_a_rule_not_there_lists_the_rules_and_the_closest(
    manifest: AppManifest,
) -> None:
    with pytest.raises(AppRuleChangeError) as caught:
        apply_rule_change(manifest, RuleAction.REMOVE_ALLOW, "Writing files in data", None)
    message = str(caught.value)
    assert caught.value.code is ErrorCode.INVALID_ARGS
    assert message.startswith("app 'notes' has no allow rule 'Writing files in data'")
    assert "(did you mean 'Writing files in data/'?)" in message
    assert "1. 'Reading files in data/'; 2. 'Writing files in data/'" in message
    assert "removed by its exact text" in message


def test_removing_from_an_empty_side_says_it_is_empty(manifest: AppManifest) -> None:
    empty = apply_rule_change(manifest, RuleAction.REMOVE_DENY, "Running commands", None)
    with pytest.raises(AppRuleChangeError, match="it has no deny rules"):
        apply_rule_change(empty, RuleAction.REMOVE_DENY, "Running commands", None)


def test_a_long_listing_is_cut_and_says_how_many_more(manifest: AppManifest) -> None:
    many = manifest
    for number in range(MAX_LISTED_RULES + 5):
        many = apply_rule_change(many, RuleAction.ADD_DENY, f"Rule number {number} " * 20, None)
    with pytest.raises(AppRuleChangeError) as caught:
        apply_rule_change(many, RuleAction.REMOVE_DENY, "zzz", None)
    message = str(caught.value)
    assert message.endswith("; and 6 more")  # 26 deny rules, 20 listed
    assert "..." in message and len(message) < 4000


def test_a_side_holds_at_most_max_rules(manifest: AppManifest) -> None:
    # One rule short of the cap, then the change that fills the side.
    last = MAX_RULES - 2
    full = with_rules_added(manifest, deny=tuple(f"Rule {number}" for number in range(last)))
    full = apply_rule_change(full, RuleAction.ADD_DENY, f"Rule {last}", None)
    assert len(full.rules.deny) == MAX_RULES
    with pytest.raises(AppRuleChangeError) as caught:
        apply_rule_change(full, RuleAction.ADD_DENY, "One more", None)
    assert str(caught.value) == (
        f"app 'notes' has {MAX_RULES} deny rules, the most an app may have ({MAX_RULES}); "
        "remove one first"
    )
    # Removing is always possible, and the other side has room.
    apply_rule_change(full, RuleAction.REMOVE_DENY, "Rule 0", None)
    apply_rule_change(full, RuleAction.ADD_ALLOW, "One more", None)


@pytest.mark.parametrize(
    ("rule", "reason"),
    [
        ("Allow all <!-- and everything else -->", "HTML"),
        ("Reading [data/](data/ 'also deleting')", "link"),
        ("Two\n\nparagraphs", "more than one paragraph"),
        ("Zero\u200bwidth", "invisible"),
        ("x" * (MAX_RULE_CHARS + 1), f"at most {MAX_RULE_CHARS} characters"),
        ("   ", "empty"),
    ],
)
def test_a_rule_app_md_cannot_hold_as_read_is_refused_naming_why(
    manifest: AppManifest, rule: str, reason: str
) -> None:
    with pytest.raises(AppRuleChangeError) as caught:
        apply_rule_change(manifest, RuleAction.ADD_DENY, rule, "bob")
    assert str(caught.value).startswith("the rule cannot be written to the APP.md of app 'notes'")
    assert reason.lower() in str(caught.value).lower()


def test_an_added_by_the_marker_cannot_hold_is_refused(manifest: AppManifest) -> None:
    with pytest.raises(AppRuleChangeError, match=r"^addedBy cannot be written"):
        apply_rule_change(manifest, RuleAction.ADD_DENY, "Deleting files", "a -- b")


def test_a_change_that_makes_app_md_too_large_is_refused(manifest: AppManifest) -> None:
    rules = [
        f"{number:04d} " + "y" * (MAX_RULE_CHARS - 5)
        for number in range(MAX_MANIFEST_BYTES // MAX_RULE_CHARS)
    ]
    # Every rule but the last in one step, alternately allow and deny (within MAX_RULES
    # per side), then the change that makes APP.md too large.
    *first, last = rules
    big = with_rules_added(manifest, allow=tuple(first[0::2]), deny=tuple(first[1::2]))
    side = RuleAction.ADD_DENY if len(first) % 2 else RuleAction.ADD_ALLOW
    big = apply_rule_change(big, side, last, None)
    with pytest.raises(AppRuleChangeError) as caught:
        render_changed(big)
    message = str(caught.value)
    assert message.startswith("with this change the APP.md of app 'notes' would not be valid")
    assert f"larger than {MAX_MANIFEST_BYTES} bytes" in message
    assert message.endswith("nothing was changed")


# --- addedBy from a run's actor ---------------------------------------------------------


@pytest.mark.parametrize(
    ("actor", "marker"),
    [
        ("alice", "alice"),
        ("ci-bot@example.com", "ci-bot@example.com"),
        ("agent:build/42", "agent-build-42"),
        ("a -- b", "a-b"),  # never '--', which would end the HTML comment
        ("evil --> <script>", "evil-script"),
        ("line\nbreak", "line-break"),
        ("x" * 500, "x" * MAX_ADDED_BY_CHARS),
        ("::::", None),
        ("", None),
    ],
)
def test_an_actor_becomes_a_marker_app_md_can_hold(actor: str, marker: str | None) -> None:
    assert added_by_of(actor) == marker
    if marker is not None:
        manifest = parse_manifest(SMALL, "APP.md")
        changed = apply_rule_change(manifest, RuleAction.ADD_DENY, "Deleting", marker)
        assert parse_manifest(render_changed(changed), "APP.md").rules.deny[-1].added_by == marker


# --- the actions, and the tools that manage apps ----------------------------------------


def test_the_actions_and_their_asymmetry() -> None:
    assert [(a.value, a.loosens, a.side, a.adds) for a in RuleAction] == [
        ("add_deny", False, "deny", True),
        ("remove_allow", False, "allow", False),
        ("add_allow", True, "allow", True),
        ("remove_deny", True, "deny", False),
    ]
    assert rulebook.RuleAction is RuleAction  # the review rules use the same actions
    assert tuple(str(a) for a in RuleAction) == RULE_ACTIONS  # and the CLI's copy


@pytest.mark.parametrize("tool", sorted(MANAGING_TOOLS))
@pytest.mark.parametrize("pattern", ["app_*", "install_*", "app.*"])
def test_no_wildcard_grants_a_tool_that_manages_apps(pattern: str, tool: str) -> None:
    assert not tool_pattern_matches(pattern, tool)
    assert tool_pattern_matches(tool, tool)  # its exact name does


def test_the_managing_tools_are_the_tools_admin_tools_makes() -> None:
    from gatewayd.apps.admintools import APP_RULES_TOOL, INSTALL_APP_TOOL

    assert {APP_RULES_TOOL, INSTALL_APP_TOOL} == MANAGING_TOOLS


def test_app_star_still_matches_every_app_tool() -> None:
    assert tool_pattern_matches("app_*", "app_note_taker")
    assert tool_pattern_matches("app_*", "app_rules_reviewer")  # an app, not the tool


def test_no_app_may_take_a_managing_tool_s_name() -> None:
    problem = app_id_problem("rules")
    assert problem is not None
    assert "reserved" in problem and "app_rules" in problem and "choose another id" in problem
    text = SMALL.replace("name: notes", "name: rules")
    with pytest.raises(Exception, match="reserved"):
        parse_manifest(text, "APP.md")


# --- what a replacement loosens ---------------------------------------------------------


@pytest.mark.parametrize(
    ("edit", "added", "dropped"),
    [
        ((), (), ()),
        (("Keep notes in data/.", "Keep all notes in data/."), (), ()),  # no rule
        (("- Running commands\n", "- Running commands\n- More\n"), (), ()),  # tighter
        (("- Reading files in data/\n", ""), (), ()),  # an allow rule dropped: tighter
        (("- Reading files in data/\n", "- Reading files\n"), ("Reading files",), ()),
        (("- Running commands\n", ""), (), ("Running commands",)),
        (("- Running commands\n", "- Running some commands\n"), (), ("Running commands",)),
    ],
)
def test_a_replacement_loosens_by_the_allow_rules_it_adds_and_deny_rules_it_drops(
    edit: tuple[str, str], added: tuple[str, ...], dropped: tuple[str, ...]
) -> None:
    old = parse_manifest(SMALL, "APP.md")
    new = parse_manifest(SMALL.replace(*edit) if edit else SMALL, "APP.md")
    assert loosened_by(old, new) == (added, dropped)
