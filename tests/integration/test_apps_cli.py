"""`gatewayd apps list|show|check` as an operator runs them: what each prints, its exit
status, and a clean message (never a traceback or a hang) for every hostile folder."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import ROOT

GATEWAYD = str(Path(sys.executable).parent / "gatewayd")
ENV = {**os.environ, "LITELLM_LOCAL_MODEL_COST_MAP": "True"}
EXAMPLES = ROOT / "apps" / "examples"
# A hang is a failure: every command answers well within this.
COMMAND_TIMEOUT_S = 60


def gatewayd(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [GATEWAYD, *args],
        capture_output=True,
        text=True,
        env=ENV,
        timeout=COMMAND_TIMEOUT_S,
        stdin=subprocess.DEVNULL,
        check=False,
    )


def assert_no_crash(done: subprocess.CompletedProcess[str]) -> None:
    for crash in ("Traceback", "ExceptionGroup", "Error:"):
        assert crash not in done.stdout + done.stderr, done.stdout + done.stderr


@pytest.fixture
def ws(tmp_path: Path) -> Path:
    """A workspace holding the two shipped example apps."""
    workspace = tmp_path / "ws"
    (workspace / "apps").mkdir(parents=True)
    for example in EXAMPLES.iterdir():
        shutil.copytree(example, workspace / "apps" / example.name)
    return workspace


def test_list_prints_one_line_per_app_and_exits_0(ws: Path) -> None:
    done = gatewayd("apps", "list", "--workspace", str(ws))
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines() == [
        "note-taker     app_note_taker     Note Taker",
        "repo-reviewer  app_repo_reviewer  Repository Reviewer",
    ]
    assert done.stderr == ""


def test_list_names_each_skipped_app_with_its_reason_and_exits_1(ws: Path) -> None:
    bad = ws / "apps" / "broken"
    bad.mkdir()
    (bad / "APP.md").write_text("---\nname: broken\ntitle: [x\n---\n")
    os.mkfifo(ws / "apps" / "repo-reviewer" / "data")
    done = gatewayd("apps", "list", "--workspace", str(ws))
    assert_no_crash(done)
    assert done.returncode == 1
    assert done.stdout.splitlines() == ["note-taker  app_note_taker  Note Taker"]
    assert done.stderr.splitlines() == [
        "skipped: apps/broken/APP.md:4: YAML syntax: did not find expected ',' or ']'",
        "skipped: apps/repo-reviewer: data: data is a FIFO (named pipe); an app's data/ must "
        "be a directory of its own (a link would lend the app whatever it points to)",
    ]


def test_list_of_a_workspace_without_apps_says_so(tmp_path: Path) -> None:
    done = gatewayd("apps", "list", "--workspace", str(tmp_path))
    assert (done.returncode, done.stdout) == (0, f"no apps in {tmp_path}/apps/\n")


def test_list_of_a_missing_workspace_exits_1_with_why(tmp_path: Path) -> None:
    done = gatewayd("apps", "list", "--workspace", str(tmp_path / "nowhere"))
    assert_no_crash(done)
    assert done.returncode == 1
    assert done.stderr == (
        f"gatewayd apps: cannot read the workspace {tmp_path}/nowhere: No such file or directory\n"
    )


def test_show_prints_the_manifest_with_rules_and_who_added_them(ws: Path) -> None:
    app_md = ws / "apps" / "note-taker" / "APP.md"
    app_md.write_text(
        app_md.read_text().replace(
            "- Running commands (exec)", "- Running commands (exec) <!-- addedBy: alice -->"
        )
    )
    done = gatewayd("apps", "show", "note-taker", "--workspace", str(ws))
    assert done.returncode == 0, done.stderr
    out = done.stdout
    assert out.startswith("app note-taker (tool app_note_taker)\n")
    assert f"  folder: {ws}/apps/note-taker\n" in out
    assert "  model: (not set: the policy's default alias)\n" in out
    assert "  limits per invocation: 8 turns, 16 tool calls, 50000 tokens, 120 s\n" in out
    assert "system prompt:\n  | You are a note taker." in out
    assert "  deny:\n    1. Writing, editing or creating any file outside data/\n" in out
    assert "    2. Running commands (exec)  (added by alice)\n" in out


def test_show_json_is_the_manifest_as_data(ws: Path) -> None:
    done = gatewayd("apps", "show", "repo-reviewer", "--workspace", str(ws), "--json")
    assert done.returncode == 0, done.stderr
    shown = json.loads(done.stdout)
    assert (shown["id"], shown["tool"]) == ("repo-reviewer", "app_repo_reviewer")
    assert shown["folder"] == str(ws / "apps" / "repo-reviewer")
    assert shown["limits"]["toolCalls"] == 40
    assert any("git log" in rule["text"] for rule in shown["rules"]["allow"])


@pytest.mark.parametrize(
    ("app_id", "says"),
    [
        ("nope", "gatewayd apps: there is no app 'nope' in {ws}/apps/ (`gatewayd apps list"),
        ("../etc", "gatewayd apps: '../etc' is not an app id: an app id is 1-63 lowercase"),
        ("Note-Taker", "did you mean 'note-taker'?"),
    ],
)
def test_show_of_an_unknown_or_bad_id_exits_1_with_why(ws: Path, app_id: str, says: str) -> None:
    done = gatewayd("apps", "show", app_id, "--workspace", str(ws))
    assert_no_crash(done)
    assert done.returncode == 1
    assert says.format(ws=ws) in done.stderr


def test_show_of_a_skipped_app_prints_every_problem(ws: Path) -> None:
    app_md = ws / "apps" / "note-taker" / "APP.md"
    text = app_md.read_text().replace("title: Note Taker", "titel: Note Taker")
    app_md.write_text(text.replace("- Running commands (exec)", "1. Running commands"))
    done = gatewayd("apps", "show", "note-taker", "--workspace", str(ws))
    assert done.returncode == 1
    lines = done.stderr.splitlines()
    assert lines[0].startswith("apps/note-taker/APP.md:3: titel: unknown field")
    assert "rules.deny: only a bullet list ('- rule') belongs under '### Deny'" in lines[1]
    assert lines[2] == "apps/note-taker/APP.md: title: required field is missing"


def test_check_accepts_each_shipped_example(tmp_path: Path) -> None:
    for example in sorted(EXAMPLES.iterdir()):
        done = gatewayd("apps", "check", str(example))
        assert done.returncode == 0, done.stderr
        assert done.stdout.startswith(f"{example}: ok: app {example.name} (tool app_")


def test_check_of_a_source_under_another_name_says_where_it_installs(tmp_path: Path) -> None:
    source = tmp_path / "notes-v2"
    shutil.copytree(EXAMPLES / "note-taker", source)
    done = gatewayd("apps", "check", str(source))
    assert done.returncode == 0
    assert (
        done.stdout.splitlines()[1] == "note: it installs as apps/note-taker/, its manifest's name"
    )


@pytest.mark.parametrize(
    ("spoil", "says"),
    [
        (lambda f: (f / "APP.md").unlink(), "there is no APP.md"),
        (lambda f: ((f / "APP.md").unlink(), os.mkfifo(f / "APP.md")), "APP.md is a FIFO"),
        (
            lambda f: ((f / "APP.md").unlink(), (f / "APP.md").symlink_to("/etc/passwd")),
            "APP.md is a symlink",
        ),
        (
            lambda f: (f / "APP.md").write_bytes(b"---\nname: x\n" + b"#" * (300 * 1024)),
            "APP.md is larger than 262144 bytes",
        ),
        (
            lambda f: (f / "APP.md").write_text(
                (f / "APP.md").read_text().replace("name: note-taker", "name: ../../etc")
            ),
            "APP.md:2: name: '../../etc' is not an app id",
        ),
    ],
)
def test_check_of_a_hostile_source_exits_1_with_the_file_and_reason(
    tmp_path: Path, spoil: object, says: str
) -> None:
    source = tmp_path / "src"
    shutil.copytree(EXAMPLES / "note-taker", source)
    spoil(source)  # type: ignore[operator]
    done = gatewayd("apps", "check", str(source))
    assert_no_crash(done)
    assert done.returncode == 1
    assert says in done.stderr
    assert "root:" not in done.stderr  # nothing of a linked file is quoted


def test_check_of_a_missing_folder_exits_1(tmp_path: Path) -> None:
    done = gatewayd("apps", "check", str(tmp_path / "nowhere"))
    assert done.returncode == 1
    assert done.stderr == (
        f"{tmp_path}/nowhere: cannot open the app folder: No such file or directory\n"
    )
