"""How a client command finds the control socket without reading the configuration
(gatewayd/cli/options.py, ``control_socket_of``): only when nothing but the defaults and
``--state-dir`` could set it, and then to the same socket the whole configuration names,
or to the same refusal (a state directory the settings reject)."""

from __future__ import annotations

import argparse
import os
from pathlib import Path

import pytest

import gatewayd.cli.options as options
from gatewayd.cli import build_parser
from gatewayd.configdefaults import DEFAULT_CONFIG_PATH

UNKNOWN_RUN = "0" * 32


@pytest.fixture(autouse=True)
def no_gatewayd_env(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in list(os.environ):
        if name.startswith("GATEWAYD_"):
            monkeypatch.delenv(name)
    if os.path.exists(DEFAULT_CONFIG_PATH):
        pytest.skip(f"{DEFAULT_CONFIG_PATH} exists: every command reads it, as it should")


def exec_args(*words: str) -> argparse.Namespace:
    return build_parser("exec").parse_args(["exec", *words, UNKNOWN_RUN, "--", "true"])


def by_the_configuration(args: argparse.Namespace) -> str:
    """The socket the whole configuration names, or the message it refuses with."""
    try:
        return str(options.settings_from_options(args, warn=False).config.resolved_control_socket)
    except SystemExit as refused:
        return str(refused.code)


def state_dirs(tmp_path: Path) -> list[str]:
    (tmp_path / "real").mkdir()
    (tmp_path / "to-tmp").symlink_to("/tmp")
    (tmp_path / "to-real").symlink_to(tmp_path / "real")
    return [
        str(tmp_path / "state"),  # not there yet: the daemon makes it
        str(tmp_path / "to-real"),
        str(tmp_path / "real" / ".." / "state"),
        "relative/state",
        # Spelt other than pathlib would write them: the long way, to the same socket.
        str(tmp_path / "state") + "/",
        f"{tmp_path}//state",
        f"{tmp_path}/./state",
        "./relative/state",
        "",
        "/",  # holds every lendable root
        "/tmp",  # is one
        "/var/tmp",
        "/home",
        str(tmp_path / "to-tmp"),  # is one, really
        "/var/lib/gatewayd",
        "/var",
    ]


def test_the_quick_answer_is_the_configuration_s_own_or_none(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    quick_ones = 0
    for state_dir in [*state_dirs(tmp_path), None]:
        args = exec_args() if state_dir is None else exec_args("--state-dir", state_dir)
        quick = options._plain_control_socket(args, os.environ)
        full = by_the_configuration(args)
        if quick is None:
            continue
        quick_ones += 1
        assert quick == full, (state_dir, quick, full)
        assert options.control_socket_of(args) == full
    assert quick_ones >= 4  # the ordinary state directories take the quick way


@pytest.mark.parametrize(
    ("state_dir", "why"),
    [
        ("/", "agent_dir /gatewayd-agent lies in state_dir /"),
        ("/tmp", "/tmp lies in gatewayd's own state_dir /tmp, which is never lent"),
        ("/home", "/home lies in gatewayd's own state_dir /home, which is never lent"),
    ],
)
def test_a_state_dir_the_settings_reject_is_refused_as_before(state_dir: str, why: str) -> None:
    args = exec_args("--state-dir", state_dir)
    assert options._plain_control_socket(args, os.environ) is None
    with pytest.raises(SystemExit) as refused:
        options.control_socket_of(args)
    assert str(refused.value.code).startswith("gatewayd: bad configuration: --state-dir: ")
    assert why in str(refused.value.code)


def test_a_gatewayd_variable_or_a_file_sends_it_to_the_configuration(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    args = exec_args("--state-dir", str(tmp_path / "state"))
    assert options._plain_control_socket(args, os.environ) == f"{tmp_path}/state/control.sock"
    # A variable that sets the socket wins over --state-dir's default for it.
    elsewhere = tmp_path / "elsewhere.sock"
    environ = {"GATEWAYD_CONTROL_SOCKET": str(elsewhere)}
    assert options._plain_control_socket(args, environ) is None
    monkeypatch.setenv("GATEWAYD_CONTROL_SOCKET", str(elsewhere))
    assert options.control_socket_of(args) == str(elsewhere)
    monkeypatch.delenv("GATEWAYD_CONTROL_SOCKET")
    # So does the file $GATEWAYD_CONFIG names, and a variable that is no setting is
    # left to the configuration too (it warns of it where it warns).
    config = tmp_path / "gatewayd.yaml"
    config.write_text(f"control_socket: {elsewhere}\n")
    assert options._plain_control_socket(args, {"GATEWAYD_CONFIG": str(config)}) is None
    monkeypatch.setenv("GATEWAYD_CONFIG", str(config))
    assert options.control_socket_of(args) == str(elsewhere)
    assert options._plain_control_socket(args, {"GATEWAYD_NO_SUCH": "1"}) is None


def test_the_default_file_when_it_exists_sends_it_to_the_configuration(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import gatewayd.configdefaults as defaults

    default = tmp_path / "gatewayd.yaml"
    default.write_text("state_dir: /var/lib/other\n")
    monkeypatch.setattr(defaults, "DEFAULT_CONFIG_PATH", default)
    assert options._plain_control_socket(exec_args(), os.environ) is None


def test_another_setting_among_the_options_sends_it_to_the_configuration(tmp_path: Path) -> None:
    args = build_parser("mcp").parse_args(
        ["mcp", "list", "--state-dir", str(tmp_path), "--netns-prefix", "cgx-"]
    )
    assert options._plain_control_socket(args, os.environ) is None
    args = build_parser("mcp").parse_args(["mcp", "list", "--state-dir", str(tmp_path)])
    assert options._plain_control_socket(args, os.environ) == f"{tmp_path}/control.sock"
