"""Reading the tool directories (gatewayd/runners/folders.py): valid folders become tools
with their digests; a symlink anywhere on the way, a folder someone else may write, an
oversized or odd file, or a name already taken is refused with the file and the reason,
and never stops the other folders."""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import Any

import pytest

from gatewayd.config import GatewaydConfig, ModelAlias
from gatewayd.runners import folders
from gatewayd.runners.folders import (
    MAX_MANIFEST_BYTES,
    is_tool_folder,
    load_folder,
    load_paths,
    load_tool_dirs,
    manifest_defaults,
)
from gatewayd.runners.manifest import ManifestDefaults, Problem
from gatewayd.tools.manifest import RunnerKind

DEFAULTS = ManifestDefaults()
# Not a real module: the folder reader digests it; compiling is the wasm runner's.
MODULE = b"\x00asm\x01\x00\x00\x00"


def manifest(name: str, **fields: Any) -> dict[str, Any]:
    return {
        "name": name,
        "version": "1.0",
        "description": f"The tool {name}.",
        "input_schema": {"type": "object"},
        "runtime": "wasm",
        "entry": "tool.wasm",
        **fields,
    }


def make_tool(
    root: Path, folder: str, data: dict[str, Any] | str, *, module: bytes | None = MODULE
) -> Path:
    path = root / folder
    path.mkdir(parents=True)
    if isinstance(data, str):
        (path / "manifest.yaml").write_text(data)
    else:
        (path / "manifest.json").write_text(json.dumps(data))
    if module is not None:
        (path / "tool.wasm").write_bytes(module)
    return path


def only_problem(found: folders.ToolFolders) -> Problem:
    assert found.tools == ()
    (problem,) = found.problems
    return problem


@pytest.fixture
def tool_dir(tmp_path: Path) -> Path:
    path = tmp_path / "tools"
    path.mkdir(mode=0o755)
    return path


def test_valid_json_and_yaml_folders_load_with_their_digests(tool_dir: Path) -> None:
    json_folder = make_tool(tool_dir, "a", manifest("text.a"))
    make_tool(
        tool_dir,
        "b",
        "name: text.b\nversion: '2'\ndescription: B.\ninput_schema: {type: object}\n"
        "runtime: process\nentry: [python3, /tool/b.py]\n",
        module=None,
    )
    (tool_dir / "README.md").write_text("not a tool")
    (tool_dir / ".git").mkdir()
    found = load_tool_dirs([tool_dir], defaults=DEFAULTS)
    assert found.problems == ()
    a, b = found.tools
    assert (a.name, a.runner, a.folder) == ("text.a", RunnerKind.WASM, str(json_folder))
    raw = (json_folder / "manifest.json").read_bytes()
    assert a.manifest_digest == "sha256:" + hashlib.sha256(raw).hexdigest()
    assert a.entry_digest == "sha256:" + hashlib.sha256(MODULE).hexdigest()
    assert a.entry == (str(json_folder / "tool.wasm"),)
    assert (b.name, b.runner, b.entry_digest) == ("text.b", RunnerKind.PROCESS, "")
    assert b.manifest_path == str(tool_dir / "b" / "manifest.yaml")


def test_the_tool_dir_is_taken_by_its_real_path(tool_dir: Path, tmp_path: Path) -> None:
    # The operator's configured path may be a symlink; what lies beneath it may not.
    make_tool(tool_dir, "a", manifest("text.a"))
    (tmp_path / "link").symlink_to(tool_dir)
    (tool,) = load_tool_dirs([tmp_path / "link"], defaults=DEFAULTS).tools
    assert tool.folder == str(tool_dir / "a")


def test_one_bad_folder_never_stops_the_others(tool_dir: Path) -> None:
    make_tool(tool_dir, "a", manifest("text.a", version=3))
    make_tool(tool_dir, "b", manifest("text.b"))
    found = load_tool_dirs([tool_dir], defaults=DEFAULTS)
    assert [t.name for t in found.tools] == ["text.b"]
    (problem,) = found.problems
    assert problem.file == str(tool_dir / "a" / "manifest.json")
    assert problem.field == "version"
    assert "is not of type 'string'" in problem.reason


def test_every_problem_of_one_manifest_is_in_its_reason(tool_dir: Path) -> None:
    make_tool(tool_dir, "a", manifest("text.a", version=3, colour="red"))
    problem = only_problem(load_tool_dirs([tool_dir], defaults=DEFAULTS))
    assert problem.field == "colour"
    assert "version: 3 is not of type 'string'" in problem.reason


# --- symlinks ---------------------------------------------------------------------------


def test_a_symlinked_folder_is_refused(tool_dir: Path, tmp_path: Path) -> None:
    elsewhere = make_tool(tmp_path / "elsewhere", "x", manifest("text.x"))
    (tool_dir / "x").symlink_to(elsewhere)
    problem = only_problem(load_tool_dirs([tool_dir], defaults=DEFAULTS))
    assert problem.file == str(tool_dir / "x")
    assert "is a symlink" in problem.reason


def test_a_symlinked_manifest_is_refused(tool_dir: Path, tmp_path: Path) -> None:
    outside = tmp_path / "outside.json"
    outside.write_text(json.dumps(manifest("text.x")))
    folder = tool_dir / "x"
    folder.mkdir()
    (folder / "manifest.json").symlink_to(outside)
    (folder / "tool.wasm").write_bytes(MODULE)
    problem = only_problem(load_tool_dirs([tool_dir], defaults=DEFAULTS))
    assert problem.file == str(folder / "manifest.json")
    assert "the manifest (manifest.json) is a symlink" in problem.reason


@pytest.mark.parametrize("target", ["/etc/passwd", "../other/tool.wasm", "real.wasm"])
def test_a_symlinked_entry_is_refused_wherever_it_leads(tool_dir: Path, target: str) -> None:
    folder = make_tool(tool_dir, "x", manifest("text.x"), module=None)
    (folder / "real.wasm").write_bytes(MODULE)
    (folder / "tool.wasm").symlink_to(target)
    problem = only_problem(load_tool_dirs([tool_dir], defaults=DEFAULTS))
    assert problem.field == "entry"
    assert "the module (tool.wasm) is a symlink" in problem.reason


def test_an_entry_through_a_symlinked_directory_is_refused(tool_dir: Path, tmp_path: Path) -> None:
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "tool.wasm").write_bytes(MODULE)
    folder = make_tool(tool_dir, "x", manifest("text.x", entry="bin/tool.wasm"), module=None)
    (folder / "bin").symlink_to(outside)
    problem = only_problem(load_tool_dirs([tool_dir], defaults=DEFAULTS))
    assert problem.field == "entry"
    assert "(bin) is a symlink" in problem.reason


def test_an_entry_in_a_subdirectory_loads(tool_dir: Path) -> None:
    folder = make_tool(tool_dir, "x", manifest("text.x", entry="bin/out/tool.wasm"), module=None)
    (folder / "bin" / "out").mkdir(parents=True)
    (folder / "bin" / "out" / "tool.wasm").write_bytes(MODULE)
    (tool,) = load_tool_dirs([tool_dir], defaults=DEFAULTS).tools
    assert tool.entry == (str(folder / "bin" / "out" / "tool.wasm"),)


# --- files that are not what they seem ------------------------------------------------


def test_a_missing_entry_is_refused(tool_dir: Path) -> None:
    make_tool(tool_dir, "x", manifest("text.x"), module=None)
    problem = only_problem(load_tool_dirs([tool_dir], defaults=DEFAULTS))
    assert problem.field == "entry"
    assert "No such file" in problem.reason


def test_a_folder_without_a_manifest_or_with_two_is_refused(tool_dir: Path) -> None:
    (tool_dir / "empty").mkdir()
    both = make_tool(tool_dir, "both", manifest("text.both"))
    (both / "manifest.yaml").write_text("name: text.both\n")
    found = load_tool_dirs([tool_dir], defaults=DEFAULTS)
    reasons = {p.file: p.reason for p in found.problems}
    assert "holds both manifest.json and manifest.yaml" in reasons[str(both)]
    assert "holds no manifest" in reasons[str(tool_dir / "empty")]


def test_a_manifest_that_is_a_fifo_is_refused_without_blocking(tool_dir: Path) -> None:
    folder = tool_dir / "x"
    folder.mkdir()
    os.mkfifo(folder / "manifest.json")
    problem = only_problem(load_tool_dirs([tool_dir], defaults=DEFAULTS))
    assert "is not a regular file" in problem.reason


def test_a_huge_manifest_is_refused(tool_dir: Path) -> None:
    folder = tool_dir / "x"
    folder.mkdir()
    (folder / "manifest.json").write_bytes(b" " * (MAX_MANIFEST_BYTES + 1))
    problem = only_problem(load_tool_dirs([tool_dir], defaults=DEFAULTS))
    assert f"at most {MAX_MANIFEST_BYTES} are read" in problem.reason


def test_a_huge_module_is_refused(tool_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(folders, "MAX_ENTRY_BYTES", 64)
    make_tool(tool_dir, "x", manifest("text.x"), module=b"\x00" * 65)
    problem = only_problem(load_tool_dirs([tool_dir], defaults=DEFAULTS))
    assert problem.field == "entry"
    assert "at most 64 are read" in problem.reason


@pytest.mark.parametrize(
    ("name", "text", "reason"),
    [
        ("manifest.json", '{"name": "a", "name": "b"}', "not valid JSON"),
        ("manifest.json", "{", "not valid JSON"),
        ("manifest.yaml", "a: &x [1]\nb: *x\n", "not valid YAML"),
        ("manifest.yaml", "name: a\nname: b\n", "not valid YAML"),
        ("manifest.yaml", "", "a manifest is a mapping of fields, not nothing"),
    ],
)
def test_a_manifest_that_is_not_strict_json_or_yaml_is_refused(
    tool_dir: Path, name: str, text: str, reason: str
) -> None:
    folder = tool_dir / "x"
    folder.mkdir()
    (folder / name).write_text(text)
    problem = only_problem(load_tool_dirs([tool_dir], defaults=DEFAULTS))
    assert problem.file == str(folder / name)
    assert reason in problem.reason


def test_a_manifest_not_in_utf8_is_refused(tool_dir: Path) -> None:
    folder = tool_dir / "x"
    folder.mkdir()
    (folder / "manifest.yaml").write_bytes(b"name: \xff\n")
    assert "not UTF-8" in only_problem(load_tool_dirs([tool_dir], defaults=DEFAULTS)).reason


# --- who may change a tool --------------------------------------------------------------


@pytest.mark.parametrize("what", ["dir", "folder", "manifest", "module"])
def test_anything_others_may_write_is_refused(tool_dir: Path, what: str) -> None:
    folder = make_tool(tool_dir, "x", manifest("text.x"))
    target = {
        "dir": tool_dir,
        "folder": folder,
        "manifest": folder / "manifest.json",
        "module": folder / "tool.wasm",
    }[what]
    target.chmod(target.stat().st_mode | 0o002)
    problem = only_problem(load_tool_dirs([tool_dir], defaults=DEFAULTS))
    assert "writable by group or others" in problem.reason


@pytest.mark.skipif(os.geteuid() != 0, reason="only root can give a file away")
def test_group_write_is_refused_unless_the_group_is_gatewayds_or_roots(tool_dir: Path) -> None:
    folder = make_tool(tool_dir, "x", manifest("text.x"))
    folder.chmod(0o775)  # a umask of 002: writable by its own group
    assert [t.name for t in load_tool_dirs([tool_dir], defaults=DEFAULTS).tools] == ["text.x"]
    os.chown(folder, os.geteuid(), 1_234_567)  # another group's members could write
    problem = only_problem(load_tool_dirs([tool_dir], defaults=DEFAULTS))
    assert "writable by group or others (mode 0775, gid 1234567)" in problem.reason


@pytest.mark.skipif(os.geteuid() != 0, reason="only root can give a file away")
def test_a_folder_someone_else_owns_is_refused(tool_dir: Path) -> None:
    folder = make_tool(tool_dir, "x", manifest("text.x"))
    os.chown(folder, 1_234_567, 1_234_567)  # a sandbox uid: a workspace lent to a run
    problem = only_problem(load_tool_dirs([tool_dir], defaults=DEFAULTS))
    assert "owned by uid 1234567" in problem.reason


def test_a_missing_tool_dir_is_one_problem(tmp_path: Path) -> None:
    problem = only_problem(load_tool_dirs([tmp_path / "absent"], defaults=DEFAULTS))
    assert problem.file == str(tmp_path / "absent")
    assert "cannot be opened" in problem.reason


def test_a_tool_dir_of_too_many_entries_is_refused(
    tool_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(folders, "MAX_FOLDERS_PER_DIR", 2)
    for name in "abc":
        (tool_dir / name).mkdir()
    problem = only_problem(load_tool_dirs([tool_dir], defaults=DEFAULTS))
    assert "at most 2 tool folders" in problem.reason


# --- names ------------------------------------------------------------------------------


def test_a_name_clash_keeps_the_first_folder(tool_dir: Path, tmp_path: Path) -> None:
    make_tool(tool_dir, "a", manifest("text.same"))
    make_tool(tool_dir, "b", manifest("text.same"))
    second_dir = tmp_path / "more"
    second_dir.mkdir()
    make_tool(second_dir, "c", manifest("text.same"))
    found = load_tool_dirs([tool_dir, second_dir], defaults=DEFAULTS)
    assert [t.folder for t in found.tools] == [str(tool_dir / "a")]
    assert [(p.file, p.field) for p in found.problems] == [
        (str(tool_dir / "b" / "manifest.json"), "name"),
        (str(second_dir / "c" / "manifest.json"), "name"),
    ]
    assert f"already the name of the tool in {tool_dir / 'a'}" in found.problems[0].reason


def test_a_builtin_tools_name_is_refused(tool_dir: Path) -> None:
    make_tool(tool_dir, "a", manifest("fs.read"))
    problem = only_problem(load_tool_dirs([tool_dir], defaults=DEFAULTS, taken={"fs.read"}))
    assert "one of gatewayd's own tools" in problem.reason


def test_check_paths_take_a_tool_dir_or_one_folder(tool_dir: Path) -> None:
    a = make_tool(tool_dir, "a", manifest("text.a"))
    make_tool(tool_dir, "b", manifest("text.b"))
    assert is_tool_folder(a) and not is_tool_folder(tool_dir)
    assert [t.name for t in load_paths([a], defaults=DEFAULTS).tools] == ["text.a"]
    found = load_paths([tool_dir, a], defaults=DEFAULTS)
    assert [t.name for t in found.tools] == ["text.a", "text.b"]
    assert [p.field for p in found.problems] == ["name"]  # a, seen twice


def test_a_single_symlinked_folder_is_refused_too(tool_dir: Path, tmp_path: Path) -> None:
    a = make_tool(tool_dir, "a", manifest("text.a"))
    (a / "tool.wasm").unlink()
    (a / "tool.wasm").symlink_to("/etc/passwd")
    problem = load_folder(a, defaults=DEFAULTS)
    assert isinstance(problem, Problem)
    assert "is a symlink" in problem.reason


# --- the configuration's defaults -------------------------------------------------------


def test_defaults_refuse_the_secrets_gatewayd_holds_and_the_names_it_sets(tool_dir: Path) -> None:
    config = GatewaydConfig(
        models={"m": ModelAlias(provider="openai", model="x", api_key_env="OPENAI_KEY")},
        secret_env=("FORGE_TOKEN",),
        tool_default_runner="process",
        tool_timeout_s=4.0,
        tool_memory_mb=32,
    )
    defaults = manifest_defaults(config)
    assert (defaults.runner, defaults.timeout_s, defaults.memory_mb) == (
        RunnerKind.PROCESS,
        4.0,
        32,
    )
    for name in ("OPENAI_KEY", "FORGE_TOKEN", "COGNI_GATEWAY_SOCK", "HTTPS_PROXY", "PATH"):
        make_tool(
            tool_dir,
            name.lower(),
            manifest(f"t.{name.lower()}", capabilities={"env": [name]}),
        )
    found = load_tool_dirs([tool_dir], defaults=defaults)
    assert found.tools == ()
    assert len(found.problems) == 5
    assert all(p.field == "capabilities.env[0]" for p in found.problems)
    secret = [p for p in found.problems if "OPENAI_KEY" in p.reason]
    assert "holds a secret" in secret[0].reason


def test_a_directory_on_the_entrys_way_others_may_write_is_refused(tool_dir: Path) -> None:
    folder = make_tool(tool_dir, "x", manifest("text.x", entry="bin/tool.wasm"), module=None)
    (folder / "bin").mkdir(mode=0o777)
    (folder / "bin").chmod(0o777)
    (folder / "bin" / "tool.wasm").write_bytes(MODULE)
    problem = only_problem(load_tool_dirs([tool_dir], defaults=DEFAULTS))
    assert problem.field == "entry"
    assert "the directory bin is writable by group or others" in problem.reason


def test_a_tool_dir_that_cannot_be_listed_is_one_problem(
    tool_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def refuse(_fd: object) -> list[str]:
        raise PermissionError(13, "Permission denied")

    monkeypatch.setattr(folders.os, "listdir", refuse)
    problem = only_problem(load_tool_dirs([tool_dir], defaults=DEFAULTS))
    assert "tool directory cannot be read: Permission denied" in problem.reason


def test_a_read_that_fails_midway_is_that_folders_problem(
    tool_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    make_tool(tool_dir, "a", manifest("text.a"))
    make_tool(tool_dir, "b", manifest("text.b"))
    real_read = os.read
    calls = {"n": 0}

    def flaky(fd: int, size: int) -> bytes:
        calls["n"] += 1
        if calls["n"] == 1:
            raise OSError(5, "Input/output error")
        return real_read(fd, size)

    monkeypatch.setattr(folders.os, "read", flaky)
    found = load_tool_dirs([tool_dir], defaults=DEFAULTS)
    assert [t.name for t in found.tools] == ["text.b"]
    assert "cannot be read: Input/output error" in found.problems[0].reason
