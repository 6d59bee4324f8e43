"""An app's data/ gets its own mode back after an invocation (the app owned it while
lent and may have opened it to everyone), without following a symlink."""

from __future__ import annotations

import errno
import stat
from pathlib import Path

import pytest

from gatewayd.apps.child import DATA_DIR_MODE, restore_data_dir


def test_a_data_folder_opened_to_everyone_is_closed_again(tmp_path: Path) -> None:
    data = tmp_path / "data"
    data.mkdir()
    (data / "note.md").write_text("x")
    data.chmod(0o777)
    restore_data_dir(data)
    assert stat.S_IMODE(data.stat().st_mode) == DATA_DIR_MODE == 0o700
    assert (data / "note.md").read_text() == "x"  # its entries are the app's to keep


def test_a_symlink_in_its_place_is_refused_and_its_target_left_alone(tmp_path: Path) -> None:
    target = tmp_path / "elsewhere"
    target.mkdir()
    target.chmod(0o755)
    (tmp_path / "data").symlink_to(target)
    with pytest.raises(OSError) as caught:
        restore_data_dir(tmp_path / "data")
    assert caught.value.errno in (errno.ELOOP, errno.ENOTDIR)
    assert stat.S_IMODE(target.stat().st_mode) == 0o755
