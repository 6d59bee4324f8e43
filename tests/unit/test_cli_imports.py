"""The client commands' import footprint: `gatewayd exec`, `rules`, `audit show|verify`,
`policy check` and a `run` refused for its usage load none of the heavy libraries.

A command's start is mostly imports (docs/performance.md, "CLI start"): trio, the
metrics, structlog, pydantic, cryptography... each costs milliseconds to tens of them.
Each test runs one command in a fresh interpreter against real state (an audit log made
by the writer, a shipped policy file, a state directory no daemon serves; the commands
that talk to a live sandboxed daemon are in tests/integration/test_cli_imports_live.py)
through the command line's own ``main``, then lists
what the interpreter imported; the positive control shows the same listing does catch
the heavy modules when they load.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Final

import pytest
import trio

from gatewayd.audit import AuditEvent, open_audit_log
from gatewayd.builtin_tool_ids import BUILTIN_TOOL_IDS
from gatewayd.configdefaults import DEFAULT_CONFIG_PATH, ENV_PREFIX
from gatewayd.tools import builtin_tools

REPO_ROOT: Final = Path(__file__).resolve().parents[2]
# A policy with a tools.allow list (policy check), and the deny-all one (the live run).
SHIPPED_POLICY: Final = REPO_ROOT / "policies" / "examples" / "workspace-rw.yaml"
DENY_ALL: Final = REPO_ROOT / "policies" / "default.yaml"
UNKNOWN_RUN: Final = "0123456789abcdef" * 2

# Runs the command line's main in this interpreter, then writes the names of the modules
# it imported to argv[1]; exits with the command's status.
WRAPPER: Final = """
import sys
out, words = sys.argv[1], sys.argv[2:]
try:
    from gatewayd.cli import main
    code = main(words)
except SystemExit as stop:
    code = stop.code
with open(out, "w") as listing:
    listing.write("\\n".join(sorted(sys.modules)))
sys.exit(code)
"""

# Heavy for every client command: each is the daemon's, or a library only some daemon
# path needs. A name stands for the package and its submodules.
HEAVY: Final = frozenset(
    {
        "litellm",
        "prometheus_client",
        "gatewayd.metrics",
        "gatewayd.daemon",
        "trio",
        "structlog",
        "rich",
        "cryptography",
        "temporalio",
        "opentelemetry",
        "pyroute2",
        "wasmtime",
        "mcp",
        "httpx",
        "h11",
        "asyncio",
        "ssl",
        "http",
        "email",
    }
)
# Also kept out of the commands that only talk to the control socket or only read the
# audit log: the configuration's models and what reads YAML.
MODELS: Final = frozenset({"pydantic", "pydantic_core", "yaml", "gatewayd.config"})
# And out of those that talk to the control socket: they decode no audit line.
CODECS: Final = frozenset({"msgspec", "logging"})
# And typing, which their modules name only for the type checker (TYPE_CHECKING = False
# stands for typing's flag there): about a tenth of `gatewayd exec`'s start.
TYPING: Final = frozenset({"typing"})
# And the standard library's modules they can do without (about a fifth of `gatewayd
# exec`'s start, docs/performance.md): pathlib, which brings urllib.parse and ipaddress
# (their paths are strings), shutil, which argparse imports for the terminal's width
# (gatewayd's parsers find it themselves), and what only `gatewayd run`'s own daemon or
# attached run, or an exec's output that is not text, needs.
CLIENT_STDLIB: Final = frozenset(
    {"pathlib", "urllib", "ipaddress", "shutil", "signal", "contextlib", "shlex", "base64"}
)
# And out of the audit log's readers (`audit show|verify|export|tail`): the writer's
# codec, msgspec, with what it brings (a third of their start), the writer's schema and
# the secrets' scrubber, and what they do without: datetime (only --since and --until
# parse a time), uuid, and the modules of a daemon-starting command.
AUDIT_READERS: Final = frozenset(
    {
        *("msgspec", "typing_extensions", "decimal", "uuid", "datetime", "inspect"),
        *("gatewayd.audit.entry", "gatewayd.audit.chain", "gatewayd.secrets"),
        *("gatewayd.protocol", "gatewayd.audit.writer"),
    }
)
# The libraries only some tools use (gatewayd.libraries): `gatewayd run` loads one only
# when its run's policy can reach such a tool, never up to the sandbox's start.
TOOL_LIBRARIES: Final = frozenset(
    {
        *("wasmtime", "httpx", "httpcore", "h11", "h2"),
        *("jsonschema", "referencing", "regex", "markdown_it"),
    }
)
# What only some daemons use, which a one-shot run's daemon does not load either: the
# control and metrics servers (`gatewayd serve`), the witnesses' client, the Temporal
# submission, and cryptography (a checkpoint key, a witness).
SOME_DAEMONS_ONLY: Final = frozenset(
    {
        "cryptography",
        "gatewayd.control",
        "gatewayd.metrics_server",
        "gatewayd.audit.witnessing",
        "gatewayd.scaleout.submission",
    }
)
# What `gatewayd run` imports before it asks its daemon for the sandbox
# (gatewayd/cli/run.py's _run; bench/cli_start.py measures the same).
RUN_IMPORTS: Final = (
    "import trio, gatewayd.audit.writer, gatewayd.daemon, gatewayd.errors, gatewayd.logs, "
    "gatewayd.policy, gatewayd.runs.lifecycle; from gatewayd.cli import build_parser; "
    "build_parser('run')"
)
# Lists the modules a piece of code imported, one per line.
LISTING: Final = "\nimport sys; print('\\n'.join(sorted(sys.modules)))"


def clean_env() -> dict[str, str]:
    """This environment without gatewayd's variables (a setting there would send the
    control-socket commands to the whole configuration, as it should)."""
    return {k: v for k, v in os.environ.items() if not k.startswith(ENV_PREFIX)}


def run_cli(tmp: Path, *words: str) -> tuple[subprocess.CompletedProcess[str], set[str]]:
    """``gatewayd words...`` in a fresh interpreter; its result and imported modules."""
    listing = tmp / f"modules-{len(list(tmp.glob('modules-*')))}.txt"
    done = subprocess.run(
        [sys.executable, "-c", WRAPPER, str(listing), *words],
        capture_output=True,
        text=True,
        env=clean_env(),
        cwd=tmp,
        timeout=120,
        check=False,
    )
    assert listing.exists(), done.stderr[-3000:]
    return done, set(listing.read_text().split())


def loaded(modules: set[str], heavy: frozenset[str]) -> list[str]:
    """The members of ``heavy`` (or their submodules) among ``modules``."""
    return sorted(m for m in modules if m in heavy or m.split(".")[0] in heavy)


def assert_light(modules: set[str], heavy: frozenset[str]) -> None:
    found = loaded(modules, heavy)
    assert not found, f"heavy modules imported: {found}"


@pytest.fixture(scope="module")
def audit_log(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A small real audit log, written by the writer."""
    path = tmp_path_factory.mktemp("audit") / "audit.jsonl"

    async def write() -> None:
        async with open_audit_log(path, fsync=False) as log:
            log.record("event", event=AuditEvent.RUN_CREATED, runId=UNKNOWN_RUN)
            log.record("event", event=AuditEvent.RUN_ENDED, runId=UNKNOWN_RUN)

    trio.run(write)
    return path


@pytest.mark.fresh_interpreter
def test_the_positive_control_sees_the_heavy_modules_load(tmp_path: Path) -> None:
    # The same listing, after what a daemon imports: the test can fail.
    listing = tmp_path / "modules.txt"
    code = WRAPPER.replace("from gatewayd.cli import main", "import gatewayd.daemon; main = len")
    subprocess.run(
        [sys.executable, "-c", code, str(listing)], env=clean_env(), timeout=120, check=True
    )
    modules = set(listing.read_text().split())
    expected = {"trio", "structlog", "prometheus_client", "pydantic", "gatewayd.metrics"}
    assert set(loaded(modules, HEAVY | MODELS)) >= expected


def imported_by(code: str) -> set[str]:
    """The modules ``code`` imports in a fresh interpreter."""
    done = subprocess.run(
        [sys.executable, "-c", code + LISTING],
        capture_output=True,
        text=True,
        env=clean_env(),
        timeout=120,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return set(done.stdout.split())


@pytest.fixture(scope="module")
def run_imports() -> frozenset[str]:
    """What RUN_IMPORTS loads, listed once for the tests that read the one listing."""
    return frozenset(imported_by(RUN_IMPORTS))


@pytest.fixture(scope="module")
def beyond_run_imports() -> frozenset[str]:
    """What RUN_IMPORTS loads followed by what only some daemons use and what a run
    that reaches them loads (an egress proxy, a wasm tool, a schema, an app's manifest):
    the positive controls' listing, made once."""
    return frozenset(
        imported_by(
            RUN_IMPORTS + "; import gatewayd.control, gatewayd.metrics_server, "
            "gatewayd.audit.witnessing, gatewayd.scaleout.submission; "
            "from gatewayd.audit.note import generate_key; generate_key('k'); "
            "import gatewayd.egress, gatewayd.runners.wasm; "
            "from gatewayd.mcp.schemas import bounded_validator; bounded_validator({}); "
            "from gatewayd.apps.sections import read_body; read_body('# Rules', 0)"
        )
    )


@pytest.mark.fresh_interpreter
def test_run_s_imports_up_to_the_sandbox_start_load_no_tool_library(
    run_imports: frozenset[str],
) -> None:
    assert_light(set(run_imports), TOOL_LIBRARIES)


@pytest.mark.fresh_interpreter
def test_run_s_imports_up_to_the_sandbox_start_load_nothing_only_some_daemons_use(
    run_imports: frozenset[str],
) -> None:
    assert_light(set(run_imports), SOME_DAEMONS_ONLY)


@pytest.mark.fresh_interpreter
def test_the_positive_control_sees_what_only_some_daemons_use(
    beyond_run_imports: frozenset[str],
) -> None:
    assert set(loaded(set(beyond_run_imports), SOME_DAEMONS_ONLY)) >= SOME_DAEMONS_ONLY


@pytest.mark.fresh_interpreter
def test_the_positive_control_sees_a_tool_library_that_run_s_imports_would_load(
    beyond_run_imports: frozenset[str],
) -> None:
    # After the same imports, the listing sees each library.
    found = loaded(set(beyond_run_imports), TOOL_LIBRARIES)
    assert {name.split(".")[0] for name in found} == TOOL_LIBRARIES


@pytest.mark.fresh_interpreter
def test_exec_to_a_state_dir_no_daemon_serves_fails_cleanly_and_loads_nothing_heavy(
    tmp_path: Path,
) -> None:
    if os.path.exists(DEFAULT_CONFIG_PATH):
        pytest.skip(f"{DEFAULT_CONFIG_PATH} exists: the command reads it, as it should")
    state = tmp_path / "state"
    done, modules = run_cli(tmp_path, "exec", "--state-dir", str(state), UNKNOWN_RUN, "--", "true")
    assert done.returncode == 1, done
    assert done.stderr == (
        f"gatewayd exec: cannot reach gatewayd at {state}/control.sock: "
        "[Errno 2] No such file or directory\n"
    )
    assert_light(modules, HEAVY | MODELS | CODECS | TYPING | CLIENT_STDLIB)


@pytest.mark.fresh_interpreter
def test_exec_to_a_named_control_socket_loads_no_configuration(tmp_path: Path) -> None:
    sock = tmp_path / "control.sock"
    done, modules = run_cli(
        tmp_path, "exec", "--control-socket", str(sock), UNKNOWN_RUN, "--", "true"
    )
    assert done.returncode == 1 and "cannot reach gatewayd" in done.stderr, done
    assert_light(modules, HEAVY | MODELS | CODECS | TYPING | CLIENT_STDLIB)


@pytest.mark.fresh_interpreter
def test_audit_show_and_verify_on_a_small_log_load_nothing_heavy(
    tmp_path: Path, audit_log: Path
) -> None:
    done, modules = run_cli(tmp_path, "audit", "verify", str(audit_log))
    assert done.returncode == 0, done
    assert done.stdout.startswith("OK: 4 entries, chain intact"), done.stdout
    assert_light(modules, HEAVY | MODELS | CODECS | TYPING | CLIENT_STDLIB | AUDIT_READERS)
    done, modules = run_cli(tmp_path, "audit", "show", str(audit_log))
    assert done.returncode == 0, done
    assert "run_ended" in done.stdout, done.stdout
    assert_light(modules, HEAVY | MODELS | CODECS | TYPING | CLIENT_STDLIB | AUDIT_READERS)


@pytest.mark.parametrize(
    ("words", "shown"),
    [
        (("export", "--run", UNKNOWN_RUN[:8]), '"event":"run_created"'),
        (("export", "--format", "csv"), "seq,time,kind"),
        (("tail", "-n", "2"), "audit_close"),
        (("tail", "--json", "--denied"), ""),
    ],
)
@pytest.mark.fresh_interpreter
def test_the_other_audit_readers_load_no_codec_and_no_typing(
    tmp_path: Path, audit_log: Path, words: tuple[str, ...], shown: str
) -> None:
    done, modules = run_cli(tmp_path, "audit", *words, str(audit_log))
    assert done.returncode == 0, done
    assert shown in done.stdout, done.stdout
    assert_light(modules, HEAVY | MODELS | CODECS | TYPING | CLIENT_STDLIB | AUDIT_READERS)


@pytest.mark.fresh_interpreter
def test_the_positive_control_sees_what_an_audit_reader_must_not_load() -> None:
    # The writer's side of the same package: the listing does see its codec and the rest.
    modules = imported_by("import gatewayd.audit.chain, gatewayd.audit.query; import typing")
    expected = {"msgspec", "typing", "gatewayd.audit.entry", "gatewayd.secrets", "uuid"}
    assert set(loaded(modules, AUDIT_READERS | TYPING)) >= expected


@pytest.fixture(scope="module")
def policy_check(
    tmp_path_factory: pytest.TempPathFactory,
) -> tuple[subprocess.CompletedProcess[str], frozenset[str]]:
    """`gatewayd policy check` of a shipped policy, run once for the tests that read it."""
    tmp = tmp_path_factory.mktemp("policy-check")
    policy = tmp / "policy.yaml"
    shutil.copyfile(SHIPPED_POLICY, policy)
    done, modules = run_cli(tmp, "policy", "check", str(policy))
    return done, frozenset(modules)


@pytest.mark.fresh_interpreter
def test_policy_check_loads_the_policy_models_but_no_tool(
    policy_check: tuple[subprocess.CompletedProcess[str], frozenset[str]],
) -> None:
    done, modules = policy_check
    assert done.returncode == 0, done
    assert done.stdout.startswith("policy "), done.stdout
    # email: pydantic's plugin loader reads the installed packages' entry points
    # (importlib.metadata) when the first model is made.
    assert_light(set(modules), (HEAVY - {"email"}) | {"gatewayd.tools", "gatewayd.config"})


@pytest.mark.fresh_interpreter
def test_policy_check_loads_no_wire_codec(
    policy_check: tuple[subprocess.CompletedProcess[str], frozenset[str]],
) -> None:
    # The errors' codes and the bound of an id come from modules free of msgspec
    # (gatewayd.error_codes, gatewayd.frame_limits): a policy speaks no wire.
    done, modules = policy_check
    assert done.returncode == 0, done
    assert_light(set(modules), frozenset({"msgspec", "gatewayd.protocol"}))


@pytest.mark.fresh_interpreter
def test_the_positive_control_sees_the_wire_codec_when_the_protocol_loads() -> None:
    modules = imported_by("import gatewayd.policy, gatewayd.protocol")
    assert loaded(modules, frozenset({"msgspec", "gatewayd.protocol"}))


@pytest.mark.fresh_interpreter
def test_policy_check_still_warns_of_an_allow_entry_that_matches_no_tool(tmp_path: Path) -> None:
    policy = tmp_path / "policy.yaml"
    text = SHIPPED_POLICY.read_text()
    assert "  allow: [" in text
    policy.write_text(text.replace("  allow: [", "  allow: [fs.raed, ", 1))
    done, _ = run_cli(tmp_path, "policy", "check", str(policy))
    assert done.returncode == 0, done
    assert "warning: tools.allow entry 'fs.raed' matches no tool this gatewayd has" in done.stderr


def test_the_spelt_out_builtin_tool_ids_are_the_registered_ones() -> None:
    assert tuple(builtin_tools()) == BUILTIN_TOOL_IDS


@pytest.mark.fresh_interpreter
def test_a_run_refused_for_its_usage_loads_no_daemon(tmp_path: Path) -> None:
    done, modules = run_cli(tmp_path, "run", "--state-dir", str(tmp_path / "state"))
    assert done.returncode == 2, done
    assert "give the command after --" in done.stderr
    assert_light(modules, HEAVY | MODELS | CODECS | TYPING | CLIENT_STDLIB)


@pytest.mark.fresh_interpreter
def test_a_run_of_a_command_not_in_utf8_is_refused_by_name_before_any_daemon(
    tmp_path: Path,
) -> None:
    # The audit log holds every command as text: an argument that is not UTF-8 (here the
    # byte 0xe9, as a shell passes $'caf\xe9') is named, not a traceback.
    done, modules = run_cli(
        tmp_path, "run", "--state-dir", str(tmp_path / "state"), "--", "echo", "caf\udce9"
    )
    assert done.returncode == 2, done
    assert "argument 1 of the command, 'caf\\udce9', is not UTF-8 text" in done.stderr
    assert "Traceback" not in done.stderr
    assert not (tmp_path / "state").exists()
    assert_light(modules, HEAVY | MODELS | CODECS | TYPING)


# --- against a real daemon with a live run --------------------------------------------


# --- the parser of one command --------------------------------------------------------


@pytest.mark.parametrize(
    "argv",
    [
        ["exec", "--help"],
        ["exec"],
        ["exec", "-x", UNKNOWN_RUN, "--", "true"],
        ["exec", "--timeout", "soon", UNKNOWN_RUN, "--", "true"],
        ["audit"],
        ["audit", "bogus"],
        ["audit", "verify", "--help"],
        ["audit", "show", "--since", "not a time", "audit.jsonl"],
        ["audit", "stats", "--top", "-1", "audit.jsonl"],
        ["policy", "check"],
        ["rules", "show", "--help"],
        ["run", "--max-runtime", "long", "--", "true"],
        ["serve", "--sandbox-uids", "1000"],
    ],
)
def test_a_command_line_parsed_by_its_command_s_parsers_alone_says_what_the_whole_one_says(
    argv: list[str], capsys: pytest.CaptureFixture[str]
) -> None:
    from gatewayd.cli import build_parser, main

    with pytest.raises(SystemExit) as whole:
        build_parser().parse_args(argv)
    said = capsys.readouterr()
    with pytest.raises(SystemExit) as alone:
        main(argv)
    assert (alone.value.code, capsys.readouterr()) == (whole.value.code, said)
    assert said.out or said.err.startswith("usage: gatewayd ")
