"""``gatewayd install-systemd``: put the service unit and a starting configuration in
place, idempotently, for this installation of gatewayd.

What it writes (under ``root``, ``/`` by default; tests and packagers give another):

- ``etc/systemd/system/gatewayd.service``: ``systemd/gatewayd.service`` with
  ``ExecStart`` pointing at this installation's ``gatewayd`` program, once that program
  is one the unit's service can run (:mod:`gatewayd.execstart`: not hidden by its
  sandboxing, reachable and executable by its user, and so is its interpreter);
- ``etc/systemd/system/gatewayd.socket``: the control socket, held by systemd across
  the service's restarts (socket activation, :mod:`gatewayd.sdlisten`);
- ``etc/sysusers.d/gatewayd.conf``: the ``gatewayd`` system user the unit runs as
  (made at once by ``systemd-sysusers`` when ``root`` is ``/``);
- ``etc/tmpfiles.d/gatewayd.conf``: ``/run/netns``, which the unit binds writable (made
  at once by ``systemd-tmpfiles`` when ``root`` is ``/``, and at every boot);
- ``etc/gatewayd/gatewayd.yaml``: a commented starting file, only if none exists (an
  operator's configuration is never overwritten);
- ``etc/gatewayd/policies/``: an empty directory for the site's policies.

Each unit is written with a first line holding the SHA-256 of the rest: an upgrade
replaces a unit an earlier version wrote that nobody changed since; a unit with local
changes (or of unknown origin) is replaced only with ``force``, and the same content is
left alone.
``program`` is the path the service sees: under a staging ``root`` it is looked up in
``root`` first (``make install DESTDIR=...``).
``systemctl daemon-reload`` runs only when systemd is the running init and ``root`` is
``/``; otherwise the next steps are printed.
"""

from __future__ import annotations

import hashlib
import os
import re
import shutil
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Final

from gatewayd.execstart import UnreachableProgram, check_exec_start, service_view
from gatewayd.shipped import shipped_path

SOURCE_UNIT: Final = shipped_path("systemd", "gatewayd.service")
SOURCE_SOCKET: Final = SOURCE_UNIT.with_name("gatewayd.socket")
SOURCE_SYSUSERS: Final = SOURCE_UNIT.with_name("gatewayd.sysusers.conf")
SOURCE_TMPFILES: Final = SOURCE_UNIT.with_name("gatewayd.tmpfiles.conf")
UNIT_PATH: Final = Path("etc/systemd/system/gatewayd.service")
SOCKET_PATH: Final = Path("etc/systemd/system/gatewayd.socket")
SYSUSERS_PATH: Final = Path("etc/sysusers.d/gatewayd.conf")
TMPFILES_PATH: Final = Path("etc/tmpfiles.d/gatewayd.conf")
CONFIG_PATH: Final = Path("etc/gatewayd/gatewayd.yaml")
POLICY_DIR: Final = Path("etc/gatewayd/policies")
# The first line of every unit written here: the rest's digest, so that a later version
# can tell a unit nobody edited (replaced on upgrade) from one with local changes.
_STAMP: Final = "# Written by gatewayd install-systemd; sha256 of the lines below: {digest}\n"
_STAMP_RE: Final = re.compile(
    r"# Written by gatewayd install-systemd; sha256 of the lines below: ([0-9a-f]{64})\n"
)
# The program path the shipped unit names; replaced by this installation's.
SHIPPED_PROGRAM: Final = "/opt/gatewayd/venv/bin/gatewayd"

STARTING_CONFIG: Final = """\
# gatewayd's configuration (docs/configuration.md). Read at start and on SIGHUP
# (`systemctl reload gatewayd`). Keys are never written here: name the variable (or the
# systemd credential, LoadCredential=NAME:FILE in the unit) that holds each one.
models: {}
#  assistant:
#    provider: openai
#    model: gpt-4o-mini
#    api_key_env: OPENAI_API_KEY
# Where the workspaces lent to runs live. The unit hides /home and /tmp from gatewayd
# (ProtectHome=, PrivateTmp=) and lets it write /srv/workspaces (ReadWritePaths=): keep
# workspaces there, or name another root here and in a drop-in's ReadWritePaths=.
lendable_roots: [/srv/workspaces]
"""


class InstallError(Exception):
    """Nothing unsafe was written; the message says what is in the way and what to do."""


@dataclass(slots=True)
class Installed:
    """What an install did, path by path: ``written``, ``unchanged`` or ``kept``."""

    actions: list[tuple[str, Path]] = field(default_factory=list)
    next_steps: list[str] = field(default_factory=list)


def unit_text(program: Path) -> str:
    """The unit for the ``gatewayd`` program at ``program``."""
    text = SOURCE_UNIT.read_text()
    if SHIPPED_PROGRAM not in text:
        raise InstallError(f"{SOURCE_UNIT} does not name {SHIPPED_PROGRAM}; it was edited")
    return text.replace(SHIPPED_PROGRAM, str(program))


def install_systemd(
    root: Path = Path("/"), *, program: Path | None = None, force: bool = False
) -> Installed:
    """Write the units, the starting configuration and the policy directory under root.

    Error handling: InstallError for a unit that differs from ours without ``force``, a
    program path that is not an absolute executable or that the unit's service could not
    run (the message says why and how to install it so it can), or a file where a
    directory must be; OSError for what the filesystem refuses (named by the caller).
    Nothing is written when an InstallError is raised for the program.
    """
    program = program or Path(sys.argv[0]).resolve()
    located = _located(program, root)
    if not program.is_absolute() or not os.access(located, os.X_OK):
        raise InstallError(f"{program} is not an executable gatewayd program (an absolute path)")
    if any(c.isspace() for c in str(program)):
        raise InstallError(f"{program} holds white space; systemd's ExecStart would split it")
    wanted = unit_text(program)
    try:
        check_exec_start(program, service_view(wanted), root=root)
    except UnreachableProgram as exc:
        raise InstallError(str(exc)) from exc
    done = Installed()
    units = ((root / UNIT_PATH, wanted), (root / SOCKET_PATH, SOURCE_SOCKET.read_text()))
    if not force:  # both checked before either is written
        for path, text in units:
            _refuse_a_changed_unit(path, text)
    for path, text in units:
        _install_unit(path, text, done=done)
    for source, target in ((SOURCE_SYSUSERS, SYSUSERS_PATH), (SOURCE_TMPFILES, TMPFILES_PATH)):
        path = root / target
        wanted_text = source.read_text()
        if path.exists() and path.read_text() == wanted_text:
            done.actions.append(("unchanged", path))
        else:
            _write(path, wanted_text, 0o644)
            done.actions.append(("written", path))
    config = root / CONFIG_PATH
    if config.exists():
        done.actions.append(("kept", config))
    else:
        _write(config, STARTING_CONFIG, 0o640)
        done.actions.append(("written", config))
    policies = root / POLICY_DIR
    if policies.exists() and not policies.is_dir():
        raise InstallError(f"{policies} exists and is not a directory")
    if not policies.is_dir():
        policies.mkdir(mode=0o755, parents=True)
        done.actions.append(("written", policies))
    else:
        done.actions.append(("kept", policies))
    # The user (the socket unit's SocketUser=) and /run/netns exist before any start.
    for make in (
        ["systemd-sysusers", str(root / SYSUSERS_PATH)],
        ["systemd-tmpfiles", "--create", str(root / TMPFILES_PATH)],
    ):
        if root == Path("/") and shutil.which(make[0]):
            _run_step(make)
        else:
            done.next_steps.append(" ".join(make))
    # The socket first: started alone, the service would bind the path itself.
    enable = "systemctl enable --now gatewayd.socket gatewayd.service"
    if root == Path("/") and _systemd_running():
        _run_step(["systemctl", "daemon-reload"])
        done.next_steps += [enable, _RESTART_HINT]
    else:
        done.next_steps += ["systemctl daemon-reload", enable]
    return done


def _run_step(argv: list[str]) -> None:
    """One of systemd's own tools; its failure is an InstallError naming the command and
    what it said (the files written so far stay: running the install again is safe)."""
    try:
        proc = subprocess.run(argv, capture_output=True, text=True, timeout=60, check=False)
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise InstallError(f"{' '.join(argv)} could not run: {exc}") from None
    if proc.returncode != 0:
        said = (proc.stderr or proc.stdout).strip()[-800:] or "nothing"
        raise InstallError(
            f"{' '.join(argv)} failed (exit {proc.returncode}): {said}; fix that, then run "
            "gatewayd install-systemd again (what is written already is kept)"
        )


_RESTART_HINT: Final = "systemctl try-restart gatewayd   # a running daemon: the new version"


def _located(program: Path, root: Path) -> Path:
    """Where ``program`` (as the service sees it) is on this host: in a staging root,
    else here."""
    if root == Path("/") or not program.is_absolute():
        return program
    staged = root / program.relative_to("/")
    return staged if staged.exists() else program


def stamped(text: str) -> str:
    """``text`` as written to disk: its digest line first."""
    return _STAMP.format(digest=hashlib.sha256(text.encode()).hexdigest()) + text


def _edited(existing: str) -> bool:
    """Whether a unit on disk is not one this installer wrote and nobody changed since."""
    match = _STAMP_RE.match(existing)
    if match is None:
        return True
    rest = existing[match.end() :]
    return hashlib.sha256(rest.encode()).hexdigest() != match.group(1)


def _refuse_a_changed_unit(path: Path, wanted: str) -> None:
    if not path.exists():
        return
    existing = path.read_text()
    if existing != stamped(wanted) and _edited(existing):
        raise InstallError(
            f"{path} exists and differs from this version's unit (local changes?); "
            f"compare it with systemd/{path.name}, then run again with --force to "
            "replace it, or put local changes in a drop-in "
            f"(/etc/systemd/system/{path.name}.d/*.conf) instead"
        )


def _install_unit(path: Path, wanted: str, *, done: Installed) -> None:
    text = stamped(wanted)
    if path.exists() and path.read_text() == text:
        done.actions.append(("unchanged", path))
        return
    _write(path, text, 0o644)
    done.actions.append(("written", path))


def _write(path: Path, text: str, mode: int) -> None:
    """Atomically: a reader (systemd) never sees half a unit."""
    path.parent.mkdir(mode=0o755, parents=True, exist_ok=True)
    staging = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        staging.write_text(text)
        os.chmod(staging, mode)
        os.replace(staging, path)
    except BaseException:
        staging.unlink(missing_ok=True)
        raise


def _systemd_running() -> bool:
    return Path("/run/systemd/system").is_dir() and shutil.which("systemctl") is not None
