"""`gatewayd review replay`: recorded calls reviewed afresh under a policy's rules by a real
OpenAI-compatible server on loopback (tests/fakeprovider.py), through litellm.

The runner and the CLI are driven in-process (litellm is imported once for the module);
one test runs the real `gatewayd` binary for its exit status, output and progress line.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import pytest
import yaml

from gatewayd import model_client
from gatewayd.cli import main
from gatewayd.cli.command import EXIT_FAILED, EXIT_OK, EXIT_USAGE
from gatewayd.config import ModelAlias
from gatewayd.policy import load_policy_text
from gatewayd.policy.review_section import ReviewSection
from gatewayd.review.replay import (
    CallResult,
    CallsFileError,
    Check,
    RecordedCall,
    ReplaySource,
    load_calls,
    parse_calls,
    percentile,
    replay_calls,
    replay_reviewer,
    summarize_results,
)
from gatewayd.review.reviewer import Reviewer, ReviewOutcome
from gatewayd.review.ruleset import RuleSet
from gatewayd.tools import builtin_tools
from tests.fakeprovider import FakeProvider, HttpError, Malformed, Reply, Text

KEY_ENV = "COGNI_TEST_REPLAY_KEY"
KEY = "sk-replay-host-only-0123456789"
GATEWAYD = str(Path(sys.executable).parent / "gatewayd")

POLICY = """
version: 1
name: replayed
tools:
  allow: [time.now, "fs.*"]
review:
  mode: llm
  model: reviewer
  timeout_s: 5
  tools: ["fs.*"]
  rules:
    allow: [Reading any file in the workspace, Writing Markdown notes]
    deny: [Writing anything that looks like a credential]
  structured:
    - {effect: deny, tool: "fs.*", path: "/workspace/.git/**", reason: git internals stay put}
    - {effect: allow, tool: fs.stat, skip_model: true}
"""


@pytest.fixture(scope="module", autouse=True)
def _litellm_loaded() -> None:
    """Pay litellm's import once for the whole module."""
    model_client.preload()


@pytest.fixture
def fake(monkeypatch: pytest.MonkeyPatch) -> Iterator[FakeProvider]:
    monkeypatch.setenv(KEY_ENV, KEY)
    with FakeProvider() as provider:
        provider.respond = by_content
        yield provider


def by_content(body: Mapping[str, Any]) -> Reply:
    """The reviewer the tests talk to: denies a call whose arguments mention a secret,
    fails on one that asks for it."""
    call = body["messages"][-1]["content"]
    if "PROVIDER-FAILS" in call:
        return HttpError(status=500)
    if "SECRET" in call:
        return Text(content="DENY: looks like a credential")
    return Text(content="ALLOW")


def section_of(text: str = POLICY) -> ReviewSection:
    return load_policy_text(textwrap.dedent(text), "test").review


def models_for(fake: FakeProvider) -> dict[str, ModelAlias]:
    alias = ModelAlias(
        provider="openai", model="fake-reviewer", api_base=fake.api_base, api_key_env=KEY_ENV
    )
    return {"reviewer": alias}


def jsonl(*calls: Mapping[str, Any]) -> str:
    return "".join(json.dumps(call) + "\n" for call in calls)


def calls_of(*calls: Mapping[str, Any]) -> tuple[RecordedCall, ...]:
    return parse_calls(jsonl(*calls), tools=builtin_tools())


async def replay(
    fake: FakeProvider, *calls: Mapping[str, Any], concurrency: int = 4
) -> tuple[CallResult, ...]:
    reviewer = replay_reviewer(models_for(fake))
    return await replay_calls(calls_of(*calls), reviewer, section_of(), concurrency=concurrency)


def read(path: str, expect: str | None = None) -> dict[str, Any]:
    call: dict[str, Any] = {"tool": "fs.read", "args": {"path": path}}
    return call | ({"expect": expect} if expect else {})


def write(content: str, expect: str | None = None, **extra: Any) -> dict[str, Any]:
    call: dict[str, Any] = {
        "tool": "fs.write",
        "args": {"path": "/workspace/out.md", "content": content},
    }
    return call | ({"expect": expect} if expect else {}) | extra


# --- the calls file (pure) ---------------------------------------------------------------


def test_calls_file_gives_tool_args_expect_id_note_and_skips_blank_and_comment_lines() -> None:
    text = (
        "# a week of agent traffic\n\n"
        '{"tool": "fs.read", "args": {"path": "a.md"}, "expect": "allow", "id": "c1"}\n'
        "   \n"
        '{"tool": "time.now", "args": {}, "id": 7, "note": "the clock"}\n'
    )

    calls = parse_calls(text)

    assert calls == (
        RecordedCall(line=3, tool="fs.read", args={"path": "a.md"}, expect="allow", id="c1"),
        RecordedCall(line=5, tool="time.now", args={}, id="7", note="the clock"),
    )


def test_calls_file_with_bad_lines_is_refused_naming_every_line_and_what_is_wrong() -> None:
    text = "\n".join(
        [
            '{"tool": "fs.read", "args": {"path": "a.md"}}',  # 1: good
            "{not json",  # 2
            "[1, 2]",  # 3
            '{"tool": "fs.read"}',  # 4
            '{"tool": "fs.read", "args": {}, "expected": "deny"}',  # 5: a typo'd key
            '{"tool": "fs.read", "args": {}, "expect": "DENY"}',  # 6
            '{"tool": "FS READ", "args": {}}',  # 7
            '{"tool": "fs.read", "args": [1]}',  # 8
            '{"tool": "fs.read", "tool": "fs.write", "args": {}}',  # 9
            '{"tool": "fs.read", "args": {"n": NaN}}',  # 10
        ]
    )

    with pytest.raises(CallsFileError) as caught:
        parse_calls(text, "calls.jsonl")

    problems = caught.value.problems
    assert [p.split(":")[0] for p in problems] == [f"line {n}" for n in range(2, 11)]
    assert "not valid JSON" in problems[0]
    assert "a call is a JSON object, not an array" in problems[1]
    assert "'args' is missing" in problems[2]
    assert "unknown key 'expected'; a call has tool, args, expect, id, note" in problems[3]
    assert '\'expect\' must be "allow" or "deny", not "DENY"' in problems[4]
    assert "dotted lowercase tool name" in problems[5]
    assert "'args' must be a JSON object, not an array" in problems[6]
    assert "key 'tool' appears twice" in problems[7]
    assert "NaN is not a JSON number" in problems[8]
    assert str(caught.value).startswith("calls.jsonl: line 2: ")


def test_arguments_of_a_known_tool_get_its_defaults_and_refused_arguments_are_a_bad_line() -> None:
    [listed] = parse_calls('{"tool": "fs.list", "args": {}}', tools=builtin_tools())
    assert listed.args == {"path": ".", "pattern": "*", "limit": 1000}
    # A tool this gatewayd does not have keeps its arguments as written.
    [other] = parse_calls('{"tool": "git.status", "args": {"u": 1}}', tools=builtin_tools())
    assert other.args == {"u": 1}

    with pytest.raises(CallsFileError) as caught:
        parse_calls('{"tool": "fs.read", "args": {"path": 3}}', tools=builtin_tools())
    [problem] = caught.value.problems
    assert problem.startswith("line 1: the gateway would refuse these arguments before any review")


def test_a_file_without_calls_is_refused_with_an_example_of_a_call() -> None:
    with pytest.raises(CallsFileError, match=r'one JSON object a line, e\.g\. \{"tool"'):
        parse_calls("# only a comment\n\n")


def test_a_non_utf8_calls_file_is_refused_naming_the_line(tmp_path: Path) -> None:
    path = tmp_path / "calls.jsonl"
    path.write_bytes(b'{"tool": "time.now", "args": {}}\n{"tool": "fs.read\xff"}\n')

    with pytest.raises(CallsFileError, match=r"calls.jsonl: line 2: not UTF-8 text"):
        load_calls(path)


def test_percentile_is_nearest_rank() -> None:
    values = [float(v) for v in range(1, 11)]
    assert percentile(values, 0.5) == 5.0
    assert percentile(values, 0.9) == 9.0
    assert percentile([42.0], 0.9) == 42.0


# --- the runner against the fake provider ------------------------------------------------


async def test_agreement_false_allows_and_false_denies_are_counted_apart(
    fake: FakeProvider,
) -> None:
    results = await replay(
        fake,
        write("SECRET=1", "deny"),  # denied as expected
        read("/workspace/notes.md", "allow"),  # allowed as expected
        write("innocent looking", "deny"),  # allowed: a false allow
        read("/workspace/SECRET.md", "allow"),  # denied: a false deny
        read("/workspace/other.md"),  # no expectation
    )
    summary = summarize_results(results)

    assert [r.check for r in results] == [
        Check.MATCH,
        Check.MATCH,
        Check.FALSE_ALLOW,
        Check.FALSE_DENY,
        Check.UNCHECKED,
    ]
    assert (summary.total, summary.allowed, summary.denied) == (5, 3, 2)
    assert (summary.expected, summary.agreed, summary.agreement) == (4, 2, 0.5)
    assert [r.index for r in summary.false_allows] == [3]
    assert [r.index for r in summary.false_denies] == [4]
    assert results[0].reason == "looks like a credential"
    assert not summary.failed and not summary.passed
    assert summary.by_source == {ReplaySource.MODEL: 5}
    assert summary.latency is not None and summary.latency.count == 5
    assert 0 < summary.latency.median_ms <= summary.latency.p90_ms <= summary.latency.max_ms
    assert (summary.prompt_tokens, summary.completion_tokens) == (5 * 11, 5 * 7)


async def test_a_failed_review_counts_as_failed_never_as_agreement(fake: FakeProvider) -> None:
    fake.script(
        HttpError(status=500),
        Malformed(),
        Text(content="I think this is probably fine"),
    )

    results = await replay(fake, write("a", "deny"), write("b", "deny"), write("c"), concurrency=1)
    summary = summarize_results(results)

    assert [r.source for r in results] == [ReplaySource.FAILED] * 3
    assert [r.check for r in results] == [Check.FAILED] * 3
    assert [r.index for r in summary.failed] == [1, 2, 3]
    assert (summary.denied, summary.expected, summary.agreed) == (3, 2, 0)
    assert "HTTP 500" in results[0].reason
    assert results[2].reason == "unparseable review"
    assert summary.latency is None  # no model answer to time
    assert not summary.passed


async def test_structured_rules_decide_without_asking_the_model(fake: FakeProvider) -> None:
    results = await replay(
        fake,
        read("/workspace/.git/config", "deny"),
        {"tool": "fs.stat", "args": {"path": "/workspace/a.md"}, "expect": "allow"},
    )

    assert fake.chat_requests == []
    assert [(r.source, r.verdict, r.check) for r in results] == [
        (ReplaySource.STRUCTURED, "deny", Check.MATCH),
        (ReplaySource.STRUCTURED, "allow", Check.MATCH),
    ]
    assert results[0].reason == "git internals stay put"
    assert summarize_results(results).passed


async def test_a_tool_outside_the_review_passes_unreviewed_so_an_expected_deny_is_a_false_allow(
    fake: FakeProvider,
) -> None:
    [result] = await replay(fake, {"tool": "time.now", "args": {}, "expect": "deny"})

    assert fake.chat_requests == []
    assert (result.source, result.verdict, result.check) == (
        ReplaySource.UNREVIEWED,
        "allow",
        Check.FALSE_ALLOW,
    )


async def test_every_call_is_reviewed_afresh_even_when_repeated(fake: FakeProvider) -> None:
    results = await replay(fake, write("same"), write("same"), write("same"))

    assert len(fake.chat_requests) == 3
    assert {r.source for r in results} == {ReplaySource.MODEL}


class RecordingReviewer(Reviewer):
    """Remembers the order reviews finish in."""

    finished: list[str]

    async def review(
        self, tool: str, args: Mapping[str, Any], section: ReviewSection, rules: RuleSet
    ) -> ReviewOutcome | None:
        outcome = await super().review(tool, args, section, rules)
        self.finished.append(args["content"])
        return outcome


async def test_results_keep_the_files_order_when_answers_come_out_of_order(
    fake: FakeProvider,
) -> None:
    count = 8

    def slower_first(body: Mapping[str, Any]) -> Reply:
        call = body["messages"][-1]["content"]
        n = next(i for i in range(count) if f"call-{i}." in call)
        return Text(content=f"DENY: call {n}", delay_s=0.04 * (count - n))

    fake.respond = slower_first
    reviewer = RecordingReviewer(models_for(fake), cache_entries=0)
    reviewer.finished = []
    calls = calls_of(*(write(f"call-{n}.") for n in range(count)))

    results = await replay_calls(calls, reviewer, section_of(), concurrency=4)

    assert reviewer.finished != sorted(reviewer.finished)  # they did finish out of order
    assert [r.index for r in results] == list(range(1, count + 1))
    assert [r.reason for r in results] == [f"call {n}" for n in range(count)]
    assert [r.call.args["content"] for r in results] == [f"call-{n}." for n in range(count)]


async def test_progress_is_reported_after_every_review(fake: FakeProvider) -> None:
    seen: list[tuple[int, int]] = []
    reviewer = replay_reviewer(models_for(fake))

    await replay_calls(
        calls_of(write("a"), write("b"), write("c")),
        reviewer,
        section_of(),
        on_progress=lambda done, total: seen.append((done, total)),
    )

    assert seen == [(1, 3), (2, 3), (3, 3)]


async def test_a_concurrency_outside_its_range_is_refused(fake: FakeProvider) -> None:
    reviewer = replay_reviewer(models_for(fake))
    for bad in (0, 65):
        with pytest.raises(ValueError, match=r"concurrency must be 1\.\.64"):
            await replay_calls(calls_of(write("a")), reviewer, section_of(), concurrency=bad)


# --- the command line --------------------------------------------------------------------


@pytest.fixture
def files(tmp_path: Path, fake: FakeProvider) -> Path:
    """A policy, a configuration pointing at the fake, and a calls file in ``tmp_path``."""
    (tmp_path / "policy.yaml").write_text(textwrap.dedent(POLICY))
    config = {"models": {name: a.model_dump() for name, a in models_for(fake).items()}}
    (tmp_path / "gatewayd.yaml").write_text(yaml.safe_dump(config))
    (tmp_path / "calls.jsonl").write_text(
        jsonl(write("SECRET=1", "deny"), read("/workspace/notes.md", "allow"))
    )
    return tmp_path


def replay_args(base: Path, *extra: str, calls: str = "calls.jsonl") -> list[str]:
    return [
        "review",
        "replay",
        str(base / calls),
        "--policy",
        str(base / "policy.yaml"),
        "--config",
        str(base / "gatewayd.yaml"),
        *extra,
    ]


def test_cli_exits_0_and_prints_the_table_and_summary_when_every_verdict_matches(
    files: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    # The table fits the terminal's width: a wide one, whatever runs the tests (an
    # xdist worker may inherit a narrow terminal).
    monkeypatch.setenv("COLUMNS", "200")
    status = main(replay_args(files))

    out = capsys.readouterr().out
    assert status == EXIT_OK
    lines = out.splitlines()
    assert lines[0].split() == [
        "#", "tool", "expect", "verdict", "source", "ms", "check", "reason",
    ]  # fmt: skip
    number, tool, expect, verdict, source, ms, check, *reason = lines[1].split()
    assert (number, tool, expect, verdict, source, check) == (
        "1", "fs.write", "deny", "deny", "model", "ok",
    )  # fmt: skip
    assert float(ms) >= 0 and " ".join(reason) == "looks like a credential"
    assert "agreement: 2/2 calls with an expected verdict (100.0%)" in out
    assert "result: PASS" in out


def test_cli_json_output_has_every_result_and_the_summary(
    files: Path, fake: FakeProvider, capsys: pytest.CaptureFixture[str]
) -> None:
    fake.script(Text(content="ALLOW"), Text(content="ALLOW"))

    status = main(replay_args(files, "--json", "--concurrency", "1"))

    document = json.loads(capsys.readouterr().out)
    assert status == EXIT_FAILED
    assert document["policy"] == "replayed" and document["concurrency"] == 1
    assert [(r["index"], r["verdict"], r["check"]) for r in document["results"]] == [
        (1, "allow", "false_allow"),
        (2, "allow", "match"),
    ]
    summary = document["summary"]
    assert summary["falseAllows"] == [1] and summary["passed"] is False
    assert summary["agreement"] == 0.5 and summary["latencyMs"]["count"] == 2


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ("bad-calls", "line 2: 'args' is missing"),
        ("unknown-policy", "no policy named 'nosuch'"),
        ("review-off", "has review.mode off; a replay evaluates a policy with review.mode: llm"),
        ("no-alias", "model alias 'reviewer', which gatewayd's configuration does not define"),
        ("no-key", f"has no key here: the environment variable {KEY_ENV} that holds its key"),
        ("bad-credential", f"{KEY_ENV} that holds its key ({KEY_ENV}) is not UTF-8 text"),
        ("concurrency", "--concurrency must be 1..64, not 0"),
        ("no-config", "cannot read the configuration"),
    ],
)
def test_cli_exits_2_without_reviewing_anything_when_the_replay_cannot_start(
    files: Path,
    fake: FakeProvider,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    change: str,
    message: str,
) -> None:
    argv = replay_args(files)
    if change == "bad-calls":
        (files / "calls.jsonl").write_text(jsonl(write("a")) + '{"tool": "fs.read"}\n')
    elif change == "unknown-policy":
        argv[argv.index("--policy") + 1] = "nosuch"
    elif change == "review-off":
        (files / "policy.yaml").write_text("version: 1\nname: plain\n")
    elif change == "no-alias":
        (files / "gatewayd.yaml").write_text("models: {}\n")
    elif change == "no-key":
        monkeypatch.delenv(KEY_ENV)
    elif change == "bad-credential":  # the daemon's second place: a systemd credential
        monkeypatch.delenv(KEY_ENV)
        (files / KEY_ENV).write_bytes(b"\xff\xfe")
        monkeypatch.setenv("CREDENTIALS_DIRECTORY", str(files))
    elif change == "concurrency":
        argv += ["--concurrency", "0"]
    elif change == "no-config":
        (files / "gatewayd.yaml").unlink()

    status = main(argv)

    captured = capsys.readouterr()
    assert status == EXIT_USAGE
    assert captured.out == ""
    assert captured.err.startswith("gatewayd review replay: ")
    assert message in captured.err
    assert fake.chat_requests == []


def test_gatewayd_binary_exits_1_on_a_false_allow_or_failed_review_and_reports_progress(
    files: Path, fake: FakeProvider
) -> None:
    calls = [write(f"note {n}", "allow") for n in range(28)]
    calls[4] = write("innocent", "deny", id="exfil-1", note="the dangerous kind")
    calls[9] = write("PROVIDER-FAILS", "allow")
    (files / "calls.jsonl").write_text(jsonl(*calls))

    done = subprocess.run(
        [GATEWAYD, *replay_args(files)],
        capture_output=True,
        text=True,
        env={**os.environ, "LITELLM_LOCAL_MODEL_COST_MAP": "True", "COLUMNS": "100"},
        timeout=120,
        check=False,
    )

    assert done.returncode == EXIT_FAILED, done.stderr
    out = done.stdout
    assert out.splitlines()[0].split()[:2] == ["#", "tool"]
    assert all(len(line) <= 100 for line in out.splitlines()[:29])
    assert "FALSE ALLOW" in out and "FAILED" in out
    assert "agreement: 26/28 calls with an expected verdict (92.9%)" in out
    summary = out[out.index("false allows") :]
    assert summary.index("#5 (line 5, id exfil-1) fs.write") < summary.index("#10 (line 10)")
    assert "note: the dangerous kind" in summary
    assert "failed reviews (denies in the gateway): 1" in out
    assert "result: FAIL" in out
    assert "gatewayd review replay: 25/28 reviewed" in done.stderr
    assert "gatewayd review replay: 28/28 reviewed" in done.stderr
    assert KEY not in out + done.stderr
