"""gatewayd's settings from three layers: option > GATEWAYD_<NAME> variable > file >
default; every setting has a variable; bad values name where they came from; `gatewayd
config show|check`."""

from __future__ import annotations

import inspect
import json
import typing
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pydantic
import pytest

from gatewayd import cli, configsources
from gatewayd.cli import command as cli_command
from gatewayd.cli import options as cli_options
from gatewayd.config import AuditWitness, ConfigError, GatewaydConfig, ModelAlias, SandboxUids
from gatewayd.configsources import DERIVED_SOURCE, ENV_SYNTAX, env_name, resolve_settings
from gatewayd.daemon import open_daemon
from gatewayd.frame_limits import MAX_FRAME_BYTES, MIN_FRAME_BYTES
from gatewayd.mcp.declaration import McpServerDeclaration, Share
from gatewayd.runs.lifecycle import RunManager
from gatewayd.sandbox.daemons import derived_uid_range
from gatewayd.sandbox.uids import UidRange

# A witness's verifier key (`gatewayd witness keygen w.example/1`).
WITNESS_KEY = "w.example/1+865d03be+BDdfF6OR1N7dL+XjaTG4/2rPUAHXKJ74KcweZD4m078L"

# Every setting: the text of its variable, and the value it must give (not the default).
ENV_CASES: dict[str, tuple[str, Any]] = {
    "state_dir": ("/srv/gw", Path("/srv/gw")),
    "audit_path": ("/var/log/gw/audit.jsonl", Path("/var/log/gw/audit.jsonl")),
    "control_socket": ("/run/gw/control.sock", Path("/run/gw/control.sock")),
    "agent_dir": ("/srv/gw-agent", Path("/srv/gw-agent")),
    "policy_dirs": ("/etc/gw/p:/srv/p", (Path("/etc/gw/p"), Path("/srv/p"))),
    "audit_fsync": ("false", False),
    "audit_reply_after_result": ("off", False),
    "audit_max_bytes": ("0", 0),
    "audit_checkpoint_key": ("/etc/gw/ckpt.key", Path("/etc/gw/ckpt.key")),
    "audit_witnesses": (
        "[{name: w.example/1, url: 'http://127.0.0.1:7380', verifier_key: 'w.example/1+865d03be+BDdfF6OR1N7dL+XjaTG4/2rPUAHXKJ74KcweZD4m078L'}]",
        (AuditWitness(name="w.example/1", url="http://127.0.0.1:7380", verifier_key=WITNESS_KEY),),
    ),
    "max_frame_bytes": ("4_194_304", 4 << 20),
    "os_sandbox": ("No", False),
    "bwrap": ("/usr/local/bin/bwrap", "/usr/local/bin/bwrap"),
    "netns_prefix": ("gw2-", "gw2-"),
    "sandbox_uids": ("1700000000+256", SandboxUids(base=1_700_000_000, count=256)),
    "lendable_roots": ("/srv/workspaces:/home", (Path("/srv/workspaces"), Path("/home"))),
    "models": (
        '{"r": {"provider": "openai", "model": "m", "api_key_env": "K"}}',
        {"r": ModelAlias(provider="openai", model="m", api_key_env="K")},
    ),
    "secret_env": ("FORGE_TOKEN, PYPI_TOKEN", ("FORGE_TOKEN", "PYPI_TOKEN")),
    "mcp_servers": (
        "{t: {command: [/usr/bin/true], share: shared}}",
        {"t": McpServerDeclaration(command=("/usr/bin/true",), share=Share.SHARED)},
    ),
    "tool_dirs": ("/etc/gw/tools:/srv/tools", (Path("/etc/gw/tools"), Path("/srv/tools"))),
    "tool_timeout_s": ("2.5", 2.5),
    "tool_memory_mb": ("1_024", 1024),
    "tool_default_runner": ("process", "process"),
    "tool_cache_dir": ("/var/cache/gw", Path("/var/cache/gw")),
    "workspace_mode": ("host", "host"),
    "metrics_listen": ("[::1]:9464", "[::1]:9464"),
    "otel_endpoint": ("http://127.0.0.1:4318", "http://127.0.0.1:4318"),
    "temporal_address": ("temporal.internal:7233", "temporal.internal:7233"),
    "temporal_namespace": ("agents", "agents"),
    "temporal_task_queue": ("gw-queue", "gw-queue"),
}


@pytest.fixture(autouse=True)
def no_default_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """No test may pick up a real /etc/gatewayd/gatewayd.yaml or GATEWAYD_ variable."""
    monkeypatch.setattr(configsources, "DEFAULT_CONFIG_PATH", tmp_path / "absent.yaml")
    for name in list(__import__("os").environ):
        if name.startswith("GATEWAYD_"):
            monkeypatch.delenv(name)


def write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "gatewayd.yaml"
    path.write_text(text)
    return path


def test_every_setting_has_a_variable_and_a_case_here() -> None:
    assert set(ENV_SYNTAX) == set(GatewaydConfig.model_fields) == set(ENV_CASES)


@pytest.mark.parametrize("setting", list(GatewaydConfig.model_fields))
def test_every_variable_parses_into_its_setting(setting: str) -> None:
    text, expected = ENV_CASES[setting]
    assert expected != getattr(GatewaydConfig(), setting)  # the case proves a change
    settings = resolve_settings(file=None, environ={env_name(setting): text})
    assert getattr(settings.config, setting) == expected
    assert settings.sources[setting] == f"env {env_name(setting)}"
    others = {
        name
        for name, source in settings.sources.items()
        if source not in ("default", DERIVED_SOURCE)
    }
    assert others == {setting}


@pytest.mark.parametrize("setting", list(GatewaydConfig.model_fields))
def test_the_documented_example_of_every_variable_is_valid(setting: str) -> None:
    example = ENV_SYNTAX[setting].example
    settings = resolve_settings(file=None, environ={env_name(setting): example})
    assert settings.sources[setting] == f"env {env_name(setting)}"


PRECEDENCE = [
    # setting, file text, variable text, (option, value), values file/env/option
    (
        "state_dir",
        "state_dir: /from/file",
        "/from/env",
        ("--state-dir", Path("/from/option")),
        (Path("/from/file"), Path("/from/env"), Path("/from/option")),
    ),
    (
        "netns_prefix",
        "netns_prefix: file-",
        "env-",
        ("--netns-prefix", "option-"),
        ("file-", "env-", "option-"),
    ),
    (
        "sandbox_uids",
        "sandbox_uids: {base: 100000, count: 2}",
        "200000+3",
        ("--sandbox-uids", {"base": 300000, "count": 4}),
        (SandboxUids(base=100000, count=2), SandboxUids(base=200000, count=3)),
    ),
    (
        "os_sandbox",
        "os_sandbox: true",
        "false",
        ("--no-os-sandbox", False),
        (True, False, False),
    ),
    (
        "max_frame_bytes",
        "max_frame_bytes: 1000",
        "2000",
        ("--max-frame-bytes", 3000),
        (1000, 2000, 3000),
    ),
]


@pytest.mark.parametrize(("setting", "file_text", "env_text", "option", "values"), PRECEDENCE)
def test_an_option_beats_a_variable_beats_the_file_beats_the_default(
    tmp_path: Path,
    setting: str,
    file_text: str,
    env_text: str,
    option: tuple[str, Any],
    values: tuple[Any, ...],
) -> None:
    path = write(tmp_path, file_text + "\n")
    environ = {env_name(setting): env_text}
    default = getattr(GatewaydConfig(), setting)
    # netns_prefix and sandbox_uids default to values derived from the state directory
    default_source = DERIVED_SOURCE if default is None else "default"
    from_option = object()  # the option's value, as the setting reads it
    layers = [
        (None, {}, {}, default, default_source),
        (path, {}, {}, values[0], f"file {path}"),
        (path, environ, {}, values[1], f"env {env_name(setting)}"),
        (None, environ, {}, values[1], f"env {env_name(setting)}"),
        (path, environ, {setting: option}, from_option, f"option {option[0]}"),
        (path, {}, {setting: option}, from_option, f"option {option[0]}"),
    ]
    for file, env, options, expected, source in layers:
        settings = resolve_settings(file=file, environ=env, options=options)
        got = getattr(settings.config, setting)
        if expected is not from_option:
            assert got == expected, (file, env, options)
        else:
            assert got == getattr(GatewaydConfig.model_validate({setting: option[1]}), setting)
        assert settings.sources[setting] == source


def test_layers_merge_setting_by_setting(tmp_path: Path) -> None:
    path = write(tmp_path, "state_dir: /f\nnetns_prefix: file-\nsecret_env: [A]\n")
    settings = resolve_settings(
        file=path,
        environ={"GATEWAYD_NETNS_PREFIX": "env-", "GATEWAYD_SECRET_ENV": "B"},
        options={"state_dir": ("--state-dir", Path("/o"))},
    )
    got = settings.config
    assert (got.state_dir, got.netns_prefix, got.secret_env) == (Path("/o"), "env-", ("B",))
    assert settings.sources["audit_fsync"] == "default"
    assert got.resolved_audit_path == Path("/o/audit/audit.jsonl")


def test_an_empty_variable_counts_as_unset(tmp_path: Path) -> None:
    path = write(tmp_path, "netns_prefix: file-\n")
    settings = resolve_settings(file=path, environ={"GATEWAYD_NETNS_PREFIX": ""})
    assert settings.config.netns_prefix == "file-"


@pytest.mark.parametrize(
    ("variable", "text", "says"),
    [
        ("GATEWAYD_OS_SANDBOX", "maybe", "'maybe' is not a boolean"),
        ("GATEWAYD_AUDIT_FSYNC", "2", "'2' is not a boolean"),
        ("GATEWAYD_MAX_FRAME_BYTES", "1k", "'1k' is not a whole number"),
        ("GATEWAYD_MAX_FRAME_BYTES", "10", "greater than or equal to 64"),
        ("GATEWAYD_STATE_DIR", "var/lib/gw", "'var/lib/gw' must be an absolute path"),
        ("GATEWAYD_POLICY_DIRS", "/ok:rel", "1: 'rel' must be an absolute path"),
        ("GATEWAYD_BWRAP", "bwrap", "'bwrap' must be an absolute path"),
        ("GATEWAYD_NETNS_PREFIX", "Cogni", "namespace prefix 'Cogni' is not allowed"),
        ("GATEWAYD_SANDBOX_UIDS", "1800000000", "write BASE+COUNT"),
        ("GATEWAYD_SANDBOX_UIDS", "0+5", "sandbox uid range 0+5 is not usable"),
        ("GATEWAYD_SECRET_ENV", "A,A", "names a secret more than once: A"),
        ("GATEWAYD_SECRET_ENV", "A-B", "secret_env name 'A-B'"),
        ("GATEWAYD_MODELS", "[1]", "must be a YAML or JSON mapping"),
        ("GATEWAYD_MODELS", "{r: {provider: openai}}", "r.model: Field required"),
        ("GATEWAYD_MODELS", "{r: {provider: openai, modle: m}}", "did you mean 'model'?"),
        ("GATEWAYD_TOOL_DIRS", "/ok:rel", "1: 'rel' must be an absolute path"),
        ("GATEWAYD_TOOL_TIMEOUT_S", "5s", "'5s' is not a number"),
        ("GATEWAYD_TOOL_TIMEOUT_S", "nan", "should be a finite number"),
        ("GATEWAYD_TOOL_TIMEOUT_S", "0", "should be greater than 0"),
        ("GATEWAYD_TOOL_MEMORY_MB", "1.5", "'1.5' is not a whole number"),
        ("GATEWAYD_TOOL_DEFAULT_RUNNER", "docker", "should be 'wasm' or 'process'"),
        ("GATEWAYD_WORKSPACE_MODE", "copy", "should be 'host', 'overlay' or 'agentfs'"),
    ],
)
def test_a_bad_variable_is_refused_naming_the_variable(variable: str, text: str, says: str) -> None:
    with pytest.raises(ConfigError) as caught:
        resolve_settings(file=None, environ={variable: text})
    assert str(caught.value).startswith(f"{variable}: ")
    assert says in str(caught.value)


def test_every_bad_variable_is_listed_at_once() -> None:
    with pytest.raises(ConfigError) as caught:
        resolve_settings(
            file=None, environ={"GATEWAYD_OS_SANDBOX": "x", "GATEWAYD_MAX_FRAME_BYTES": "y"}
        )
    assert "GATEWAYD_OS_SANDBOX: " in str(caught.value)
    assert "GATEWAYD_MAX_FRAME_BYTES: " in str(caught.value)


def test_a_bad_models_variable_never_repeats_its_value() -> None:
    for text in (
        "{r: {provider: openai, model: m, api_key: sk-live-0123456789}}",
        "{r: {provider: openai, model: sk-live-0123456789",
        "sk-live-0123456789",
    ):
        with pytest.raises(ConfigError) as caught:
            resolve_settings(file=None, environ={"GATEWAYD_MODELS": text})
        assert str(caught.value).startswith("GATEWAYD_MODELS: ")
        assert "sk-live" not in str(caught.value)


def test_a_bad_option_is_refused_naming_the_option() -> None:
    with pytest.raises(ConfigError, match=r"^--netns-prefix: namespace prefix 'A'"):
        resolve_settings(file=None, environ={}, options={"netns_prefix": ("--netns-prefix", "A")})


def test_a_bad_file_names_the_file_even_when_a_variable_overrides_the_setting(
    tmp_path: Path,
) -> None:
    path = write(tmp_path, "netns_prefix: BAD\n")
    with pytest.raises(ConfigError, match=rf"^{path}: netns_prefix: "):
        resolve_settings(file=path, environ={"GATEWAYD_NETNS_PREFIX": "ok-"})


@pytest.mark.parametrize(
    ("text", "says"),
    [
        ("state_dri: /x", "state_dri: Extra inputs are not permitted (did you mean 'state_dir'?)"),
        ("sandbox_uids: {bas: 5}", "sandbox_uids.bas: Extra inputs are not permitted (did you"),
        ("models: {r: {provider: openai, modle: m}}", "(did you mean 'model'?)"),
        ("audit_path: relative.jsonl", "'relative.jsonl' must be an absolute path"),
        ("os_sandbox: 'no'", "os_sandbox: Input should be a valid boolean"),
        ("max_frame_bytes: 1.5", "max_frame_bytes: Input should be a valid integer"),
        ("sandbox_uids: {base: 10, count: 1}", "sandbox uid range 10+1 is not usable"),
        ("- a list", "must be a mapping of settings, not list"),
    ],
)
def test_a_bad_file_is_refused_with_the_field_and_a_hint(
    tmp_path: Path, text: str, says: str
) -> None:
    path = write(tmp_path, text + "\n")
    with pytest.raises(ConfigError) as caught:
        resolve_settings(file=path, environ={})
    assert str(caught.value).startswith(f"{path}: ")
    assert says in str(caught.value)


def test_an_unknown_gatewayd_variable_is_reported_with_the_closest_name() -> None:
    settings = resolve_settings(
        file=None, environ={"GATEWAYD_STATEDIR": "/x", "GATEWAYD_CONFIG": "/y", "HOME": "/h"}
    )
    assert settings.unknown_env == (
        "GATEWAYD_STATEDIR is not a gatewayd setting and is ignored "
        "(did you mean GATEWAYD_STATE_DIR?)",
    )


def test_the_file_is_the_option_else_the_variable_else_the_default_if_present(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    option, named, default = tmp_path / "o.yaml", tmp_path / "e.yaml", tmp_path / "d.yaml"
    monkeypatch.setattr(configsources, "DEFAULT_CONFIG_PATH", default)
    environ = {"GATEWAYD_CONFIG": str(named)}
    assert configsources.config_file(option, environ) == option
    assert configsources.config_file(None, environ) == named
    assert configsources.config_file(None, {}) is None
    default.write_text("")
    assert configsources.config_file(None, {}) == default


def test_a_named_file_that_is_missing_is_an_error(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="cannot read the configuration"):
        resolve_settings(file=tmp_path / "absent.yaml", environ={})


# --- into the daemon ---------------------------------------------------------------------


def test_the_daemon_is_built_from_the_configuration_itself() -> None:
    """One type: every setting the daemon has, and its default, is the configuration's;
    what only code gives it (a resolver for tests, the control socket ``serve`` serves,
    a tool table) is a parameter, never a setting a file could hold."""
    for build in (open_daemon, RunManager.__init__):
        assert typing.get_type_hints(build)["config"] is GatewaydConfig, build
        inputs = set(inspect.signature(build).parameters) - {"config"}
        assert not inputs & set(GatewaydConfig.model_fields) - {"control_socket"}, build
    # The control socket served is the one the setting names (`gatewayd serve` passes
    # it on); a one-shot run serves none, whatever the setting says.
    assert inspect.signature(open_daemon).parameters["control_socket"].default is None


# A change made in code, from the state directory, and what the refusal says (STATE:
# the state directory).
CHANGED_IN_CODE: list[tuple[Callable[[Path], dict[str, Any]], str]] = [
    (lambda state: {"secret_env": ("not a name",)}, "secret_env name 'not a name'"),
    (lambda state: {"audit_path": Path("audit.jsonl")}, "'audit.jsonl' must be an absolute"),
    (lambda state: {"lendable_roots": (Path("/usr/local"),)}, "lies in the system tree /usr"),
    (lambda state: {"lendable_roots": (state / "ws",)}, "lies in gatewayd's own state_dir"),
    (lambda state: {"agent_dir": state / "agent"}, "agent_dir STATE/agent lies in state_dir"),
]


@pytest.mark.parametrize(("change", "says"), CHANGED_IN_CODE)
def test_a_configuration_changed_in_code_is_validated_as_a_file_is(
    tmp_path: Path, change: Callable[[Path], dict[str, Any]], says: str
) -> None:
    state = tmp_path / "state"
    given = GatewaydConfig(state_dir=state, netns_prefix="gw-")
    with pytest.raises(pydantic.ValidationError) as caught:
        given.changed(**change(state))
    assert says.replace("STATE", str(state)) in str(caught.value)


def test_a_changed_configuration_keeps_what_it_did_not_change(tmp_path: Path) -> None:
    given = GatewaydConfig(state_dir=tmp_path / "state", netns_prefix="gw-")
    changed = given.changed(secret_env=("TOKEN",))
    assert changed.secret_env == ("TOKEN",)
    assert (changed.state_dir, changed.netns_prefix) == (tmp_path / "state", "gw-")
    assert changed.sandbox_uids is None  # still derived from the state directory
    assert changed.resolved_sandbox_uids == given.resolved_sandbox_uids


# Every setting: a value other than the running one's, and whether a reload applies it
# at once (only the model aliases; docs/configuration.md, "Reload").
RELOAD_CASES: list[tuple[str, Any, bool]] = [
    ("state_dir", Path("/srv/other"), False),
    ("audit_path", Path("/srv/audit.jsonl"), False),
    ("control_socket", Path("/run/other.sock"), False),
    ("agent_dir", Path("/srv/agent"), False),
    ("policy_dirs", (Path("/etc/gw/policies"),), False),
    ("audit_fsync", False, False),
    ("audit_reply_after_result", False, False),
    ("audit_max_bytes", 0, False),
    ("audit_checkpoint_key", Path("/etc/gw/ckpt.key"), False),
    (
        "audit_witnesses",
        (AuditWitness(name="w.example/1", url="https://w.example/1", verifier_key=WITNESS_KEY),),
        False,
    ),
    ("max_frame_bytes", 4096, False),
    ("os_sandbox", False, False),
    ("bwrap", "/opt/bwrap", False),
    ("netns_prefix", "gw-", False),
    ("sandbox_uids", SandboxUids(base=100_000, count=8), False),
    ("lendable_roots", (Path("/srv/ws"),), False),
    ("models", {"r": ModelAlias(provider="openai", model="m")}, True),
    ("secret_env", ("TOKEN",), False),
    ("mcp_servers", {"t": McpServerDeclaration(url="https://mcp.example.org/mcp")}, False),
    ("tool_dirs", (Path("/srv/tools"),), False),
    ("tool_timeout_s", 5.0, False),
    ("tool_memory_mb", 64, False),
    ("tool_default_runner", "process", False),
    ("tool_cache_dir", Path("/srv/cache"), False),
    ("workspace_mode", "host", False),
    ("metrics_listen", "127.0.0.1:9464", False),
    ("otel_endpoint", "http://127.0.0.1:4318", False),
    ("temporal_address", "127.0.0.1:7233", False),
    ("temporal_namespace", "agents", False),
    ("temporal_task_queue", "gw-queue", False),
]


def test_the_reload_cases_name_every_setting() -> None:
    assert [case[0] for case in RELOAD_CASES] == list(GatewaydConfig.model_fields)


@pytest.mark.parametrize(("setting", "value", "at_once"), RELOAD_CASES)
def test_a_reloaded_setting_needs_a_restart_unless_it_is_applied_at_once(
    setting: str, value: Any, at_once: bool
) -> None:
    running = GatewaydConfig(state_dir=Path("/srv/gw")).with_real_dirs()
    reread = running.changed(**{setting: value}).with_real_dirs()
    assert getattr(reread, setting) != getattr(running, setting)
    assert running.needs_restart(reread) == ([] if at_once else [setting])
    assert running.needs_restart(running) == []


@pytest.mark.parametrize(
    ("value", "accepted"),
    [
        (MIN_FRAME_BYTES - 1, False),
        (MIN_FRAME_BYTES, True),
        (MAX_FRAME_BYTES, True),
        (MAX_FRAME_BYTES + 1, False),
    ],
)
def test_the_option_and_the_setting_take_the_same_frame_sizes(value: int, accepted: bool) -> None:
    argv = ["serve", "--max-frame-bytes", str(value)]
    if accepted:
        assert cli.build_parser().parse_args(argv).max_frame_bytes == value
        assert GatewaydConfig(max_frame_bytes=value).max_frame_bytes == value
    else:
        with pytest.raises(SystemExit):
            cli.build_parser().parse_args(argv)
        with pytest.raises(pydantic.ValidationError, match="max_frame_bytes"):
            GatewaydConfig(max_frame_bytes=value)


FULL_FILE = """
state_dir: /srv/gw
audit_path: /srv/audit.jsonl
control_socket: /run/gw.sock
policy_dirs: [/etc/gw/policies]
audit_fsync: false
audit_reply_after_result: false
audit_max_bytes: 1000000
max_frame_bytes: 4096
os_sandbox: false
bwrap: /opt/bwrap
netns_prefix: gw-
sandbox_uids: {base: 100000, count: 8}
models: {r: {provider: openai, model: m}}
secret_env: [TOKEN]
"""


def test_the_daemon_is_built_from_every_setting_of_the_file(tmp_path: Path) -> None:
    path = write(tmp_path, FULL_FILE)
    daemon = cli_options.config_from_options(
        cli.build_parser().parse_args(["serve", "--config", str(path)])
    )
    assert daemon == GatewaydConfig(
        state_dir=Path("/srv/gw"),
        audit_path=Path("/srv/audit.jsonl"),
        control_socket=Path("/run/gw.sock"),
        policy_dirs=(Path("/etc/gw/policies"),),
        audit_fsync=False,
        audit_reply_after_result=False,
        audit_max_bytes=1_000_000,
        max_frame_bytes=4096,
        os_sandbox=False,
        bwrap="/opt/bwrap",
        netns_prefix="gw-",
        sandbox_uids=SandboxUids(base=100000, count=8),
        models={"r": ModelAlias(provider="openai", model="m")},
        secret_env=("TOKEN",),
    )


def test_options_of_serve_override_the_file_and_variables(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = write(tmp_path, FULL_FILE)
    monkeypatch.setenv("GATEWAYD_NETNS_PREFIX", "env-")
    monkeypatch.setenv("GATEWAYD_OS_SANDBOX", "true")
    monkeypatch.chdir(tmp_path)
    args = cli.build_parser().parse_args(
        [
            "serve",
            "--config",
            str(path),
            "--state-dir",
            "rel",
            "--policy-dir",
            "/p1",
            "--policy-dir",
            "/p2",
            "--sandbox-uids",
            "200000+2",
            "--no-os-sandbox",
            "--audit-max-bytes",
            "0",
        ]
    )
    daemon = cli_options.config_from_options(args)
    assert daemon.audit_max_bytes == 0  # 0 is given, not absent
    assert daemon.state_dir == tmp_path / "rel"  # relative on the command line: from cwd
    assert daemon.policy_dirs == (Path("/p1"), Path("/p2"))
    assert daemon.resolved_sandbox_uids == UidRange(200000, 2)
    assert daemon.netns_prefix == "env-"
    assert daemon.os_sandbox is False
    assert daemon.audit_path == Path("/srv/audit.jsonl")


def test_a_bad_variable_ends_the_command_naming_it(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("GATEWAYD_SANDBOX_UIDS", "lots")
    with pytest.raises(SystemExit) as caught:
        cli_options.config_from_options(cli.build_parser().parse_args(["serve"]))
    assert str(caught.value.code).startswith("gatewayd: bad configuration: GATEWAYD_SANDBOX_UIDS")


def test_exec_and_rules_find_the_control_socket_of_the_configuration(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    parse = cli.build_parser().parse_args
    monkeypatch.setenv("GATEWAYD_CONFIG", str(write(tmp_path, "state_dir: /srv/gw\n")))
    assert (
        cli_options.control_socket_of(parse(["exec", "r", "--", "true"])) == "/srv/gw/control.sock"
    )
    assert cli_options.control_socket_of(parse(["rules", "pending"])) == "/srv/gw/control.sock"
    monkeypatch.setenv("GATEWAYD_CONTROL_SOCKET", "/run/c.sock")
    assert cli_options.control_socket_of(parse(["rules", "pending"])) == "/run/c.sock"
    args = parse(["exec", "--state-dir", "/o", "r", "--", "true"])
    assert cli_options.control_socket_of(args) == "/run/c.sock"  # the variable names the socket
    monkeypatch.delenv("GATEWAYD_CONTROL_SOCKET")
    assert cli_options.control_socket_of(args) == "/o/control.sock"
    args = parse(["exec", "--control-socket", "/x.sock", "r", "--", "true"])
    assert cli_options.control_socket_of(args) == "/x.sock"


# --- gatewayd config show | check ------------------------------------------------------------


def show(capsys: pytest.CaptureFixture[str], *argv: str) -> dict[str, Any]:
    assert cli.main(["config", "show", "--json", *argv]) == cli_command.EXIT_OK
    document: dict[str, Any] = json.loads(capsys.readouterr().out)
    return document


def test_config_show_gives_every_value_and_its_source(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    path = write(tmp_path, "state_dir: /srv/gw\nnetns_prefix: file-\n")
    monkeypatch.setenv("GATEWAYD_NETNS_PREFIX", "env-")
    monkeypatch.setenv("GATEWAYD_MAX_FRAME_BYTES", "4096")
    document = show(capsys, "--config", str(path), "--max-frame-bytes", "8192")
    settings = document["settings"]
    assert document["file"] == str(path)
    assert list(settings) == list(GatewaydConfig.model_fields)
    assert settings["state_dir"] == {"value": "/srv/gw", "source": f"file {path}"}
    assert settings["netns_prefix"] == {"value": "env-", "source": "env GATEWAYD_NETNS_PREFIX"}
    assert settings["max_frame_bytes"] == {"value": 8192, "source": "option --max-frame-bytes"}
    assert settings["audit_path"] == {"value": "/srv/gw/audit/audit.jsonl", "source": "default"}
    assert settings["tool_cache_dir"] == {"value": "/srv/gw/wasm-cache", "source": "default"}
    derived = derived_uid_range(Path("/srv/gw"))
    assert settings["sandbox_uids"] == {
        "value": {"base": derived.base, "count": 1024},
        "source": DERIVED_SOURCE,
    }


def test_config_show_prints_no_secret(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    key, password, token = "sk-live-key-0123456789", "hunter2-password", "tok-0123456789abc"
    monkeypatch.setenv("PROVIDER_KEY", key)
    monkeypatch.setenv("FORGE_TOKEN", token)
    path = write(
        tmp_path,
        "models:\n  r:\n    provider: openai\n    model: m\n"
        f"    api_base: https://user:{password}@llm.example:8443/v1\n"
        "    api_key_env: PROVIDER_KEY\nsecret_env: [FORGE_TOKEN]\n",
    )
    document = show(capsys, "--config", str(path))
    alias = document["settings"]["models"]["value"]["r"]
    assert alias["api_base"] == "https://user:***@llm.example:8443/v1"
    assert alias["api_key_env"] == "PROVIDER_KEY"
    assert cli.main(["config", "show", "--config", str(path)]) == cli_command.EXIT_OK
    text = capsys.readouterr().out
    for output in (json.dumps(document), text):
        assert key not in output and password not in output and token not in output
    assert "PROVIDER_KEY" in text and "user:***@llm.example" in text


def test_config_show_text_names_each_source(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("GATEWAYD_AUDIT_FSYNC", "false")
    assert cli.main(["config", "show", "--netns-prefix", "opt-"]) == cli_command.EXIT_OK
    lines = capsys.readouterr().out.splitlines()
    assert "audit_fsync: false  # env GATEWAYD_AUDIT_FSYNC" in lines
    assert "netns_prefix: opt-  # option --netns-prefix" in lines
    assert "os_sandbox: true  # default" in lines


def test_config_show_refuses_a_bad_variable(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("GATEWAYD_OS_SANDBOX", "maybe")
    with pytest.raises(SystemExit) as caught:
        cli.main(["config", "show"])
    assert "GATEWAYD_OS_SANDBOX: 'maybe' is not a boolean" in str(caught.value.code)


def test_config_check_exit_codes(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    good = write(tmp_path, FULL_FILE)
    assert cli.main(["config", "check", str(good)]) == cli_command.EXIT_OK
    out, err = capsys.readouterr()
    assert out.startswith(f"{good}: OK; sets state_dir, audit_path")
    assert "audit_fsync: false" in err  # the warning
    # and the opt-out's: what it risks, and where to read more
    assert "audit_reply_after_result: false" in err
    assert "a crash can lose the results of calls the sandbox saw answered" in err
    assert "docs/audit.md" in err
    empty = tmp_path / "empty.yaml"
    empty.write_text("")
    assert cli.main(["config", "check", str(empty)]) == cli_command.EXIT_OK
    assert "nothing (every setting default)" in capsys.readouterr().out
    bad = tmp_path / "bad.yaml"
    bad.write_text("state_dri: /x\n")
    assert cli.main(["config", "check", str(bad)]) == cli_command.EXIT_FAILED
    assert "did you mean 'state_dir'?" in capsys.readouterr().err
    assert cli.main(["config", "check", str(tmp_path / "absent.yaml")]) == cli_command.EXIT_FAILED
    assert "cannot read the configuration" in capsys.readouterr().err
    with pytest.raises(SystemExit) as caught:
        cli.main(["config", "check"])
    assert caught.value.code == cli_command.EXIT_USAGE


def test_config_check_ignores_variables(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("GATEWAYD_OS_SANDBOX", "maybe")  # bad, but not the file's problem
    assert cli.main(["config", "check", str(write(tmp_path, ""))]) == cli_command.EXIT_OK


@pytest.mark.parametrize("agent_dir", ["/srv/gw", "/srv/gw/agent"])
def test_an_agent_dir_in_the_state_dir_is_refused(agent_dir: str) -> None:
    with pytest.raises(pydantic.ValidationError, match=r"agent_dir .* lies in state_dir"):
        GatewaydConfig(state_dir=Path("/srv/gw"), agent_dir=Path(agent_dir))
    assert GatewaydConfig(state_dir=Path("/srv/gw")).resolved_agent_dir == Path("/srv/gw-agent")
