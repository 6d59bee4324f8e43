"""``gatewayd install-systemd``: put the service unit and a starting configuration in
place, idempotently, for this installation of gatewayd.

What it writes (under ``root``, ``/`` by default; tests and packagers give another):

- ``etc/systemd/system/gatewayd.service``: ``systemd/gatewayd.service`` with
  ``ExecStart`` pointing at this installation's ``gatewayd`` program;
- ``etc/sysusers.d/gatewayd.conf``: the ``gatewayd`` system user the unit runs as
  (made at once by ``systemd-sysusers`` when ``root`` is ``/``);
- ``etc/gatewayd/gatewayd.yaml``: a commented starting file, only if none exists (an
  operator's configuration is never overwritten);
- ``etc/gatewayd/policies/``: an empty directory for the site's policies.

A unit that differs from what this version would write is replaced only with
``force`` (it may hold the operator's own changes); the same content is left alone.
``systemctl daemon-reload`` runs only when systemd is the running init and ``root`` is
``/``; otherwise the next steps are printed.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Final

SOURCE_UNIT: Final = Path(__file__).resolve().parent.parent / "systemd" / "gatewayd.service"
SOURCE_SYSUSERS: Final = SOURCE_UNIT.with_name("gatewayd.sysusers.conf")
UNIT_PATH: Final = Path("etc/systemd/system/gatewayd.service")
SYSUSERS_PATH: Final = Path("etc/sysusers.d/gatewayd.conf")
CONFIG_PATH: Final = Path("etc/gatewayd/gatewayd.yaml")
POLICY_DIR: Final = Path("etc/gatewayd/policies")
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
    """Write the unit, the starting configuration and the policy directory under root.

    Error handling: InstallError for a unit that differs from ours without ``force``, a
    program path that is not an absolute executable, or a file where a directory must
    be; OSError for what the filesystem refuses (named by the caller).
    """
    program = program or Path(sys.argv[0]).resolve()
    if not program.is_absolute() or not os.access(program, os.X_OK):
        raise InstallError(f"{program} is not an executable gatewayd program (an absolute path)")
    if any(c.isspace() for c in str(program)):
        raise InstallError(f"{program} holds white space; systemd's ExecStart would split it")
    done = Installed()
    unit = root / UNIT_PATH
    wanted = unit_text(program)
    if unit.exists() and unit.read_text() == wanted:
        done.actions.append(("unchanged", unit))
    elif unit.exists() and not force:
        raise InstallError(
            f"{unit} exists and differs from this version's unit (local changes?); "
            "compare it with systemd/gatewayd.service, then run again with --force to "
            "replace it, or put local changes in a drop-in "
            "(/etc/systemd/system/gatewayd.service.d/*.conf) instead"
        )
    else:
        _write(unit, wanted, 0o644)
        done.actions.append(("written", unit))
    sysusers = root / SYSUSERS_PATH
    wanted_users = SOURCE_SYSUSERS.read_text()
    if sysusers.exists() and sysusers.read_text() == wanted_users:
        done.actions.append(("unchanged", sysusers))
    else:
        _write(sysusers, wanted_users, 0o644)
        done.actions.append(("written", sysusers))
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
    make_user = ["systemd-sysusers", str(root / SYSUSERS_PATH)]
    if root == Path("/") and shutil.which("systemd-sysusers"):
        subprocess.run(make_user, check=True, timeout=60)
    else:
        done.next_steps.append(" ".join(make_user))
    if root == Path("/") and _systemd_running():
        subprocess.run(["systemctl", "daemon-reload"], check=True, timeout=60)
        done.next_steps.append("systemctl enable --now gatewayd")
    else:
        done.next_steps += [
            "systemctl daemon-reload",
            "systemctl enable --now gatewayd",
        ]
    return done


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
