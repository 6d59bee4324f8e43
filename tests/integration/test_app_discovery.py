"""Discovering a workspace's apps on a real file system: valid apps are found, and
everything hostile in apps/ (symlinks at every level, hard links, FIFOs, devices,
oversized and malformed manifests, a folder named unlike its app, too many apps) is a
skipped app with its reason, without a hang, without reading outside the workspace,
and without hiding the other apps. Skips are audited."""

from __future__ import annotations

import os
import threading
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

import pytest
import trio

from gatewayd.apps import discovery
from gatewayd.apps.discovery import (
    MAX_APPS,
    DiscoveredApp,
    Discovery,
    DiscoveryError,
    SkippedApp,
    check_app_folder,
    discover_apps,
    find_app,
    record_skipped_apps,
)
from gatewayd.apps.manifest import MAX_MANIFEST_BYTES
from gatewayd.audit import AuditEvent, open_audit_log, read_entries, verify_file

T = TypeVar("T")
# A hang is a failure: discovery of a hostile folder answers well within this.
HANG_S = 20
SECRET = "root:$y$j9T$SECRETHASHdoNotShow:19000:0:99999:7:::"


def manifest(name: str, title: str = "An app") -> str:
    return (
        f"---\nname: {name}\ntitle: {title}\ndescription: Does one thing.\n---\n\n"
        "## System Prompt\n\nDo the thing.\n\n## Rules\n\n### Allow\n- Reading the workspace\n\n"
        "### Deny\n- Writing outside data/\n"
    )


def make_app(workspace: Path, name: str, text: str | None = None) -> Path:
    folder = workspace / "apps" / name
    folder.mkdir(parents=True)
    (folder / "APP.md").write_text(manifest(name) if text is None else text)
    return folder


def within(call: Callable[[], T]) -> T:
    """``call()`` in a thread: a blocked open fails the test instead of hanging it."""
    result: list[T] = []
    errors: list[BaseException] = []

    def run() -> None:
        try:
            result.append(call())
        except BaseException as exc:
            errors.append(exc)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(HANG_S)
    assert not thread.is_alive(), "discovery hung"
    if errors:
        raise errors[0]
    return result[0]


def discover(workspace: Path) -> Discovery:
    return within(lambda: discover_apps(workspace))


def only_skip(found: Discovery) -> SkippedApp:
    assert len(found.skipped) == 1, found.skipped
    return found.skipped[0]


@pytest.fixture
def ws(tmp_path: Path) -> Path:
    workspace = tmp_path / "ws"
    workspace.mkdir()
    return workspace


@pytest.fixture
def outside(tmp_path: Path) -> Path:
    """A folder beside the workspace holding a valid app and a secret."""
    folder = tmp_path / "outside"
    (folder / "evil").mkdir(parents=True)
    (folder / "evil" / "APP.md").write_text(manifest("evil"))
    (folder / "shadow").write_text(SECRET)
    return folder


# --- what is found ----------------------------------------------------------------------


def test_valid_apps_are_found_in_name_order_with_their_tools(ws: Path) -> None:
    make_app(ws, "repo-reviewer")
    make_app(ws, "note-taker")
    (ws / "apps" / "note-taker" / "data").mkdir()
    (ws / "apps" / "note-taker" / "scripts").mkdir()
    found = discover(ws)
    assert found.skipped == ()
    assert [(a.id, a.tool_name) for a in found.apps] == [
        ("note-taker", "app_note_taker"),
        ("repo-reviewer", "app_repo_reviewer"),
    ]
    app = found.get("note-taker")
    assert app is not None and app.folder == ws / "apps" / "note-taker"
    assert app.manifest.name == "note-taker"
    assert found.get("missing") is None


def test_a_workspace_without_apps_has_none(ws: Path) -> None:
    assert discover(ws) == Discovery(workspace=ws, apps=(), skipped=())


def test_files_and_hidden_entries_beside_the_apps_are_not_apps(ws: Path) -> None:
    make_app(ws, "note-taker")
    (ws / "apps" / "README.md").write_text("# our apps\n")
    (ws / "apps" / ".install-x1").mkdir()  # an installer's staging copy
    (ws / "apps" / ".git").mkdir()
    found = discover(ws)
    assert [a.id for a in found.apps] == ["note-taker"] and found.skipped == ()


def test_a_workspace_that_is_not_a_directory_is_an_error_not_a_skip(tmp_path: Path) -> None:
    with pytest.raises(DiscoveryError, match=r"cannot read the workspace .*No such file"):
        discover_apps(tmp_path / "nowhere")
    (tmp_path / "file").write_text("x")
    with pytest.raises(DiscoveryError, match="Not a directory"):
        discover_apps(tmp_path / "file")


# --- one bad app never hides the others -------------------------------------------------

# name -> (how to spoil apps/<name>, the skip's file, field, what its reason says)
Spoiler = Callable[[Path, Path], None]


def _write(text: str) -> Spoiler:
    return lambda folder, _outside: (folder / "APP.md").write_text(text)


def _replace_manifest(make: Callable[[Path, Path], object]) -> Spoiler:
    def spoil(folder: Path, outside: Path) -> None:
        (folder / "APP.md").unlink()
        make(folder / "APP.md", outside)

    return spoil


SPOILERS: dict[str, tuple[Spoiler, str, str | None, str]] = {
    "no-manifest": (
        lambda folder, _o: (folder / "APP.md").unlink(),
        "apps/bad",
        None,
        "there is no APP.md; an app folder holds its manifest, APP.md",
    ),
    "malformed": (
        _write(manifest("bad").replace("title: An app", "title: [An app")),
        "apps/bad/APP.md",
        None,
        "YAML syntax",
    ),
    "name-differs": (
        _write(manifest("other")),
        "apps/bad/APP.md",
        "name",
        "the manifest's name 'other' is not its folder's name 'bad': app 'other' lives in "
        "apps/other/",
    ),
    "manifest-symlink": (
        _replace_manifest(lambda path, outside: path.symlink_to(outside / "evil" / "APP.md")),
        "apps/bad",
        None,
        "APP.md is a symlink; a manifest is a regular file in its app's folder, never a link",
    ),
    "manifest-symlink-to-secret": (
        _replace_manifest(lambda path, outside: path.symlink_to(outside / "shadow")),
        "apps/bad",
        None,
        "APP.md is a symlink",
    ),
    "manifest-hard-link": (
        _replace_manifest(lambda path, outside: os.link(outside / "evil" / "APP.md", path)),
        "apps/bad",
        None,
        "APP.md has several hard links",
    ),
    "manifest-fifo": (
        _replace_manifest(lambda path, _o: os.mkfifo(path)),
        "apps/bad",
        None,
        "APP.md is a FIFO (named pipe), not a regular file",
    ),
    "manifest-device": (
        _replace_manifest(lambda path, _o: os.mknod(path, 0o600 | 0o020000, os.makedev(1, 5))),
        "apps/bad",
        None,
        "APP.md is a device, not a regular file",
    ),
    "manifest-symlink-to-device": (
        _replace_manifest(lambda path, _o: path.symlink_to("/dev/zero")),
        "apps/bad",
        None,
        "APP.md is a symlink",
    ),
    "manifest-directory": (
        _replace_manifest(lambda path, _o: path.mkdir()),
        "apps/bad",
        None,
        "APP.md is a directory, not a regular file",
    ),
    "manifest-oversized": (
        _replace_manifest(lambda path, _o: os.truncate(_touch(path), MAX_MANIFEST_BYTES + 1)),
        "apps/bad",
        None,
        f"APP.md is larger than {MAX_MANIFEST_BYTES} bytes",
    ),
    "not-utf8": (
        lambda folder, _o: (folder / "APP.md").write_bytes(b"---\nname: \xff\n---\n"),
        "apps/bad/APP.md",
        None,
        "not UTF-8",
    ),
    "data-symlink": (
        lambda folder, outside: (folder / "data").symlink_to(outside),
        "apps/bad",
        "data",
        "data is a symlink; an app's data/ must be a directory of its own",
    ),
    "scripts-file": (
        lambda folder, _o: (folder / "scripts").write_text("echo\n"),
        "apps/bad",
        "scripts",
        "scripts is a regular file",
    ),
}


def _touch(path: Path) -> Path:
    path.write_bytes(b"")
    return path


@pytest.mark.parametrize("case", list(SPOILERS))
def test_a_spoiled_app_is_skipped_with_its_reason_and_the_others_are_found(
    ws: Path, outside: Path, case: str
) -> None:
    spoil, file, field, says = SPOILERS[case]
    make_app(ws, "alpha")
    spoil(make_app(ws, "bad"), outside)
    make_app(ws, "zulu")
    found = discover(ws)
    assert [a.id for a in found.apps] == ["alpha", "zulu"]
    skip = only_skip(found)
    assert (skip.file, skip.field) == (file, field), skip
    assert says in skip.reason, skip.reason
    assert SECRET not in skip.describe()
    # The same answer for that one app alone (apps show), and for its folder (apps check).
    alone = within(lambda: find_app(ws, "bad"))
    assert isinstance(alone, SkippedApp) and says in alone.reason


def test_a_symlinked_app_folder_is_skipped_never_followed(ws: Path, outside: Path) -> None:
    make_app(ws, "alpha")
    (ws / "apps" / "evil").symlink_to(outside / "evil")
    found = discover(ws)
    assert [a.id for a in found.apps] == ["alpha"]
    skip = only_skip(found)
    assert skip.file == "apps/evil"
    assert "evil is a symlink; app folders are never reached through a symlink" in skip.reason
    assert isinstance(find_app(ws, "evil"), SkippedApp)


def test_a_symlinked_apps_folder_is_skipped_never_followed(ws: Path, outside: Path) -> None:
    (ws / "apps").symlink_to(outside)
    found = discover(ws)
    assert found.apps == ()
    skip = only_skip(found)
    assert skip.file == "apps" and "apps is a symlink" in skip.reason
    assert isinstance(find_app(ws, "evil"), SkippedApp)


def test_apps_that_is_a_file_is_one_skip(ws: Path) -> None:
    (ws / "apps").write_text("not a folder")
    skip = only_skip(discover(ws))
    assert skip.file == "apps" and "apps is a regular file, not a folder" in skip.reason


@pytest.mark.parametrize(
    ("folder", "says"),
    [
        ("Note-Taker", "did you mean 'note-taker'?"),
        ("note taker", "is not an app id"),
        ("note_taker", "is not an app id"),
        ("-x", "starting with a letter"),
        ("a" * 64, "has 64 characters"),
        ("caf\udcc3", "is not an app id"),  # a name that is not UTF-8 on disk
        ("bell\x07", "is not an app id"),
    ],
)
def test_a_folder_whose_name_is_no_app_id_is_skipped(ws: Path, folder: str, says: str) -> None:
    (ws / "apps" / folder).mkdir(parents=True)
    skip = only_skip(discover(ws))
    assert skip.field == "name" and says in skip.reason
    assert "\x07" not in skip.describe() and "\udcc3" not in skip.describe()


def test_at_most_max_apps_are_read_and_the_rest_is_one_skip(ws: Path) -> None:
    names = [f"app-{i:03d}" for i in range(MAX_APPS + 3)]
    for name in names:
        make_app(ws, name)
    found = discover(ws)
    assert [a.id for a in found.apps] == names[:MAX_APPS]
    skip = only_skip(found)
    assert skip.file == "apps"
    assert (
        f"3 app folders beyond the first {MAX_APPS} (in name order) were not read "
        "(app-100, app-101, app-102)"
    ) in skip.reason


def test_a_huge_apps_folder_is_read_only_up_to_its_cap(
    ws: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(discovery, "MAX_APPS_DIR_ENTRIES", 10)
    for i in range(25):
        (ws / "apps" / f"x{i:02d}").mkdir(parents=True)
    found = discover(ws)
    # Ten entries looked at, each an app folder without a manifest, and one skip saying so.
    assert len(found.skipped) == 11
    assert "apps/ holds more than 10 entries" in found.skipped[-1].reason


# --- one app, one folder ----------------------------------------------------------------


def test_find_app_answers_for_one_app(ws: Path) -> None:
    make_app(ws, "note-taker")
    found = find_app(ws, "note-taker")
    assert isinstance(found, DiscoveredApp) and found.tool_name == "app_note_taker"
    assert find_app(ws, "missing") is None
    bad = find_app(ws, "../ws")
    assert isinstance(bad, SkippedApp) and "is not an app id" in bad.reason


def test_find_app_in_a_workspace_without_apps_finds_none(ws: Path) -> None:
    assert find_app(ws, "note-taker") is None


def test_an_install_source_is_checked_under_any_folder_name(tmp_path: Path) -> None:
    source = tmp_path / "note-taker-v2"
    source.mkdir()
    (source / "APP.md").write_text(manifest("note-taker"))
    found = check_app_folder(source)
    assert isinstance(found, DiscoveredApp) and found.id == "note-taker"


def test_a_bad_install_source_names_the_file_and_line(tmp_path: Path) -> None:
    source = tmp_path / "src"
    source.mkdir()
    (source / "APP.md").write_text(manifest("Bad-Name"))
    found = check_app_folder(source)
    assert isinstance(found, SkippedApp)
    assert found.describe().startswith(f"{source}/APP.md:2: name: 'Bad-Name' is not an app id")
    missing = check_app_folder(tmp_path / "nowhere")
    assert isinstance(missing, SkippedApp) and "cannot open the app folder" in missing.reason
    fifo = tmp_path / "fifo-src"
    fifo.mkdir()
    os.mkfifo(fifo / "APP.md")
    skip = within(lambda: check_app_folder(fifo))
    assert isinstance(skip, SkippedApp) and "FIFO" in skip.reason


# --- the audit --------------------------------------------------------------------------


async def test_each_skip_is_audited_durably_with_its_file_line_field_and_reason(
    ws: Path, tmp_path: Path
) -> None:
    make_app(ws, "good")
    make_app(ws, "bad", manifest("bad").replace("name: bad", "name: Bad"))
    (ws / "apps" / "linked").symlink_to(tmp_path)
    found = await trio.to_thread.run_sync(discover_apps, ws)
    log_path = tmp_path / "audit" / "audit.jsonl"
    async with open_audit_log(log_path, fsync=False) as audit:
        await record_skipped_apps(audit, found.skipped, run_id="r" * 32)
        # Durable when it returns: another reader sees the entries already.
        entries = [e for e in read_entries(log_path) if e.get("event") == AuditEvent.APP_SKIPPED]
        assert [e["detail"]["file"] for e in entries] == ["apps/bad/APP.md", "apps/linked"]
        first = entries[0]
        assert first["runId"] == "r" * 32
        assert (first["detail"]["line"], first["detail"]["field"]) == (2, "name")
        assert "did you mean 'bad'?" in first["detail"]["reason"]
        assert first["detail"]["problems"] == 1
        assert entries[1]["detail"]["line"] is None
        await record_skipped_apps(audit, ())  # nothing skipped: nothing written
    assert verify_file(log_path).ok
