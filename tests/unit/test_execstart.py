"""Whether a unit's service could start its ExecStart program (gatewayd/execstart.py):
each way the unit's sandboxing or the service user's permissions would make systemd fail
it with 203/EXEC, on real files in a staging root, and the unit settings read."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from gatewayd.execstart import (
    MAX_INTERPRETER_DEPTH,
    MAX_SYMLINKS,
    ServiceView,
    UnreachableProgram,
    check_exec_start,
    service_view,
)

UNIT = """\
[Unit]
Description=x
# InaccessiblePaths=/commented
[Service]
User=gatewayd
ProtectHome=yes
PrivateTmp=yes
InaccessiblePaths=-/srv/secret +/var/hidden
TemporaryFileSystem=/var/cache:ro
ExecStart=/opt/gatewayd/venv/bin/gatewayd serve
[Install]
InaccessiblePaths=/not-a-service-setting
"""
# The service user does not exist yet: only the "other" permission bits count.
NEW_USER = service_view(UNIT)
PROGRAM = Path("/opt/gatewayd/venv/bin/gatewayd")


def stage(root: Path, path: str, text: str = "", mode: int = 0o755) -> Path:
    """A file at ``path`` (as the service sees it) under the staging ``root``."""
    staged = root / path.lstrip("/")
    staged.parent.mkdir(parents=True, exist_ok=True)
    staged.write_text(text)
    staged.chmod(mode)
    return staged


def link(root: Path, path: str, target: str) -> None:
    staged = root / path.lstrip("/")
    staged.parent.mkdir(parents=True, exist_ok=True)
    staged.symlink_to(target)


def refusal(program: Path, root: Path, view: ServiceView = NEW_USER) -> str:
    with pytest.raises(UnreachableProgram) as caught:
        check_exec_start(program, view, root=root)
    return str(caught.value)


def test_the_units_settings_are_read_from_its_service_section() -> None:
    assert NEW_USER.user == "gatewayd"
    assert NEW_USER.hidden == (
        ("/home", "ProtectHome="),
        ("/root", "ProtectHome="),
        ("/run/user", "ProtectHome="),
        ("/tmp", "PrivateTmp="),
        ("/var/tmp", "PrivateTmp="),
        ("/srv/secret", "InaccessiblePaths="),
        ("/var/hidden", "InaccessiblePaths="),
        ("/var/cache", "TemporaryFileSystem="),
    )


def test_read_only_home_hides_nothing_and_an_empty_assignment_resets_a_list() -> None:
    view = service_view(
        "[Service]\nProtectHome=read-only\nInaccessiblePaths=/a\nInaccessiblePaths=\n"
        "InaccessiblePaths=/b\n"
    )
    assert view.hidden == (("/b", "InaccessiblePaths="),)
    assert view.user == "root" and view.uid == 0


def test_the_installed_layout_passes(tmp_path: Path) -> None:
    # make install's virtualenv: the script names bin/python, a link to this host's
    # /usr/bin/python3 (looked up on the host: the staging root lacks it).
    stage(tmp_path, str(PROGRAM), "#!/opt/gatewayd/venv/bin/python\n")
    link(tmp_path, "/opt/gatewayd/venv/bin/python", "/usr/bin/python3")
    check_exec_start(PROGRAM, NEW_USER, root=tmp_path)


@pytest.mark.parametrize(
    ("place", "setting"),
    [
        ("/root/.venv/bin/gatewayd", "ProtectHome="),
        ("/home/alice/cogni/.venv/bin/gatewayd", "ProtectHome="),
        ("/run/user/1000/gatewayd", "ProtectHome="),
        ("/tmp/checkout/.venv/bin/gatewayd", "PrivateTmp="),
        ("/var/tmp/gatewayd", "PrivateTmp="),
        ("/srv/secret/gatewayd", "InaccessiblePaths="),
        ("/var/cache/gatewayd", "TemporaryFileSystem="),
    ],
)
def test_a_program_the_units_sandboxing_hides_is_refused_with_the_fix(
    tmp_path: Path, place: str, setting: str
) -> None:
    stage(tmp_path, place)
    message = refusal(Path(place), tmp_path)
    hidden_root = next(prefix for prefix, by in NEW_USER.hidden if place.startswith(prefix + "/"))
    assert message.startswith(
        f"ExecStart {place}: {place} lies under {hidden_root}, which the unit's {setting} "
        "hides from the service"
    )
    assert "203/EXEC" in message and "make install" in message


def test_an_interpreter_under_root_behind_the_venvs_link_is_refused(tmp_path: Path) -> None:
    # The case: a checkout's virtualenv whose python links into a pyenv in /root.
    stage(tmp_path, "/srv/cogni/.venv/bin/gatewayd", "#!/srv/cogni/.venv/bin/python\n")
    link(tmp_path, "/srv/cogni/.venv/bin/python", "python3")
    link(tmp_path, "/srv/cogni/.venv/bin/python3", "/root/.pyenv/versions/3.11.7/bin/python3")
    stage(tmp_path, "/root/.pyenv/versions/3.11.7/bin/python3")
    message = refusal(Path("/srv/cogni/.venv/bin/gatewayd"), tmp_path)
    assert message.startswith(
        "ExecStart /srv/cogni/.venv/bin/gatewayd, whose #! interpreter is "
        "/srv/cogni/.venv/bin/python: /root/.pyenv/versions/3.11.7/bin/python3 lies under "
        "/root, which the unit's ProtectHome= hides from the service"
    )


def test_a_relative_link_climbing_into_home_is_followed(tmp_path: Path) -> None:
    stage(tmp_path, "/home/alice/python3")
    link(tmp_path, "/opt/g/bin/gatewayd", "../../../home/alice/python3")
    message = refusal(Path("/opt/g/bin/gatewayd"), tmp_path)
    assert "/home/alice/python3 lies under /home" in message


def test_a_directory_the_service_user_cannot_search_is_refused(tmp_path: Path) -> None:
    stage(tmp_path, "/opt/private/bin/gatewayd")
    (tmp_path / "opt/private").chmod(0o700)
    message = refusal(Path("/opt/private/bin/gatewayd"), tmp_path)
    assert "the service user gatewayd may not search the directory /opt/private" in message
    assert "(mode 0700, owner root:root)" in message
    assert f"chmod o+x {tmp_path}/opt/private" in message


def test_a_file_the_service_user_cannot_execute_is_refused(tmp_path: Path) -> None:
    stage(tmp_path, "/opt/g/gatewayd", mode=0o744)
    message = refusal(Path("/opt/g/gatewayd"), tmp_path)
    assert "the service user gatewayd may not execute /opt/g/gatewayd (mode 0744" in message


def test_a_script_the_service_user_may_execute_but_not_read_is_refused(tmp_path: Path) -> None:
    # Its interpreter opens it as the service user: mode 0711 runs python, which then
    # cannot open the script. A binary (no #!) needs no read bit.
    stage(tmp_path, "/opt/g/gatewayd", "#!/opt/py/python\n", mode=0o711)
    stage(tmp_path, "/opt/py/python", mode=0o711)
    message = refusal(Path("/opt/g/gatewayd"), tmp_path)
    assert "the service user gatewayd may not read /opt/g/gatewayd (mode 0711" in message
    assert "its #! interpreter /opt/py/python must open" in message
    assert f"chmod o+r {tmp_path}/opt/g/gatewayd" in message
    check_exec_start(Path("/opt/py/python"), NEW_USER, root=tmp_path)


def test_an_interpreter_the_service_user_cannot_execute_is_refused(tmp_path: Path) -> None:
    stage(tmp_path, "/opt/g/gatewayd", "#!/opt/py/python\n")
    stage(tmp_path, "/opt/py/python", mode=0o700)
    message = refusal(Path("/opt/g/gatewayd"), tmp_path)
    assert "whose #! interpreter is /opt/py/python" in message and "may not execute" in message


def test_owner_and_group_bits_count_for_an_existing_user(tmp_path: Path) -> None:
    stage(tmp_path, "/opt/mine/gatewayd", mode=0o700)
    (tmp_path / "opt/mine").chmod(0o710)
    me = os.stat(tmp_path / "opt/mine/gatewayd")
    owner = ServiceView((), "owner", me.st_uid, frozenset())
    check_exec_start(Path("/opt/mine/gatewayd"), owner, root=tmp_path)
    # In the directory's group, not the file's owner: the file's 0700 keeps it out.
    member = ServiceView((), "member", me.st_uid + 1, frozenset({me.st_gid}))
    assert "may not execute" in refusal(Path("/opt/mine/gatewayd"), tmp_path, member)


def test_a_link_loop_is_refused(tmp_path: Path) -> None:
    link(tmp_path, "/opt/a", "/opt/b")
    link(tmp_path, "/opt/b", "/opt/a")
    assert f"more than {MAX_SYMLINKS} links" in refusal(Path("/opt/a"), tmp_path)


def test_a_missing_program_or_interpreter_is_refused(tmp_path: Path) -> None:
    assert "/opt/none does not exist" in refusal(Path("/opt/none/gatewayd"), tmp_path)
    stage(tmp_path, "/opt/g/gatewayd", "#!/opt/g/nothing-here\n")
    assert "/opt/g/nothing-here does not exist" in refusal(Path("/opt/g/gatewayd"), tmp_path)


def test_a_directory_or_a_relative_path_is_no_program(tmp_path: Path) -> None:
    (tmp_path / "opt/g").mkdir(parents=True)
    assert "/opt/g is not a regular file" in refusal(Path("/opt/g"), tmp_path)
    assert "is not an absolute path" in refusal(Path("opt/g"), tmp_path)


def test_a_chain_of_interpreters_past_the_kernels_depth_is_refused(tmp_path: Path) -> None:
    for level in range(MAX_INTERPRETER_DEPTH + 1):
        stage(tmp_path, f"/opt/s{level}", f"#!/opt/s{level + 1}\n")
    stage(tmp_path, f"/opt/s{MAX_INTERPRETER_DEPTH + 1}")
    assert "#! interpreters" in refusal(Path("/opt/s0"), tmp_path)
