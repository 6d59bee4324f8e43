"""cogni-tool's import footprint and portability: standard library only, cheap, python3.8+.

Run with ``python -S -E`` (no site-packages, no PYTHON* variables) from the repository
root, as a sandbox launcher runs it, so these tests also prove that cogni_tool needs
nothing but the standard library. The footprint is the cold start of every call from a
shell loop: ``socket`` or ``json`` alone (through ``enum`` and ``re``) costs about as
much as starting the interpreter, so they must not come back on the ``exec`` path.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

from tests.unit.test_cogni_tool_client import RUN_ID, FakeGateway, fake_gateway

REPO_ROOT = Path(__file__).resolve().parents[2]
PACKAGE = REPO_ROOT / "cogni_tool"

# Everything a cogni-tool call may add to a bare interpreter, with why each is there.
CALL_IMPORTS = frozenset(
    {
        "cogni_tool",
        "cogni_tool.cli",
        "cogni_tool.client",
        "cogni_tool.json_codec",
        "__future__",  # postponed annotations, so hints cost nothing at run time
        "_socket",  # the C socket module: the connection, without socket's enum
        "_json",  # json's C scanner and encoder, without json's re
    }
)
LIBRARY_IMPORTS = CALL_IMPORTS | {"cogni_tool.__main__"}

# Named so a failure says plainly what crept back: each of these costs milliseconds.
FORBIDDEN_IMPORTS = frozenset(
    {"socket", "json", "re", "enum", "struct", "select", "selectors", "os", "functools"}
    | {"collections", "typing", "argparse", "dataclasses", "pathlib", "contextlib"}
    | {"asyncio", "inspect", "importlib", "logging", "runpy"}
    | {"gatewayd", "msgspec", "trio", "pydantic", "yaml", "structlog", "httpx"}
)

# How a sandbox launcher starts the console script's function (main() then ends the
# process itself), without ``-m`` (runpy imports os and importlib).
LAUNCHER = "import sys; from cogni_tool.cli import main; sys.argv[1:] = {words!r}; main()"


def importtime(code: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-S", "-E", "-X", "importtime", "-c", code],
        capture_output=True,
        text=True,
        cwd=REPO_ROOT,
        env=env,
        timeout=30,
        check=False,
    )


def modules_in(stderr: str) -> set[str]:
    """The dotted names of the modules an ``-X importtime`` report lists."""
    names = {
        line.rsplit("|", 1)[1].strip()
        for line in stderr.splitlines()
        if line.startswith("import time:") and "imported package" not in line
    }
    assert names, f"no import times reported: {stderr[:500]}"
    return names


def imported_modules(code: str) -> set[str]:
    done = importtime(code)
    assert done.returncode == 0, done.stderr[-2000:]
    return modules_in(done.stderr)


@pytest.fixture(scope="module")
def bare_interpreter_modules() -> set[str]:
    return imported_modules("pass")


def call_modules(
    bare: set[str], gw: FakeGateway, *words: str
) -> tuple[set[str], subprocess.CompletedProcess[str]]:
    """The modules ``cogni-tool words...`` adds to a bare interpreter, and its result."""
    env = {"COGNI_GATEWAY_SOCK": str(gw.path), "COGNI_RUN_ID": RUN_ID}
    done = importtime(LAUNCHER.format(words=list(words)), env)
    return modules_in(done.stderr) - bare, done


def assert_only(added: set[str], allowed: frozenset[str]) -> None:
    assert not added & FORBIDDEN_IMPORTS, (
        f"slow imports are back: {sorted(added & FORBIDDEN_IMPORTS)}"
    )
    assert added <= allowed, f"not on the allowlist: {sorted(added - allowed)}"
    assert {name.split(".")[0] for name in added} - {"cogni_tool"} <= sys.stdlib_module_names


def test_exec_that_succeeds_imports_only_the_allowlist(
    bare_interpreter_modules: set[str], tmp_path: Path
) -> None:
    with fake_gateway(tmp_path) as gw:
        added, done = call_modules(bare_interpreter_modules, gw, "exec", "echo", '{"a": [1.5]}')
    assert (done.returncode, done.stdout) == (0, '{"a": [1.5]}\n'), done.stderr[-2000:]
    assert_only(added, CALL_IMPORTS)
    assert "cogni_tool.client" in added  # the measurement saw the call's imports at all


@pytest.mark.parametrize(
    ("words", "status"),
    [
        (("exec", "fail", '{"code": "policy_denied"}'), 15),  # an error answer
        # (Only text that is not JSON at all loads json, to say where it is wrong.)
        (("exec", "wrong_id"), 4),  # an answer to a call never made
        (("list",), 0),
    ],
    ids=["tool-error", "protocol-error", "list"],
)
def test_other_calls_import_only_the_allowlist(
    bare_interpreter_modules: set[str], tmp_path: Path, words: tuple[str, ...], status: int
) -> None:
    with fake_gateway(tmp_path) as gw:
        added, done = call_modules(bare_interpreter_modules, gw, *words)
    assert done.returncode == status, done.stderr[-2000:]
    assert_only(added, CALL_IMPORTS)


@pytest.mark.parametrize(
    "code",
    [
        "import cogni_tool.cli",
        "import cogni_tool.cli, cogni_tool.client",
        "import cogni_tool.__main__",
        "from cogni_tool import Client, ToolError",
    ],
)
def test_importing_cogni_tool_adds_only_the_allowlist(
    bare_interpreter_modules: set[str], code: str
) -> None:
    added = imported_modules(code) - bare_interpreter_modules
    assert "cogni_tool" in added  # the measurement saw our import at all
    assert_only(added, LIBRARY_IMPORTS)


def test_help_and_version_do_not_import_the_socket_client(
    bare_interpreter_modules: set[str],
) -> None:
    added = imported_modules("import cogni_tool.cli") - bare_interpreter_modules
    assert added <= {"cogni_tool", "cogni_tool.cli", "__future__"}, sorted(added)


def test_pipelined_batch_larger_than_the_socket_buffer_adds_only_select(
    bare_interpreter_modules: set[str], tmp_path: Path
) -> None:
    # Only a batch the socket buffer cannot take at once needs poll(), from select.
    call = "c.call_many([('echo', {'blob': 'x' * 100_000})] * 40)"
    with fake_gateway(tmp_path) as gw:
        done = importtime(
            "import sys; from cogni_tool import Client\n"
            f"with Client({str(gw.path)!r}, {RUN_ID!r}, timeout=20) as c:\n"
            f"    sys.exit(0 if {call} == [{{'blob': 'x' * 100_000}}] * 40 else 1)\n"
        )
    assert done.returncode == 0, done.stderr[-2000:]
    added = modules_in(done.stderr) - bare_interpreter_modules
    assert "select" in added
    assert_only(added - {"select"}, LIBRARY_IMPORTS)


# --- without the C modules (another Python implementation) ------------------------------


@pytest.mark.parametrize(
    ("blocked", "stands_in"),
    [("_socket", "socket"), ("_json", "json")],
)
def test_exec_works_when_a_c_module_is_missing(
    tmp_path: Path, blocked: str, stands_in: str
) -> None:
    # A None entry in sys.modules makes ``import name`` fail, as on a Python without it.
    # socket itself needs _socket, so it is loaded first and then stands in for it.
    code = f"import sys, {stands_in}; sys.modules[{blocked!r}] = None\n" + LAUNCHER.format(
        words=["exec", "echo", '{"text": "grüße", "n": [1, 2.5e-8]}']
    )
    with fake_gateway(tmp_path) as gw:
        done = subprocess.run(
            [sys.executable, "-S", "-E", "-c", code],
            capture_output=True,
            cwd=REPO_ROOT,
            env={"COGNI_GATEWAY_SOCK": str(gw.path), "COGNI_RUN_ID": RUN_ID},
            timeout=30,
            check=False,
        )
    assert done.returncode == 0, done.stderr.decode()
    assert done.stdout.decode() == '{"text": "grüße", "n": [1, 2.5e-08]}\n'


def test_cli_works_without_site_packages(tmp_path: Path) -> None:
    with fake_gateway(tmp_path) as gateway:
        done = subprocess.run(
            [sys.executable, "-S", "-E", "-m", "cogni_tool", "exec", "echo", '{"ok": 1}'],
            capture_output=True,
            text=True,
            cwd=REPO_ROOT,
            env={"COGNI_GATEWAY_SOCK": str(gateway.path), "COGNI_RUN_ID": RUN_ID},
            timeout=30,
            check=False,
        )
    assert (done.returncode, done.stdout, done.stderr) == (0, '{"ok": 1}\n', "")


@pytest.mark.parametrize("path", sorted(PACKAGE.glob("*.py")), ids=lambda p: p.name)
def test_sources_parse_as_python_3_8(path: Path) -> None:
    # Sandbox images may ship an old python3: the grammar must be 3.8's.
    source = path.read_text()
    ast.parse(source, filename=str(path), feature_version=(3, 8))
    # Annotations stay strings, so ``str | None`` and ``list[str]`` never run on 3.8.
    assert "from __future__ import annotations" in source
