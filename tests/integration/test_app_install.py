"""Installing an app into a workspace, from real folders: what is copied, every hostile
source refused with a message naming the file and the fix, replacement keeping data/,
concurrent installs, a crash at each step of a replacement, and the CLI."""

from __future__ import annotations

import os
import shutil
import stat
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from gatewayd import files
from gatewayd.apps import install as install_module
from gatewayd.apps.discovery import discover_apps
from gatewayd.apps.install import (
    DATA_MODE,
    MAX_INSTALL_DEPTH,
    MAX_INSTALL_ENTRIES,
    MAX_INSTALL_FILE_BYTES,
    MAX_INSTALL_FILES,
    REPLACING_PREFIX,
    STAGING_PREFIX,
    InstallError,
    install_app,
)
from gatewayd.apps.workspaces import recorded_workspaces
from tests.conftest import ROOT

NOTE_TAKER = ROOT / "apps" / "examples" / "note-taker"
GATEWAYD = str(Path(sys.executable).parent / "gatewayd")
COMMAND_TIMEOUT_S = 60


@pytest.fixture
def source(tmp_path: Path) -> Path:
    src = tmp_path / "src-folder"
    shutil.copytree(NOTE_TAKER, src)
    (src / "scripts").mkdir()
    (src / "scripts" / "tidy.sh").write_text("#!/bin/sh\necho tidy\n")
    (src / "scripts" / "tidy.sh").chmod(0o755)
    return src


@pytest.fixture
def workspace(tmp_path: Path) -> Path:
    ws = tmp_path / "ws"
    ws.mkdir()
    return ws


def apps_entries(workspace: Path) -> list[str]:
    return sorted(os.listdir(workspace / "apps"))


def refused(src: Path, workspace: Path, *needles: str, replace: bool = False) -> str:
    with pytest.raises(InstallError) as caught:
        install_app(src, workspace, replace=replace)
    message = str(caught.value)
    for needle in needles:
        assert needle in message, message
    return message


# --- what an install does ----------------------------------------------------------------


def test_install_copies_the_folder_under_the_manifests_name(source: Path, workspace: Path) -> None:
    done = install_app(source, workspace)
    folder = workspace / "apps" / "note-taker"
    assert done.id == "note-taker" and done.tool_name == "app_note_taker"
    assert done.app.folder == folder and not done.replaced
    assert (folder / "APP.md").read_bytes() == (source / "APP.md").read_bytes()
    assert (folder / "scripts" / "tidy.sh").read_text() == "#!/bin/sh\necho tidy\n"
    assert stat.S_IMODE((folder / "scripts" / "tidy.sh").stat().st_mode) == 0o755
    assert stat.S_IMODE((folder / "APP.md").stat().st_mode) == 0o644
    assert stat.S_IMODE((folder / "data").stat().st_mode) == DATA_MODE
    assert stat.S_IMODE(folder.stat().st_mode) == 0o755
    assert (done.files, done.bytes) == (2, folder.joinpath("APP.md").stat().st_size + 20)
    # Discovery finds it, and no staging folder is left.
    assert [app.id for app in discover_apps(workspace).apps] == ["note-taker"]
    assert apps_entries(workspace) == ["note-taker"]


def test_an_existing_app_is_refused_without_replace(source: Path, workspace: Path) -> None:
    install_app(source, workspace)
    before = (workspace / "apps" / "note-taker" / "APP.md").read_bytes()
    refused(source, workspace, "already installed", "--replace")
    assert (workspace / "apps" / "note-taker" / "APP.md").read_bytes() == before
    assert apps_entries(workspace) == ["note-taker"]


def test_replace_keeps_data_byte_for_byte_and_the_same_directory(
    source: Path, workspace: Path
) -> None:
    install_app(source, workspace)
    data = workspace / "apps" / "note-taker" / "data"
    (data / "sub").mkdir()
    payload = os.urandom(100_000)
    (data / "sub" / "notes.bin").write_bytes(payload)
    data_inode = data.stat().st_ino
    (source / "APP.md").write_text(
        (source / "APP.md").read_text().replace("title: Note Taker", "title: Note Taker 2")
    )
    (source / "data").mkdir()
    (source / "data" / "seed.md").write_text("seed from the source")
    done = install_app(source, workspace, replace=True)
    assert done.replaced and done.kept_data
    assert done.app.manifest.title == "Note Taker 2"
    assert (data / "sub" / "notes.bin").read_bytes() == payload
    assert data.stat().st_ino == data_inode  # moved, never copied
    assert not (data / "seed.md").exists()  # the installed data wins
    assert apps_entries(workspace) == ["note-taker"]


def test_first_install_takes_the_sources_seed_data(source: Path, workspace: Path) -> None:
    (source / "data").mkdir()
    (source / "data" / "seed.md").write_text("seed")
    install_app(source, workspace)
    assert (workspace / "apps" / "note-taker" / "data" / "seed.md").read_text() == "seed"


def test_apps_folder_is_made_if_missing_and_never_followed_as_a_link(
    source: Path, workspace: Path, tmp_path: Path
) -> None:
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (workspace / "apps").symlink_to(elsewhere)
    refused(source, workspace, "apps is a symlink", "remove it")
    assert list(elsewhere.iterdir()) == []


# --- hostile sources ---------------------------------------------------------------------


@pytest.mark.parametrize(
    "target",
    ["/etc/passwd", "OTHER_DATA", "LOOP", "INSIDE"],
)
def test_any_symlink_in_the_source_is_refused(
    source: Path, workspace: Path, tmp_path: Path, target: str
) -> None:
    other = tmp_path / "other-src"
    shutil.copytree(NOTE_TAKER, other)
    other_text = (other / "APP.md").read_text().replace("name: note-taker", "name: other")
    (other / "APP.md").write_text(other_text)
    install_app(other, workspace)
    (workspace / "apps" / "other" / "data" / "secret").write_text("other's secret")
    link = source / "scripts" / "link"
    if target == "OTHER_DATA":
        link.symlink_to(workspace / "apps" / "other" / "data")
    elif target == "LOOP":
        link.symlink_to(link)
    elif target == "INSIDE":
        link.symlink_to("tidy.sh")  # stays inside, still refused
    else:
        link.symlink_to(target)
    refused(source, workspace, "scripts/link is a symlink", "replace it by the file")
    assert apps_entries(workspace) == ["other"]


def test_a_symlinked_manifest_is_refused(source: Path, workspace: Path, tmp_path: Path) -> None:
    real = tmp_path / "APP.md"
    (source / "APP.md").rename(real)
    (source / "APP.md").symlink_to(real)
    refused(source, workspace, "APP.md is a symlink")


def test_a_symlinked_source_is_refused(source: Path, workspace: Path, tmp_path: Path) -> None:
    link = tmp_path / "link-to-src"
    link.symlink_to(source)
    refused(link, workspace, "is a symlink", "name the app folder itself", str(source))
    assert not (workspace / "apps" / "note-taker").exists()


def test_a_source_that_is_a_file_or_missing_is_refused(workspace: Path, tmp_path: Path) -> None:
    (tmp_path / "file").write_text("x")
    refused(tmp_path / "file", workspace, "is not a folder", "APP.md")
    refused(tmp_path / "missing", workspace, "cannot open the source", "No such file")


def test_a_fifo_is_refused_without_blocking(source: Path, workspace: Path) -> None:
    os.mkfifo(source / "scripts" / "pipe")
    refused(source, workspace, "scripts/pipe is a FIFO (named pipe)", "only folders and regular")


def test_a_socket_is_refused(source: Path, workspace: Path) -> None:
    import socket

    with socket.socket(socket.AF_UNIX) as sock:
        sock.bind(str(source / "sock"))
        refused(source, workspace, "sock is a socket")


def test_a_device_is_refused(source: Path, workspace: Path) -> None:
    try:
        os.mknod(source / "null", stat.S_IFCHR | 0o666, os.makedev(1, 3))
    except PermissionError:
        pytest.skip("mknod needs CAP_MKNOD")
    refused(source, workspace, "null is a device")


def test_a_hard_linked_file_is_refused(source: Path, workspace: Path, tmp_path: Path) -> None:
    outside = tmp_path / "outside-secret"
    outside.write_text("secret")
    os.link(outside, source / "scripts" / "copy")
    refused(source, workspace, "scripts/copy has several hard links", "cp it to a new name")
    assert apps_entries(workspace) == []


def test_a_file_over_the_size_cap_is_refused(source: Path, workspace: Path) -> None:
    with open(source / "big.bin", "wb") as out:
        out.truncate(MAX_INSTALL_FILE_BYTES + 1)  # sparse: no real disk
    refused(source, workspace, "big.bin is larger than", str(MAX_INSTALL_FILE_BYTES))
    assert apps_entries(workspace) == []


def test_a_real_file_over_a_lowered_cap_is_refused(
    source: Path, workspace: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    (source / "grows.bin").write_bytes(b"x" * 3000)
    monkeypatch.setattr(install_module, "MAX_INSTALL_FILE_BYTES", 2000)
    refused(source, workspace, "grows.bin is larger than 2000")


def test_the_total_size_cap(source: Path, workspace: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    for n in range(3):
        (source / f"part{n}.bin").write_bytes(b"x" * 1000)
    monkeypatch.setattr(install_module, "MAX_INSTALL_BYTES", 2500)
    refused(source, workspace, "holds more than 2500 bytes", "leave large files out")
    assert apps_entries(workspace) == []


def test_too_many_files_are_refused(source: Path, workspace: Path) -> None:
    many = source / "many"
    many.mkdir()
    for n in range(MAX_INSTALL_FILES):
        (many / f"f{n}").touch()
    refused(source, workspace, f"more than {MAX_INSTALL_FILES} files")
    assert apps_entries(workspace) == []


@pytest.mark.parametrize("shape", ["wide", "deep-and-wide"])
def test_too_many_folders_are_refused_before_they_are_copied(
    source: Path, workspace: Path, shape: str
) -> None:
    """Empty folders cost no bytes but an inode, a directory block and an fsync each:
    every entry counts, and a listing stops being read at the cap."""
    if shape == "wide":
        for n in range(MAX_INSTALL_ENTRIES + 1):
            (source / f"d{n}").mkdir()
    else:
        for n in range(MAX_INSTALL_ENTRIES // 3 + 1):  # each: itself and two below
            for level in ("a", "b"):
                (source / f"d{n}" / level).mkdir(parents=True, exist_ok=True)
    refused(source, workspace, f"more than {MAX_INSTALL_ENTRIES} files and folders")
    assert apps_entries(workspace) == []


def test_too_deep_is_refused(source: Path, workspace: Path) -> None:
    deep = source
    for n in range(MAX_INSTALL_DEPTH + 1):
        deep = deep / f"d{n}"
    deep.mkdir(parents=True)
    refused(source, workspace, f"more than {MAX_INSTALL_DEPTH} folders deep", "flatten it")
    # Exactly at the cap is fine.
    shutil.rmtree(source / "d0")
    (source.joinpath(*(f"d{n}" for n in range(MAX_INSTALL_DEPTH)))).mkdir(parents=True)
    install_app(source, workspace)


@pytest.mark.parametrize(
    ("name", "needle"),
    [
        ("../x", "name"),
        ("Bad_Id", "name"),
        ("", "name"),
        ("apps", None),
    ],
)
def test_a_bad_id_is_refused(source: Path, workspace: Path, name: str, needle: str | None) -> None:
    text = (source / "APP.md").read_text().replace("name: note-taker", f"name: '{name}'")
    (source / "APP.md").write_text(text)
    if needle is None:  # a valid id that is also the folder's name: installs as apps/apps
        assert install_app(source, workspace).id == "apps"
        return
    message = refused(source, workspace, "is not a valid app", "gatewayd apps check")
    assert needle in message
    assert apps_entries(workspace) == []
    assert not (workspace / "x").exists() and not (workspace.parent / "x").exists()


def test_a_manifest_that_does_not_validate_is_refused(source: Path, workspace: Path) -> None:
    (source / "APP.md").write_text("---\nname: x\n---\nno sections\n")
    message = refused(source, workspace, "is not a valid app", "APP.md")
    assert str(source) in message
    assert apps_entries(workspace) == []


def test_no_manifest_is_refused(source: Path, workspace: Path) -> None:
    (source / "APP.md").unlink()
    refused(source, workspace, "there is no APP.md")


def test_a_source_inside_the_apps_folder_is_refused(source: Path, workspace: Path) -> None:
    install_app(source, workspace)
    installed = workspace / "apps" / "note-taker"
    refused(installed, workspace, "lies in", "install from a folder outside it")
    refused(installed / "data", workspace, "lies in")
    refused(workspace / "apps", workspace, "lies in")
    # The workspace itself holds apps/: its walk reaches the folder.
    (workspace / "APP.md").write_bytes((source / "APP.md").read_bytes())
    refused(workspace, workspace, "holds", "(at apps)", "install from the app's own folder")
    assert apps_entries(workspace) == ["note-taker"]


def test_a_bind_mounted_other_name_of_apps_is_still_refused(
    source: Path, workspace: Path, tmp_path: Path
) -> None:
    install_app(source, workspace)
    other_name = tmp_path / "other-name"
    other_name.mkdir()
    done = subprocess.run(
        ["mount", "--bind", str(workspace / "apps"), str(other_name)], check=False
    )
    if done.returncode != 0:
        pytest.skip("bind mounts need CAP_SYS_ADMIN")
    try:
        refused(other_name / "note-taker", workspace, "lies in")
    finally:
        subprocess.run(["umount", str(other_name)], check=True)


# --- concurrency and crashes -------------------------------------------------------------


def test_concurrent_installs_of_one_id_one_wins(source: Path, workspace: Path) -> None:
    results: list[object] = []
    barrier = threading.Barrier(4)

    def one() -> None:
        barrier.wait()
        try:
            results.append(install_app(source, workspace))
        except InstallError as exc:
            results.append(exc)

    threads = [threading.Thread(target=one) for _ in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    errors = [r for r in results if isinstance(r, InstallError)]
    assert len(results) == 4 and len(errors) == 3
    assert all("already installed" in str(e) for e in errors)
    assert apps_entries(workspace) == ["note-taker"]


def test_a_leftover_staging_is_removed_by_the_next_install(source: Path, workspace: Path) -> None:
    (workspace / "apps" / f"{STAGING_PREFIX}dead").mkdir(parents=True)
    (workspace / "apps" / f"{STAGING_PREFIX}dead" / "half").write_text("half a copy")
    done = install_app(source, workspace)
    assert any("interrupted install" in note for note in done.recovered)
    assert apps_entries(workspace) == ["note-taker"]


def test_a_failed_copy_leaves_nothing(
    source: Path, workspace: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def broken(*args: object) -> None:
        raise OSError(5, "Input/output error")

    monkeypatch.setattr(install_module, "write_all", broken)
    refused(source, workspace, "failed", "Input/output error", "nothing was installed")
    assert apps_entries(workspace) == []


def _installed_with_data(source: Path, workspace: Path) -> bytes:
    install_app(source, workspace)
    payload = os.urandom(4096)
    (workspace / "apps" / "note-taker" / "data" / "state").write_bytes(payload)
    return payload


@pytest.mark.parametrize("step", ["before-data-move", "after-data-move", "after-exchange"])
def test_a_crash_during_replacement_loses_nothing_and_is_recovered(
    source: Path, workspace: Path, monkeypatch: pytest.MonkeyPatch, step: str
) -> None:
    payload = _installed_with_data(source, workspace)
    old_manifest = (workspace / "apps" / "note-taker" / "APP.md").read_bytes()
    (source / "APP.md").write_text(
        (source / "APP.md").read_text().replace("title: Note Taker", "title: New")
    )

    class Crash(BaseException):
        """A crash: nothing after it runs, not even the installer's own clean-up."""

    real_rename = files.rename_at
    real_is_real_dir = install_module._is_real_dir
    real_recover = install_module.recover_leftovers

    def crash_before_data_move(dir_fd: int, name: str) -> bool:
        if name == "data" and (workspace / "apps" / f"{REPLACING_PREFIX}note-taker").exists():
            raise Crash
        return real_is_real_dir(dir_fd, name)

    def crash_at_exchange(src_fd: int, src: str, dst_fd: int, dst: str, flags: int) -> None:
        if flags == files.RENAME_EXCHANGE:
            if step == "after-exchange":
                real_rename(src_fd, src, dst_fd, dst, flags)
            raise Crash
        real_rename(src_fd, src, dst_fd, dst, flags)

    if step == "before-data-move":
        monkeypatch.setattr(install_module, "_is_real_dir", crash_before_data_move)
    else:
        monkeypatch.setattr(install_module, "rename_at", crash_at_exchange)
    # The process dies: no clean-up of its own runs.
    monkeypatch.setattr(install_module, "recover_leftovers", lambda fd: ())
    monkeypatch.setattr(install_module, "_remove_quietly", lambda fd, name: None)
    with pytest.raises(Crash):
        install_app(source, workspace, replace=True)
    monkeypatch.undo()

    ids = [app.id for app in discover_apps(workspace).apps]
    assert ids == ["note-taker"]  # a dot folder is left, never a second app
    state = workspace / "apps" / "note-taker" / "data" / "state"
    leftover = workspace / "apps" / f"{REPLACING_PREFIX}note-taker" / "data" / "state"
    # Nothing is lost: the data is in the live app or in the leftover.
    assert (state.exists() and state.read_bytes() == payload) or leftover.read_bytes() == payload

    # The next install recovers: the data is back in the live app, the leftover gone.
    notes = real_recover_via_next_install(source, workspace, real_recover)
    assert notes
    assert state.read_bytes() == payload
    assert apps_entries(workspace) == ["note-taker"]
    manifest = (workspace / "apps" / "note-taker" / "APP.md").read_bytes()
    assert manifest != old_manifest  # the retried replacement went through


def real_recover_via_next_install(source: Path, workspace: Path, _: object) -> tuple[str, ...]:
    return install_app(source, workspace, replace=True).recovered


def test_recovery_never_drops_data_it_cannot_place(source: Path, workspace: Path) -> None:
    install_app(source, workspace)
    leftover = workspace / "apps" / f"{REPLACING_PREFIX}note-taker"
    (leftover / "data").mkdir(parents=True)
    (leftover / "data" / "precious").write_text("keep me")
    refused(source, workspace, "still holds a data/", "keep the one you want", replace=True)
    assert (leftover / "data" / "precious").read_text() == "keep me"
    assert (workspace / "apps" / "note-taker" / "APP.md").exists()


# --- the CLI ----------------------------------------------------------------------------


def gatewayd(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [GATEWAYD, *args],
        capture_output=True,
        text=True,
        timeout=COMMAND_TIMEOUT_S,
        stdin=subprocess.DEVNULL,
        check=False,
    )


def test_cli_install_replace_and_refusals(source: Path, workspace: Path, tmp_path: Path) -> None:
    state = ["--state-dir", str(tmp_path / "state")]  # never the host's own
    done = gatewayd("apps", "install", str(source), "--workspace", str(workspace), *state)
    assert done.returncode == 0, done.stderr
    # Recorded as holding apps, so no run holds its apps folder.
    assert recorded_workspaces(tmp_path / "state") == (workspace.resolve(),)
    assert "installed app note-taker (tool app_note_taker)" in done.stdout
    assert str(workspace / "apps" / "note-taker") in done.stdout

    again = gatewayd("apps", "install", str(source), "--workspace", str(workspace), *state)
    assert again.returncode == 1
    assert again.stderr.startswith("gatewayd apps install: app 'note-taker' is already")
    assert "--replace" in again.stderr and "Traceback" not in again.stderr

    replaced = gatewayd(
        "apps", "install", str(source), "--workspace", str(workspace), "--replace", *state
    )
    assert replaced.returncode == 0, replaced.stderr
    assert "replaced app note-taker" in replaced.stdout and "data/ kept" in replaced.stdout

    os.mkfifo(source / "pipe")
    hostile = gatewayd(
        "apps", "install", str(source), "--workspace", str(workspace), "--replace", *state
    )
    assert hostile.returncode == 1
    assert "pipe is a FIFO" in hostile.stderr and "Traceback" not in hostile.stderr
