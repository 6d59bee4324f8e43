"""`gatewayd install-systemd` in a staging root (gatewayd/install.py): the units it writes,
what it refuses before writing anything, and how an upgrade tells a unit an earlier
version wrote from one with local changes."""

from __future__ import annotations

from pathlib import Path

import pytest

from gatewayd import install
from gatewayd.config import SHIPPED_POLICY_DIR
from gatewayd.install import InstallError, install_systemd, stamped

PROGRAM = Path("/opt/gatewayd/venv/bin/gatewayd")
CHECKOUT = Path(__file__).resolve().parents[2]


@pytest.fixture
def root(tmp_path: Path) -> Path:
    """A staging root holding make install's layout: the script and its bin/python."""
    staged = tmp_path / "root"
    program = staged / PROGRAM.relative_to("/")
    program.parent.mkdir(parents=True)
    program.write_text("#!/opt/gatewayd/venv/bin/python\n")
    program.chmod(0o755)
    program.with_name("python").symlink_to("/usr/bin/python3")
    return staged


def test_the_shipped_files_are_package_data_that_a_checkout_links_to_its_own() -> None:
    # In a checkout gatewayd/data/* link to the top-level directories the docs name.
    assert SHIPPED_POLICY_DIR == CHECKOUT / "policies"
    assert install.SOURCE_UNIT == CHECKOUT / "systemd" / "gatewayd.service"
    for source in (install.SOURCE_SOCKET, install.SOURCE_SYSUSERS, install.SOURCE_TMPFILES):
        assert source.parent == CHECKOUT / "systemd" and source.is_file()


def test_the_units_the_socket_and_tmpfiles_are_written_and_nothing_runs_in_a_staging_root(
    root: Path,
) -> None:
    done = install_systemd(root, program=PROGRAM)
    unit = root / "etc/systemd/system/gatewayd.service"
    socket_unit = root / "etc/systemd/system/gatewayd.socket"
    tmpfiles = root / "etc/tmpfiles.d/gatewayd.conf"
    assert ("written", unit) in done.actions and ("written", socket_unit) in done.actions
    assert unit.read_text() == stamped(install.unit_text(PROGRAM))
    assert f"ExecStart={PROGRAM} serve" in unit.read_text()
    assert socket_unit.read_text() == stamped(install.SOURCE_SOCKET.read_text())
    assert tmpfiles.read_text().splitlines()[-1] == "d /run/netns 0755 root root -"
    assert done.next_steps == [
        f"systemd-sysusers {root}/etc/sysusers.d/gatewayd.conf",
        f"systemd-tmpfiles --create {tmpfiles}",
        "systemctl daemon-reload",
        "systemctl enable --now gatewayd.socket gatewayd.service",
    ]
    again = install_systemd(root, program=PROGRAM)
    assert ("unchanged", unit) in again.actions and ("unchanged", socket_unit) in again.actions


def test_an_upgrade_replaces_a_unit_an_earlier_version_wrote_and_nobody_changed(
    root: Path,
) -> None:
    unit = root / "etc/systemd/system/gatewayd.service"
    unit.parent.mkdir(parents=True)
    unit.write_text(stamped("[Service]\nExecStart=/opt/gatewayd/venv/bin/gatewayd serve\n"))
    done = install_systemd(root, program=PROGRAM)
    assert ("written", unit) in done.actions
    assert unit.read_text() == stamped(install.unit_text(PROGRAM))


@pytest.mark.parametrize(
    "existing",
    [
        stamped("[Service]\nExecStart=/x\n") + "# a local change\n",  # edited after
        "[Service]\nExecStart=/x\n",  # no stamp: written by hand or by an old version
    ],
)
def test_a_unit_with_local_changes_is_kept_and_neither_unit_written_without_force(
    root: Path, existing: str
) -> None:
    unit = root / "etc/systemd/system/gatewayd.service"
    socket_unit = root / "etc/systemd/system/gatewayd.socket"
    socket_unit.parent.mkdir(parents=True)
    socket_unit.write_text(existing)
    with pytest.raises(InstallError) as caught:
        install_systemd(root, program=PROGRAM)
    assert f"{socket_unit} exists and differs from this version's unit" in str(caught.value)
    assert "--force" in str(caught.value) and "gatewayd.socket.d/*.conf" in str(caught.value)
    assert socket_unit.read_text() == existing and not unit.exists()
    install_systemd(root, program=PROGRAM, force=True)
    assert socket_unit.read_text() == stamped(install.SOURCE_SOCKET.read_text())


def test_a_program_the_unit_would_hide_is_refused_before_anything_is_written(
    tmp_path: Path,
) -> None:
    root = tmp_path / "root"
    hidden = root / "root/cogni/.venv/bin/gatewayd"
    hidden.parent.mkdir(parents=True)
    hidden.write_text("#!/usr/bin/python3\n")
    hidden.chmod(0o755)
    with pytest.raises(InstallError) as caught:
        install_systemd(root, program=Path("/root/cogni/.venv/bin/gatewayd"))
    message = str(caught.value)
    assert "lies under /root, which the unit's ProtectHome= hides from the service" in message
    assert "make install" in message and "/opt/gatewayd/venv" in message
    assert sorted(p.relative_to(root).as_posix() for p in root.rglob("*") if p.is_file()) == [
        "root/cogni/.venv/bin/gatewayd"
    ]


def test_a_program_the_service_user_cannot_run_is_refused(root: Path) -> None:
    (root / "opt/gatewayd").chmod(0o700)
    with pytest.raises(InstallError) as caught:
        install_systemd(root, program=PROGRAM)
    assert "may not search the directory /opt/gatewayd (mode 0700" in str(caught.value)
    assert not (root / "etc").exists()


def test_every_shipped_file_is_package_data_of_the_wheel() -> None:
    # A file added to policies/ or systemd/ that no package-data pattern names would be
    # missing from an installed gatewayd (make install builds a wheel).
    import tomllib

    patterns = tomllib.loads((CHECKOUT / "pyproject.toml").read_text())["tool"]["setuptools"][
        "package-data"
    ]["gatewayd"]
    package = CHECKOUT / "gatewayd"
    shipped = {path.resolve() for pattern in patterns for path in package.glob(pattern)}
    wanted = {
        path.resolve()
        for top in ("policies", "systemd")
        for path in (CHECKOUT / top).rglob("*")
        if path.is_file()
    }
    assert wanted - shipped == set()
    assert (package / "data/policies").resolve() == CHECKOUT / "policies"


def test_every_path_the_unit_binds_writable_is_made_before_the_start() -> None:
    # ReadWritePaths= binds only what exists when the service starts: a path made later
    # (the walk-through's `mkdir -p /srv/workspaces/first` after `systemctl start`) stays
    # read-only to the service, and a read-write workspace lent from it fails with EROFS.
    unit = install.SOURCE_UNIT.read_text()
    writable = {
        entry.lstrip("-+")
        for line in unit.splitlines()
        if line.startswith("ReadWritePaths=")
        for entry in line.split("=", 1)[1].split()
    }
    made = {
        fields[1]
        for line in install.SOURCE_TMPFILES.read_text().splitlines()
        if (fields := line.split()) and fields[0] == "d"
    }
    assert writable and writable <= made, f"not made at boot: {sorted(writable - made)}"


def test_a_failing_systemd_step_is_an_install_error_naming_it_and_what_it_said() -> None:
    with pytest.raises(InstallError) as caught:
        install._run_step(["sh", "-c", "echo 'no such group gatewayd' >&2; exit 3"])
    message = str(caught.value)
    assert "failed (exit 3): no such group gatewayd" in message
    assert "run gatewayd install-systemd again" in message
    with pytest.raises(InstallError, match="systemd-sysusers-missing could not run"):
        install._run_step(["systemd-sysusers-missing"])
