"""Apps invoked end to end: a caller inside a real sandbox prompts an app through
cogni-tool, gatewayd runs the app's conversation against a scripted model on loopback,
reviews each of its calls against the app's rules with a second model, and the app
works in a child run of its own (own uid, own network namespace, the workspace
read-only, its data/ writable). The probes try what an app must not do, from inside.
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
import tempfile
from collections.abc import AsyncIterator, Iterator, Mapping
from pathlib import Path
from typing import Any

import pytest
import trio

from gatewayd.apps.install import install_app
from gatewayd.audit.verify import verify_file
from gatewayd.config import GatewaydConfig, ModelAlias
from gatewayd.daemon import open_daemon
from gatewayd.runs import Run
from tests.fakeprovider import Call, FakeProvider, HttpError, Reply, Text
from tests.integration.test_run_sandbox import Sandboxed, _unavailable, sandbox_config

sandboxed = pytest.mark.skipif(_unavailable() is not None, reason=str(_unavailable()))

EXAMPLES = Path(__file__).resolve().parents[2] / "apps" / "examples"
KEY_ENV = "COGNI_TEST_APP_MODEL_KEY"
APP_MODEL = "app-model"
REVIEWER = "reviewer"

CALLER_POLICY = f"""
version: 1
name: app-caller
tools:
  allow: [fs.read, fs.list, fs.write, app_*]
filesystem:
  paths:
    workspace: {{root: ., mode: rw}}
model_access:
  models: [{APP_MODEL}]
review: {{mode: "off", model: {REVIEWER}}}
limits: {{call_timeout_s: 120, calls_per_second: 100, burst: 100}}
sandbox: {{timeout_s: 60, cpu_s: 30, max_processes: 64}}
"""

CALL = """
import json, subprocess, sys
done = subprocess.run(["cogni-tool", "exec", sys.argv[1], sys.argv[2]],
                      capture_output=True, text=True)
print(json.dumps({"rc": done.returncode, "out": done.stdout, "err": done.stderr}))
"""


def review_by_rules(body: Mapping[str, Any]) -> Reply:
    """A reviewer that applies the note taker's rules as a model would: writes only in
    /app/data, no commands."""
    call = body["messages"][-1]["content"]
    if '"sandbox.exec"' in call:
        return Text(content="DENY: rule 'Running commands (exec)' denies it")
    if "password" in call:
        return Text(content="DENY: rule 3 denies storing anything that looks like a password")
    if ('"fs.write"' in call or '"fs.edit"' in call) and '"/app/data/' not in call:
        return Text(content="DENY: writing outside data/ is denied")
    return Text(content="ALLOW")


@pytest.fixture
def base() -> Iterator[Path]:
    path = Path(tempfile.mkdtemp(prefix="cg-app-", dir="/tmp"))
    path.chmod(0o711)
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


@pytest.fixture
def model() -> Iterator[FakeProvider]:
    with FakeProvider() as fake:
        yield fake


@pytest.fixture
def reviewer() -> Iterator[FakeProvider]:
    with FakeProvider() as fake:
        fake.respond = review_by_rules
        yield fake


def app_config(
    base: Path,
    model: FakeProvider,
    reviewer: FakeProvider,
    more: Mapping[str, FakeProvider] | None = None,
) -> GatewaydConfig:
    """A sandboxed gatewayd whose alias app-model is ``model`` and reviewer ``reviewer``
    (and each of ``more``), every key in KEY_ENV."""
    config = sandbox_config(base)

    def alias(fake: FakeProvider) -> ModelAlias:
        return ModelAlias(
            provider="openai", model="fake-model", api_base=fake.api_base, api_key_env=KEY_ENV
        )

    aliases = {APP_MODEL: model, REVIEWER: reviewer, **(more or {})}
    return GatewaydConfig(
        state_dir=config.state_dir,
        policy_dirs=(base,),
        netns_prefix=config.netns_prefix,
        sandbox_uids=config.sandbox_uids,
        # The apps' data folders are checked on the host: runs write it directly.
        workspace_mode=config.workspace_mode,
        models={name: alias(fake) for name, fake in aliases.items()},
    )


@pytest.fixture
async def sb(base: Path, model: FakeProvider, reviewer: FakeProvider) -> AsyncIterator[Sandboxed]:
    os.environ[KEY_ENV] = "sk-test-" + secrets.token_hex(8)
    try:
        async with open_daemon(app_config(base, model, reviewer), preload=True) as daemon:
            assert daemon.runs.support.available, daemon.runs.support.reason
            yield Sandboxed(daemon, base)
    finally:
        os.environ.pop(KEY_ENV, None)


async def call_inside(sb: Sandboxed, run: Any, tool: str, args: dict[str, Any]) -> dict[str, Any]:
    result = await sb.py(run, CALL, tool, json.dumps(args), timeout=60)
    assert result.exitCode == 0, result.stderr
    answer: dict[str, Any] = json.loads(result.stdout)
    return answer


async def note_taker_run(sb: Sandboxed) -> tuple[Path, Run]:
    """A workspace with the note taker installed, and a caller run on it."""
    ws = sb.workspace()
    install_app(EXAMPLES / "note-taker", ws)
    return ws, await sb.run(CALLER_POLICY, workspace=ws)


def write_call(path: str, content: str) -> Call:
    return Call(name="write", arguments={"path": path, "content": content})


@sandboxed
async def test_a_caller_prompts_the_note_taker_twice_and_the_second_reads_the_first(
    sb: Sandboxed, model: FakeProvider, reviewer: FakeProvider
) -> None:
    ws, run = await note_taker_run(sb)

    listed = await call_inside(sb, run, "tools.list", {})
    assert listed["rc"] == 0, listed
    names = [tool["name"] for tool in json.loads(listed["out"])]
    assert "app_note_taker" in names
    (tool,) = [t for t in json.loads(listed["out"]) if t["name"] == "app_note_taker"]
    assert tool["runner"] == "app" and "Keeps notes" in tool["summary"]

    model.script(
        Text(content=None, calls=(write_call("data/milk.md", "- buy milk\n"),)),
        Text(content="Stored under data/milk.md."),
    )
    first = await call_inside(sb, run, "app_note_taker", {"prompt": "Remember: buy milk"})
    assert first["rc"] == 0, first
    value = json.loads(first["out"])
    assert value["ok"] is True and value["answer"] == "Stored under data/milk.md."
    assert value["changed"] == ["/app/data/milk.md"]
    assert (ws / "apps" / "note-taker" / "data" / "milk.md").read_text() == "- buy milk\n"

    model.script(
        Text(content=None, calls=(Call(name="read", arguments={"path": "data/milk.md"}),)),
        Text(content="You noted: buy milk."),
    )
    second = await call_inside(sb, run, "app_note_taker", {"prompt": "What did I note?"})
    value = json.loads(second["out"])
    assert value["ok"] is True and value["answer"] == "You noted: buy milk.", value
    assert value["changed"] == []
    # The app's model read what the first invocation wrote (the tool result it was sent).
    tool_results = [
        m["content"] for m in model.chat_requests[-1].body["messages"] if m["role"] == "tool"
    ]
    assert any("buy milk" in content for content in tool_results), tool_results

    # The caller itself still cannot read the apps folder.
    peek = await call_inside(sb, run, "fs.read", {"path": "apps/note-taker/data/milk.md"})
    assert "policy_denied" in peek["err"] and "buy milk" not in peek["out"], peek

    # The caller's model budget paid for the apps' model and for their reviews.
    asked = len(model.chat_requests) + len(reviewer.chat_requests)
    assert run.model_budget.requests == asked, (run.model_budget, asked)
    assert run.model_budget.tokens == asked * (11 + 7)  # the fake's usage per answer
    # The reviewer saw each app call under the app's name and rules.
    prompts = [r.body["messages"][0]["content"] for r in reviewer.chat_requests]
    assert prompts and all('the app "note-taker"' in p for p in prompts)
    assert all("Writing, editing or creating any file outside data/" in p for p in prompts)

    await sb.daemon.runs.end(run.run_id)
    entries = await sb.entries()
    invoked = [e for e in entries if e.get("event") == "app_invoked"]
    results = [e for e in entries if e.get("event") == "app_result"]
    assert len(invoked) == len(results) == 2
    children = {e["detail"]["childRunId"] for e in invoked}
    assert all(e["detail"]["callerRunId"] == run.run_id for e in invoked)
    reviewed = [
        e for e in entries if e["kind"] == "call" and e.get("runId") in children and e.get("review")
    ]
    assert {e["tool"] for e in reviewed} == {"fs.write", "fs.read"}
    assert all(e["review"]["app"] == "note-taker" for e in reviewed)
    created = [e for e in entries if e.get("event") == "run_created" and e["runId"] in children]
    assert all(e["detail"]["parentRunId"] == run.run_id for e in created)
    assert verify_file(sb.audit_path).ok


@sandboxed
async def test_a_rule_denies_a_call_the_app_adapts_and_the_workspace_stays_read_only(
    sb: Sandboxed, model: FakeProvider
) -> None:
    ws, run = await note_taker_run(sb)
    model.script(
        Text(content=None, calls=(write_call("/workspace/notes.md", "overwritten"),)),
        Text(content=None, calls=(write_call("data/pw.md", "password: hunter2"),)),
        Text(content=None, calls=(write_call("data/n.md", "kept"),)),
        Text(content="Kept it in data/n.md, without the password."),
    )
    answer = await call_inside(sb, run, "app_note_taker", {"prompt": "note: x"})
    value = json.loads(answer["out"])
    assert value["ok"] is True, value
    assert value["changed"] == ["/app/data/n.md"]
    assert (ws / "notes.md").read_text() == "hello\n"
    assert not (ws / "apps" / "note-taker" / "data" / "pw.md").exists()
    # The model was told why each refused write was refused, and could adapt.
    told = [m["content"] for m in model.chat_requests[3].body["messages"] if m["role"] == "tool"]
    assert "policy_denied" in told[0] and "Writable paths: /app/data" in told[0], told
    assert "review_denied" in told[1] and "password" in told[1], told
    assert "error" not in json.loads(told[2]), told


@sandboxed
async def test_a_failing_reviewer_denies_every_call(
    sb: Sandboxed, model: FakeProvider, reviewer: FakeProvider
) -> None:
    ws, run = await note_taker_run(sb)
    reviewer.respond = lambda body: HttpError(status=500, message="down")
    model.script(
        Text(content=None, calls=(write_call("data/n.md", "x"),)),
        Text(content="Could not store it."),
    )
    answer = await call_inside(sb, run, "app_note_taker", {"prompt": "note: x"})
    assert json.loads(answer["out"])["ok"] is True
    assert not (ws / "apps" / "note-taker" / "data" / "n.md").exists()
    told = [m["content"] for m in model.chat_requests[1].body["messages"] if m["role"] == "tool"]
    assert "review_denied" in told[0] and "failed" in told[0], told


OPENAI_PROBE = """
import json, os, urllib.error, urllib.request
base = os.environ["OPENAI_BASE_URL"]
models = json.load(urllib.request.urlopen(base + "/models"))
body = {"model": "app_note_taker", "messages": [
    {"role": "system", "content": "You are a helpful caller."},
    {"role": "user", "content": "Remember: buy milk"}]}
request = urllib.request.Request(base + "/chat/completions", json.dumps(body).encode(),
                                 {"Content-Type": "application/json"})
answer = json.load(urllib.request.urlopen(request, timeout=60))
body["model"] = "app_nope"
request = urllib.request.Request(base + "/chat/completions", json.dumps(body).encode(),
                                 {"Content-Type": "application/json"})
try:
    urllib.request.urlopen(request, timeout=60)
    refused = None
except urllib.error.HTTPError as exc:
    refused = [exc.code, json.load(exc)]
print(json.dumps({"models": [m["id"] for m in models["data"]], "answer": answer,
                  "refused": refused}))
"""


@sandboxed
async def test_an_openai_client_inside_prompts_an_app_as_a_model(
    sb: Sandboxed, model: FakeProvider
) -> None:
    ws, run = await note_taker_run(sb)
    model.script(
        Text(content=None, calls=(write_call("data/milk.md", "- buy milk\n"),)),
        Text(content="Stored under data/milk.md."),
    )
    result = await sb.py(run, OPENAI_PROBE, timeout=60)
    assert result.exitCode == 0, result.stderr
    seen = json.loads(result.stdout)
    assert "app_note_taker" in seen["models"]
    choice = seen["answer"]["choices"][0]
    assert choice["message"]["content"] == "Stored under data/milk.md."
    assert choice["finish_reason"] == "stop"
    # The app was asked the one user message, not the caller's system prompt.
    first = model.chat_requests[0].body["messages"]
    assert first[1]["content"] == "Remember: buy milk"
    assert (ws / "apps" / "note-taker" / "data" / "milk.md").exists()
    # An app this run has not: the gateway's refusal, as an OpenAI error.
    status, error = seen["refused"]
    assert status == 403 and error["error"]["code"] == "unknown_tool", error
    assert "app_note_taker" in error["error"]["message"]


@sandboxed
async def test_the_repo_reviewer_reads_the_history_through_exec_and_cannot_write(
    sb: Sandboxed, model: FakeProvider, reviewer: FakeProvider
) -> None:
    ws = sb.workspace()
    for args in (
        ["init", "-q", "-b", "main"],
        [
            "-c",
            "user.name=t",
            "-c",
            "user.email=t@x",
            "commit",
            "-q",
            "--allow-empty",
            "-m",
            "first",
        ],
    ):
        assert os.spawnvp(os.P_WAIT, "git", ["git", "-C", str(ws), *args]) == 0
    install_app(EXAMPLES / "repo-reviewer", ws)
    run = await sb.run(CALLER_POLICY, workspace=ws)
    # This reviewer allows git commands and refuses the rest, as the app's rules say.
    reviewer.respond = lambda body: Text(
        content="ALLOW"
        if '"git ' in body["messages"][-1]["content"]
        else "DENY: the rules allow only read-only git commands"
    )
    safe = (
        "git -c safe.directory=/workspace -c core.fsmonitor=false -c core.hooksPath=/dev/null "
        "-C /workspace"
    )
    exec_call = Call(name="exec", arguments={"command": f"{safe} log --oneline --no-ext-diff"})
    model.script(
        Text(content=None, calls=(exec_call,)),
        Text(content=None, calls=(Call(name="exec", arguments={"command": "touch /workspace/x"}),)),
        Text(
            content=None,
            calls=(
                Call(
                    name="exec",
                    arguments={"command": f"{safe} commit --allow-empty -qm evil 2>&1; echo rc=$?"},
                ),
            ),
        ),
        Text(content="One commit: first."),
    )
    answer = await call_inside(sb, run, "app_repo_reviewer", {"prompt": "review the history"})
    value = json.loads(answer["out"])
    assert value["ok"] is True, value
    told = [m["content"] for m in model.chat_requests[-1].body["messages"] if m["role"] == "tool"]
    log = json.loads(told[0])
    assert log["exitCode"] == 0 and "first" in log["stdout"], log
    assert "review_denied" in told[1], told
    commit = json.loads(told[2])
    assert "rc=0" not in commit["stdout"], commit  # the workspace is read-only to the app
    assert not (ws / "x").exists()
    await sb.daemon.runs.end(run.run_id)  # the workspace is root's again
    head = os.popen(f"git -C {ws} log --oneline").read()
    assert "evil" not in head and "first" in head


@sandboxed
async def test_a_reload_leaves_an_apps_child_run_as_it_was_made(
    sb: Sandboxed, model: FakeProvider
) -> None:
    from gatewayd.runs.reload import reload_policies

    _, run = await note_taker_run(sb)
    # The app's model answers slowly: the reload comes while its child run is live.
    model.script(Text(content="noted", delay_s=2))
    outcomes: dict[str, str] = {}

    async def reload_soon() -> None:
        await trio.sleep(1)
        outcomes.update(await reload_policies(sb.daemon.registry, sb.daemon.audit))

    async with trio.open_nursery() as nursery:
        nursery.start_soon(reload_soon)
        answer = await call_inside(sb, run, "app_note_taker", {"prompt": "note: x"})
    assert json.loads(answer["out"])["ok"] is True
    children = [rid for rid in outcomes if rid != run.run_id]
    # The child's policy was made for it, from no file: it is not re-read (a path-like
    # label read as a policy file could hand the child another policy).
    assert len(children) == 1 and outcomes[children[0]] == "unchanged", outcomes
    failed = [e for e in await sb.entries() if e.get("event") == "policy_reload_failed"]
    assert failed == [], failed


@sandboxed
@pytest.mark.parametrize("fill", ["bytes", "entries"])
async def test_an_app_whose_data_folder_is_full_is_not_called_until_it_is_pruned(
    sb: Sandboxed, model: FakeProvider, fill: str
) -> None:
    from gatewayd.apps.invoke import MAX_DATA_BYTES, MAX_DATA_ENTRIES

    ws = sb.workspace()
    install_app(EXAMPLES / "note-taker", ws)
    data = ws / "apps" / "note-taker" / "data"
    if fill == "bytes":
        with open(data / "big.bin", "wb") as big:
            big.truncate(MAX_DATA_BYTES + 1)  # sparse: its size is what counts
    else:
        for n in range(MAX_DATA_ENTRIES):
            (data / f"n{n}").touch()
    run = await sb.run(CALLER_POLICY, workspace=ws)
    refused = await call_inside(sb, run, "app_note_taker", {"prompt": "note: x"})
    assert "cogni-tool: tool_failed: " in refused["err"], refused
    assert "before it is called again; the operator must prune" in refused["err"], refused
    assert not model.chat_requests  # the app never ran
    for path in data.iterdir():
        path.unlink()
    model.script(Text(content="noted"))
    again = await call_inside(sb, run, "app_note_taker", {"prompt": "note: x"})
    assert json.loads(again["out"])["ok"] is True, again


@sandboxed
async def test_an_app_whose_data_folder_became_a_file_is_refused_in_the_callers_terms(
    sb: Sandboxed, model: FakeProvider
) -> None:
    ws, run = await note_taker_run(sb)
    data = ws / "apps" / "note-taker" / "data"
    data.rmdir()  # after the run's discovery: the operator's hand, not the app's
    data.write_text("not a folder\n")
    refused = await call_inside(sb, run, "app_note_taker", {"prompt": "note: x"})
    err = refused["err"]
    assert err.startswith("cogni-tool: tool_failed: app 'note-taker' cannot start"), refused
    assert "/workspace/apps/note-taker/data is not a directory" in err, refused
    assert str(ws) not in err and not model.chat_requests


@sandboxed
async def test_a_rule_added_during_an_invocation_reviews_its_next_call_and_a_broken_file_keeps_the_last(
    sb: Sandboxed, model: FakeProvider, reviewer: FakeProvider
) -> None:
    ws, run = await note_taker_run(sb)
    manifest = ws / "apps" / "note-taker" / "APP.md"
    original = manifest.read_text()

    def answer(body: Mapping[str, Any]) -> Reply:
        # While the app's model thinks about its second turn, the operator tightens.
        turns = sum(1 for m in body["messages"] if m["role"] == "tool")
        if turns == 1:
            manifest.write_text(
                original.replace("### Deny\n", "### Deny\n- Writing a file named b.md\n")
            )
        if turns == 2:
            manifest.write_text("not a manifest any more\n")
        if turns < 3:
            name = "abc"[turns]
            return Text(content=None, calls=(write_call(f"data/{name}.md", name),))
        return Text(content="done")

    model.respond = answer
    value = json.loads((await call_inside(sb, run, "app_note_taker", {"prompt": "x"}))["out"])
    assert value["ok"] is True, value
    prompts = [r.body["messages"][0]["content"] for r in reviewer.chat_requests]
    assert len(prompts) == 3
    assert "Writing a file named b.md" not in prompts[0]
    # The change applied at once, within the invocation; the unreadable file kept it.
    assert "Writing a file named b.md" in prompts[1] and prompts[2] == prompts[1]
