"""The session store against someone else writing the base while a commit applies: a
second commit into the same base, a run still live on it, a writer swapping a name the
commit is about to change for a symlink. Real overlay mounts and real directories (the
race is made deterministic by acting at the exact step where it would happen)."""

from __future__ import annotations

import os
import re
import stat
import subprocess
from collections.abc import Iterator, Mapping
from pathlib import Path

import pytest

from gatewayd.workspace import overlay
from gatewayd.workspace.session import DIR_FLAGS
from gatewayd.workspace.store import (
    DeltaTooLarge,
    WorkspaceBusy,
    WorkspaceConflict,
    WorkspaceStore,
)
from tests.workspace_helpers import unmount_all_under

RUN = "a" * 32
OTHER_RUN = "b" * 32
KEEP_S = 3600

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="overlay mounts need root")


@pytest.fixture
def where(tmp_path: Path) -> Iterator[Path]:
    yield tmp_path
    unmount_all_under(tmp_path)


def make_base(where: Path) -> Path:
    base = where / "base"
    (base / "src").mkdir(parents=True)
    (base / "src" / "main.py").write_text("print(1)\n")
    return base


def kept_session(store: WorkspaceStore, base: Path, run_id: str, text: str) -> None:
    """A run that rewrote src/main.py, ended and kept."""
    handle = store.open_session(
        run_id, base, "overlay", on_end="keep", keep_for_s=KEEP_S, max_delta_bytes=None
    )
    (handle.root / "src" / "main.py").write_text(text)
    store.end_of_run(run_id)


def test_a_second_commit_into_the_base_never_interleaves_with_the_first(where: Path) -> None:
    """Two kept sessions rewrite one file. While the first commit is between its conflict
    check and its apply, the second is asked for: it must not pass its own check against
    a base the first is about to change (the first would then overwrite the second's
    change with no conflict reported)."""
    base = make_base(where)
    second_outcome: list[BaseException | None] = []

    def record(event: object, run_id: str, detail: Mapping[str, object]) -> None:
        # workspace_committed of RUN is written after its check, before its apply.
        if str(event) == "workspace_committed" and run_id == RUN and "error" not in detail:
            try:
                WorkspaceStore(where / "state").commit(OTHER_RUN, by="second")
                second_outcome.append(None)
            except (WorkspaceBusy, WorkspaceConflict) as exc:
                second_outcome.append(exc)

    store = WorkspaceStore(where / "state", record=record)
    kept_session(store, base, RUN, "first\n")
    kept_session(store, base, OTHER_RUN, "second\n")
    store.commit(RUN, by="first")
    assert (base / "src" / "main.py").read_text() == "first\n"
    [outcome] = second_outcome
    assert isinstance(outcome, WorkspaceBusy), "the second commit ran inside the first"
    assert "another commit" in str(outcome) and "try again" in str(outcome)
    # Asked again once the first is done, the conflict check sees the first's change.
    with pytest.raises(WorkspaceConflict, match=re.escape("src/main.py")):
        store.commit(OTHER_RUN)
    assert (base / "src" / "main.py").read_text() == "first\n"


@pytest.mark.parametrize("inside", [False, True], ids=["same-base", "base-inside-it"])
def test_a_commit_into_a_base_a_live_run_is_on_is_refused(where: Path, inside: bool) -> None:
    """A kept session's base is the lower layer of another run's live overlay (or holds
    it): writing it would change a lower layer under a live overlay, and write into a
    tree lent to that run's uid."""
    base = make_base(where)
    store = WorkspaceStore(where / "state")
    kept_session(store, base, RUN, "kept\n")
    live_base = base / "src" if inside else base
    live = store.open_session(
        OTHER_RUN, live_base, "overlay", on_end="keep", keep_for_s=KEEP_S, max_delta_bytes=None
    )
    for operation in (store.commit, WorkspaceStore(where / "state").commit):
        with pytest.raises(WorkspaceBusy) as caught:
            operation(RUN)
        message = str(caught.value)
        assert OTHER_RUN in message and "live" in message and "when it ends" in message
    assert (base / "src" / "main.py").read_text() == "print(1)\n", "nothing was written"
    assert store.info(RUN).state == "kept"
    live.seal()
    store.end_of_run(OTHER_RUN)
    store.commit(RUN)
    assert (base / "src" / "main.py").read_text() == "kept\n"


def test_a_host_discard_into_a_base_a_live_run_is_on_is_refused(where: Path) -> None:
    """A host session's discard restores its snapshot into the base: the same write."""
    base = make_base(where)
    store = WorkspaceStore(where / "state")
    handle = store.open_session(
        RUN, base, "host", on_end="keep", keep_for_s=KEEP_S, max_delta_bytes=None
    )
    (handle.root / "src" / "main.py").write_text("host run\n")
    store.end_of_run(RUN)
    store.open_session(
        OTHER_RUN, base, "overlay", on_end="keep", keep_for_s=KEEP_S, max_delta_bytes=None
    )
    with pytest.raises(WorkspaceBusy, match=OTHER_RUN):
        store.discard(RUN)
    assert (base / "src" / "main.py").read_text() == "host run\n"
    store.end_of_run(OTHER_RUN)
    store.discard(RUN)
    assert (base / "src" / "main.py").read_text() == "print(1)\n"


def test_a_replaced_directory_is_never_chmodded_through_a_symlink(
    where: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The commit makes a directory where the base had a file, then gives it the mode
    the run gave it. A writer in the base (the run's uid, while the base is lent) that
    swaps the new directory for a symlink to a host file in between must not get that
    file's mode changed by gatewayd (root)."""
    base = where / "base"
    base.mkdir()
    (base / "d").write_text("a file the run replaced by a directory\n")
    victim = where / "victim"
    victim.write_text("secret\n")
    victim.chmod(0o600)
    upper = where / "upper"
    (upper / "d").mkdir(parents=True)
    (upper / "d").chmod(0o777)
    real_mkdir = os.mkdir

    def swapping_mkdir(path: str, mode: int = 0o777, *, dir_fd: int | None = None) -> None:
        real_mkdir(path, mode, dir_fd=dir_fd)
        if path == "d" and dir_fd is not None:
            # The racing writer: the new directory becomes a link to the victim.
            os.rmdir(path, dir_fd=dir_fd)
            os.symlink(str(victim), path, dir_fd=dir_fd)

    # The commit calls os.mkdir (the module's own name is os).
    monkeypatch.setattr(os, "mkdir", swapping_mkdir)
    base_fd = os.open(base, DIR_FLAGS)
    try:
        with pytest.raises(OSError):
            overlay.apply_operation(base_fd, upper, "replace_dir", "d")
    finally:
        os.close(base_fd)
    assert stat.S_IMODE(os.stat(victim).st_mode) == 0o600
    assert victim.read_text() == "secret\n"


@pytest.mark.parametrize("action", ["remove", "replace"])
def test_a_directory_whose_name_is_not_utf8_seals_and_commits(where: Path, action: str) -> None:
    """File names are bytes: a run that removes (or replaces) a base directory named in
    no encoding is sealed, listed and committed like any other."""
    base = make_base(where)
    odd = os.fsdecode(b"d\xff")
    (base / odd).mkdir()
    (base / odd / "x").write_text("x\n")
    store = WorkspaceStore(where / "state")
    handle = store.open_session(
        RUN, base, "overlay", on_end="keep", keep_for_s=KEEP_S, max_delta_bytes=None
    )
    subprocess.run(["rm", "-rf", os.fsencode(handle.root / odd)], check=True)
    if action == "replace":
        (handle.root / odd).write_text("now a file\n")
    assert store.end_of_run(RUN).startswith("kept until ")
    WorkspaceStore(where / "state").commit(RUN)
    if action == "replace":
        assert (base / odd).read_text() == "now a file\n"
    else:
        assert not (base / odd).exists()


def test_sparse_files_do_not_carry_a_delta_past_its_limit_into_the_base(where: Path) -> None:
    """The delta's tmpfs counts the blocks a file holds; a sparse file holds almost none,
    and the commit's copy writes every byte of it. A run that leaves files far larger
    than its limit that way is refused at commit (limit_exceeded), and nothing is written."""
    base = make_base(where)
    limit = 1 << 20
    store = WorkspaceStore(where / "state")
    handle = store.open_session(
        RUN, base, "overlay", on_end="commit", keep_for_s=KEEP_S, max_delta_bytes=limit
    )
    for number in range(4):
        with open(handle.root / f"hole{number}.bin", "wb") as sparse:
            sparse.truncate(64 << 20)
    outcome = store.end_of_run(RUN)
    assert "commit refused" in outcome and f"past its limit of {limit}" in outcome, outcome
    assert store.info(RUN).delta_bytes == 4 * (64 << 20)
    with pytest.raises(DeltaTooLarge) as caught:
        WorkspaceStore(where / "state").commit(RUN)
    assert f"gatewayd workspace discard {RUN}" in str(caught.value)
    assert sorted(os.listdir(base)) == ["src"], "nothing was written"
    store.discard(RUN)


def test_what_a_commit_makes_belongs_to_the_base_s_owner(where: Path) -> None:
    """gatewayd commits as root into a directory someone else owns: the directories,
    files and symlinks it makes there are that owner's, as the files it replaces were
    (a root-owned directory in the operator's tree is one they can no longer change)."""
    base = make_base(where)
    owner = (4321, 4322)
    for path in (base, base / "src", base / "src" / "main.py"):
        os.chown(path, *owner)
    store = WorkspaceStore(where / "state")
    handle = store.open_session(
        RUN, base, "overlay", on_end="keep", keep_for_s=KEEP_S, max_delta_bytes=None
    )
    (handle.root / "new" / "deeper").mkdir(parents=True)
    (handle.root / "new" / "deeper" / "f.txt").write_text("f\n")
    os.symlink("new/deeper/f.txt", handle.root / "link")
    (handle.root / "src" / "main.py").write_text("print(2)\n")
    store.end_of_run(RUN)
    store.commit(RUN)
    for rel in ("new", "new/deeper", "new/deeper/f.txt", "link", "src/main.py"):
        st = os.lstat(base / rel)
        assert (st.st_uid, st.st_gid) == owner, rel
