"""cogni-tool's import footprint and portability: standard library only, cheap, python3.8+.

Run with ``python -S`` (no site-packages at all) from the repository root, so these
tests also prove that cogni_tool needs nothing but the standard library.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

from tests.unit.test_cogni_tool_client import RUN_ID, fake_gateway

REPO_ROOT = Path(__file__).resolve().parents[2]
PACKAGE = REPO_ROOT / "cogni_tool"

# The only modules cogni-tool may add to a bare interpreter, with why each is there.
ALLOWED_IMPORTS = frozenset(
    {
        "cogni_tool",
        "__future__",  # postponed annotations, so hints cost nothing at run time
        # socket, and what socket itself imports
        "socket",
        "_socket",
        "selectors",
        "select",
        "errno",
        "array",
        "math",
        "collections",
        "_collections",
        "_collections_abc",
        "enum",
        "types",
        "functools",
        "_functools",
        "operator",
        "_operator",
        "itertools",
        "keyword",
        "reprlib",
        # json, and the regular expressions its decoder is built on
        "json",
        "_json",
        "re",
        "_sre",
        "copyreg",
        # struct for the length prefix; os for the environment and pid
        "struct",
        "_struct",
        "os",
        "stat",
        "_stat",
        "posixpath",
        "genericpath",
    }
)

# Named here so a failure says plainly what crept in.
FORBIDDEN_IMPORTS = frozenset(
    {"argparse", "asyncio", "typing", "dataclasses", "inspect", "importlib", "logging"}
    | {"gatewayd", "msgspec", "trio", "pydantic", "yaml", "structlog", "httpx"}
)


def imported_modules(code: str) -> set[str]:
    """Top-level names of the modules ``python -S -X importtime -c code`` imports."""
    done = subprocess.run(
        [sys.executable, "-S", "-E", "-X", "importtime", "-c", code],
        capture_output=True,
        text=True,
        cwd=REPO_ROOT,
        timeout=30,
        check=True,
    )
    names = set()
    for line in done.stderr.splitlines():
        if not line.startswith("import time:") or "imported package" in line:
            continue
        names.add(line.rsplit("|", 1)[1].strip().split(".")[0])
    assert names, f"no import times reported: {done.stderr[:500]}"
    return names


@pytest.fixture(scope="module")
def bare_interpreter_modules() -> set[str]:
    return imported_modules("pass")


@pytest.mark.parametrize(
    "code",
    [
        "import cogni_tool.cli",
        "import cogni_tool.cli, cogni_tool.client",
        "import cogni_tool.__main__",
        "from cogni_tool import Client, ToolError",
    ],
)
def test_cogni_tool_imports_only_allowlisted_standard_modules(
    bare_interpreter_modules: set[str], code: str
) -> None:
    added = imported_modules(code) - bare_interpreter_modules
    assert "cogni_tool" in added  # the measurement saw our import at all
    assert not added & FORBIDDEN_IMPORTS, sorted(added & FORBIDDEN_IMPORTS)
    assert added <= ALLOWED_IMPORTS, f"not on the allowlist: {sorted(added - ALLOWED_IMPORTS)}"
    assert added - {"cogni_tool"} <= sys.stdlib_module_names


def test_help_and_version_do_not_import_the_socket_client(
    bare_interpreter_modules: set[str],
) -> None:
    added = imported_modules("import cogni_tool.cli") - bare_interpreter_modules
    assert added <= {"cogni_tool", "__future__"}, sorted(added)


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
