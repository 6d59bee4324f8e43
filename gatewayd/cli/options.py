"""Reading gatewayd's settings from a command's options: the daemon options every
daemon-starting command takes, and the effective configuration (options over
``$GATEWAYD_<NAME>`` variables over the file over the defaults, merged by
gatewayd/configsources.py).

The path options are strings, turned into paths where the configuration reads them: a
command that only talks to the control socket never imports pathlib (with the
urllib.parse and ipaddress it brings, a tenth of such a command's start).
"""

from __future__ import annotations

import argparse
import os
import posixpath
import sys
from collections.abc import Mapping

from gatewayd.frame_limits import MAX_FRAME_BYTES, MIN_FRAME_BYTES

# typing's flag without importing typing: client commands start without it
TYPE_CHECKING = False
if TYPE_CHECKING:
    from pathlib import Path
    from typing import Any, Final

    from gatewayd.config import GatewaydConfig
    from gatewayd.configsources import Settings
    from gatewayd.secrets import Scrubber


def add_daemon_options(p: argparse.ArgumentParser) -> None:
    # Defaults are None: an option given wins over $GATEWAYD_<NAME> and the file
    # (gatewayd/configsources.py merges them; `gatewayd config show` says which one won).
    p.add_argument(
        "--state-dir",
        default=None,
        help="private state directory (runs, sockets, audit); default: state_dir of the "
        "configuration ($GATEWAYD_STATE_DIR, the file), else /var/lib/gatewayd",
    )
    p.add_argument(
        "--audit",
        default=None,
        help="audit log (configuration: audit_path; default STATE_DIR/audit/audit.jsonl)",
    )
    p.add_argument(
        "--policy-dir",
        action="append",
        default=[],
        help="directory searched for policies named without a path (repeatable; replaces "
        "the configuration's policy_dirs)",
    )
    p.add_argument(
        "--config",
        default=None,
        help="gatewayd's configuration file (docs/configuration.md); default $GATEWAYD_CONFIG, "
        "else /etc/gatewayd/gatewayd.yaml when it exists",
    )
    p.add_argument(
        "--no-os-sandbox",
        action="store_true",
        help="act as on a host without bubblewrap: only runs whose policy says "
        "require_os_sandbox: false start, without isolation (development only)",
    )
    p.add_argument(
        "--netns-prefix",
        default=None,
        help="prefix of the runs' network namespaces; no two live daemons on this host may "
        "share one (configuration: netns_prefix; default: cogni-<8 hex> derived from the "
        "state directory)",
    )
    p.add_argument(
        "--sandbox-uids",
        type=_uid_range,
        default=None,
        help="BASE+COUNT: host uids the sandboxes run as, one per live run; no two live "
        "daemons on this host may overlap (configuration: sandbox_uids; default: 1024 uids "
        "placed by the state directory)",
    )
    p.add_argument(
        "--lendable-root",
        action="append",
        default=[],
        help="a directory beneath which workspaces and rw policy paths may be lent to runs "
        "(repeatable; replaces the configuration's lendable_roots; default /home, /tmp, "
        "/var/tmp); never a system tree",
    )
    p.add_argument(
        "--max-frame-bytes",
        type=_frame_bytes,
        default=None,
        help=f"largest request frame ({MIN_FRAME_BYTES}..{MAX_FRAME_BYTES}; configuration: "
        "max_frame_bytes; default 1 MiB)",
    )


def _frame_bytes(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number of bytes: {text!r}") from None
    if not MIN_FRAME_BYTES <= value <= MAX_FRAME_BYTES:
        raise argparse.ArgumentTypeError(
            f"{value} is outside {MIN_FRAME_BYTES}..{MAX_FRAME_BYTES} bytes"
        )
    return value


def _uid_range(text: str) -> tuple[int, int]:
    base, sep, count = text.partition("+")
    try:
        if not sep:
            raise ValueError
        return int(base), int(count)
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"not a uid range: {text!r}; write BASE+COUNT, e.g. 1800000000+1024"
        ) from None


def whole_number(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a whole number: {text!r}") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"{value} is below 0")
    return value


def absolute_path(value: str | os.PathLike[str]) -> Path:
    """A path option as the configuration takes it: made absolute from the current
    directory (``..`` kept, as pathlib's ``absolute`` keeps it)."""
    from pathlib import Path

    return Path(value).absolute()


# Command-line options that set a configuration setting: (option, setting, how to read it).
_SETTING_OPTIONS: Final = (
    ("--state-dir", "state_dir", absolute_path),
    ("--audit", "audit_path", absolute_path),
    ("--control-socket", "control_socket", absolute_path),
    ("--policy-dir", "policy_dirs", lambda v: tuple(absolute_path(p) for p in v) or None),
    ("--max-frame-bytes", "max_frame_bytes", lambda v: v),
    ("--audit-max-bytes", "audit_max_bytes", lambda v: v),
    ("--netns-prefix", "netns_prefix", lambda v: v),
    ("--sandbox-uids", "sandbox_uids", lambda v: {"base": v[0], "count": v[1]}),
    # Normalized: a relative root is taken from the current directory, ".." included.
    (
        "--lendable-root",
        "lendable_roots",
        lambda v: tuple(absolute_path(os.path.abspath(p)) for p in v) or None,
    ),
    ("--no-os-sandbox", "os_sandbox", lambda v: False if v else None),
)


def settings_from_options(args: argparse.Namespace, *, warn: bool = True) -> Settings:
    """The effective configuration: this command's options over $GATEWAYD_<NAME>
    variables over the file over the defaults. A bad value anywhere ends the command
    with every problem listed, each under the option, variable or file it came from."""
    from gatewayd.config import ConfigError
    from gatewayd.configsources import config_file, resolve_settings

    options: dict[str, tuple[str, Any]] = {}
    for option, setting, read in _SETTING_OPTIONS:
        given = getattr(args, option.removeprefix("--").replace("-", "_"), None)
        value = read(given) if given is not None else None
        if value is not None:
            options[setting] = (option, value)
    try:
        settings = resolve_settings(
            file=config_file(getattr(args, "config", None), os.environ),
            environ=os.environ,
            options=options,
        )
    except ConfigError as exc:
        raise SystemExit(f"gatewayd: bad configuration: {exc}") from None
    for note in settings.unknown_env if warn else ():
        print(f"gatewayd: warning: {note}", file=sys.stderr)
    return settings


def config_from_options(args: argparse.Namespace) -> GatewaydConfig:
    """The configuration the daemon is built from: :func:`settings_from_options`' effective one."""
    return settings_from_options(args).config


def control_socket_of(args: argparse.Namespace) -> str:
    """``--control-socket``, else the configuration's (STATE_DIR/control.sock)."""
    if args.control_socket is not None:
        return str(args.control_socket)
    plain = _plain_control_socket(args, os.environ)
    if plain is not None:
        return plain
    return os.fspath(settings_from_options(args, warn=False).config.resolved_control_socket)


def _plain_control_socket(args: argparse.Namespace, environ: Mapping[str, str]) -> str | None:
    """The configuration's control socket, found without reading the configuration
    (whose models cost a client command most of its start) when nothing but the
    defaults and ``--state-dir`` can set it: no file (none named, none at the default
    path), no ``GATEWAYD_`` variable, no other setting among the options, and a state
    directory that is already absolute and normalized once the current directory is put
    before it (as the configuration would have it). The settings are then valid
    exactly when the checks below pass, which are the configuration's own for these
    values: the agent directory outside the state directory, and the default lendable
    roots outside both, on their real paths too (gatewayd/config.py). None otherwise:
    the caller reads the whole configuration, and reports what is wrong with it as it
    always has."""
    from gatewayd.configdefaults import (
        CONFIG_ENV,
        DEFAULT_CONFIG_PATH,
        DEFAULT_STATE_DIR,
        ENV_PREFIX,
        agent_dir_for,
    )
    from gatewayd.sandbox.lendroots import (
        DEFAULT_LENDABLE_ROOTS,
        is_clean_absolute,
        is_within,
        real_root_problem,
    )

    if getattr(args, "config", None) is not None or environ.get(CONFIG_ENV):
        return None
    if any(value for name, value in environ.items() if name.startswith(ENV_PREFIX)):
        return None
    for option, setting, read in _SETTING_OPTIONS:
        given = getattr(args, option.removeprefix("--").replace("-", "_"), None)
        if setting != "state_dir" and given is not None and read(given) is not None:
            return None
    given_dir = getattr(args, "state_dir", None)
    state_dir = DEFAULT_STATE_DIR if given_dir is None else os.fspath(given_dir)
    # As _SETTING_OPTIONS reads --state-dir (pathlib's absolute), for a path it leaves
    # as it is once absolute: one with "..", ".", "//" or a trailing "/" goes the long way.
    if not state_dir.startswith("/"):
        state_dir = posixpath.join(os.getcwd(), state_dir)
    if not is_clean_absolute(state_dir):
        return None
    if os.path.exists(DEFAULT_CONFIG_PATH):
        return None
    agent_dir = agent_dir_for(state_dir)
    if is_within(agent_dir, state_dir):
        return None
    reserved = [
        (setting, path)
        for setting, own in (("state_dir", state_dir), ("agent_dir", agent_dir))
        for path in (own, os.path.realpath(own))
    ]
    if any(real_root_problem(root, reserved) for root in DEFAULT_LENDABLE_ROOTS):
        return None
    return posixpath.join(state_dir, "control.sock")


def who_answers(args: argparse.Namespace) -> str:
    """Who approves or answers, for the record: ``--by``, else this command's user and
    its uid (which the name alone does not prove; a daemon records the control socket
    peer's uid itself, whatever is written here)."""
    import getpass

    if args.by:
        return str(args.by)
    try:
        name = getpass.getuser()
    except (KeyError, OSError):
        name = "unknown"
    return f"{name} (uid {os.getuid()})"


def log_scrubber(config: GatewaydConfig) -> Scrubber:
    """The log's own scrubber of the daemon's secrets (the daemon's warns for both)."""
    from gatewayd.secrets import Scrubber

    return Scrubber.for_config(config.models, config.scrubbed_secret_env, warn=False)


def load_settings(path: str | os.PathLike[str] | None) -> GatewaydConfig:
    """gatewayd's configuration without command-line options: ``path``, else
    $GATEWAYD_CONFIG, else the default file when it exists, with $GATEWAYD_<NAME>
    variables over it. A file that is missing or invalid, or a bad variable, ends the
    command with the problems listed."""
    from gatewayd.config import ConfigError
    from gatewayd.configsources import config_file, resolve_settings

    try:
        return resolve_settings(file=config_file(path, os.environ), environ=os.environ).config
    except ConfigError as exc:
        raise SystemExit(f"gatewayd: bad configuration: {exc}") from None
