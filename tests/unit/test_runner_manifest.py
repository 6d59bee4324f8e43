"""A tool folder's manifest (gatewayd/runners/manifest.py): a valid one becomes the
FolderTool the runners run; every invalid one is refused naming its file, the field's
path and the reason, before anything runs."""

from __future__ import annotations

import copy
from typing import Any

import pytest

from gatewayd.config import (
    DEFAULT_TOOL_MEMORY_MB,
    DEFAULT_TOOL_TIMEOUT_S,
    MAX_TOOL_MEMORY_MIB,
    MAX_TOOL_TIMEOUT_S,
    GatewaydConfig,
)
from gatewayd.policy.capabilities import FileCapability
from gatewayd.policy.paths import MAX_PATH_BYTES, PathMode
from gatewayd.runners import manifest as manifest_module
from gatewayd.runners.manifest import (
    MAX_FILE_NEEDS,
    MAX_PROBLEMS,
    MAX_REASON_CHARS,
    MIB,
    ManifestDefaults,
    ManifestError,
    field_path,
    parse_manifest,
)
from gatewayd.runners.spec import FileNeed, NameNeed
from gatewayd.tools.manifest import RunnerKind

FILE = "/srv/tools/wc/manifest.json"
FOLDER = "/srv/tools/wc"

WASM: dict[str, Any] = {
    "name": "text.wordcount",
    "version": "1.0.0",
    "description": "Count the words of a text.",
    "input_schema": {
        "type": "object",
        "properties": {"text": {"type": "string", "pattern": "^[^\\x00]*$"}},
        "required": ["text"],
        "additionalProperties": False,
    },
    "runtime": "wasm",
    "entry": "bin/wordcount.wasm",
    "capabilities": {
        "filesystem": [
            {"path": "src", "access": "read"},
            {"path": "out", "access": "read-write", "optional": True},
        ],
        "model_access": ["default", {"alias": "big", "optional": True}],
        "env": ["LANG", {"name": "TZ", "optional": True}],
    },
    "limits": {"timeout": 5, "memory": 64, "fuel": 100_000_000},
}
PROCESS: dict[str, Any] = {
    "name": "py.lines",
    "version": "0.1",
    "description": "Count lines.",
    "input_schema": {"type": "object"},
    "runtime": "process",
    "entry": ["python3", "/tool/lines.py"],
    "capabilities": {
        "network": ["api.example.com", {"domain": "*.cdn.example.com", "optional": True}]
    },
}


def with_(base: dict[str, Any], path: str, value: Any) -> dict[str, Any]:
    """``base`` with the field at dotted ``path`` (``a.b.0.c``) set to ``value``, or
    removed when ``value`` is ``DELETE``."""
    data = copy.deepcopy(base)
    *parents, last = path.split(".")
    node: Any = data
    for part in parents:
        node = node[int(part)] if isinstance(node, list) else node.setdefault(part, {})
    key: Any = int(last) if isinstance(node, list) else last
    if value is DELETE:
        del node[key]
    else:
        node[key] = value
    return data


DELETE = object()


def refused(data: Any, defaults: ManifestDefaults | None = None) -> ManifestError:
    with pytest.raises(ManifestError) as caught:
        parse_manifest(data, file=FILE, folder=FOLDER, defaults=defaults or ManifestDefaults())
    return caught.value


# --- valid manifests ----------------------------------------------------------------


def test_a_wasm_manifest_becomes_a_folder_tool_with_every_need_declared() -> None:
    tool = parse_manifest(WASM, file=FILE, folder=FOLDER)
    assert tool.name == "text.wordcount"
    assert tool.runner is RunnerKind.WASM
    assert tool.entry == ("/srv/tools/wc/bin/wordcount.wasm",)
    assert tool.manifest_path == FILE
    assert tool.files == (
        FileNeed(path="/workspace/src", mode=PathMode.RO),
        FileNeed(path="/workspace/out", mode=PathMode.RW, optional=True),
    )
    assert tool.models == (NameNeed(name="default"), NameNeed(name="big", optional=True))
    assert tool.env == (NameNeed(name="LANG"), NameNeed(name="TZ", optional=True))
    caps = tool.manifest.capabilities
    # Every need, optional or not, is declared: nothing beyond them is ever granted.
    assert caps.files == (
        FileCapability(path="/workspace/src", mode=PathMode.RO),
        FileCapability(path="/workspace/out", mode=PathMode.RW),
    )
    assert caps.model_access == ("default", "big")
    assert caps.env == ("LANG", "TZ")
    assert caps.network == ()
    assert caps.exec is False
    limits = tool.manifest.limits
    assert (limits.timeout_s, limits.memory_bytes, limits.fuel) == (5.0, 64 * MIB, 100_000_000)
    assert tool.manifest.summary == "Count the words of a text."
    assert tool.manifest.args_schema == WASM["input_schema"]
    assert tool.manifest.side_effects is True  # a model and a writable path


def test_the_whole_workspace_is_dot() -> None:
    data = with_(WASM, "capabilities.filesystem", [{"path": ".", "access": "read"}])
    assert parse_manifest(data, file=FILE, folder=FOLDER).files == (
        FileNeed(path="/workspace", mode=PathMode.RO),
    )


def test_a_process_manifest_runs_its_argv_and_needs_exec() -> None:
    tool = parse_manifest(PROCESS, file=FILE, folder=FOLDER)
    assert tool.runner is RunnerKind.PROCESS
    assert tool.entry == ("python3", "/tool/lines.py")
    assert tool.network == (
        NameNeed(name="api.example.com"),
        NameNeed(name="*.cdn.example.com", optional=True),
    )
    assert tool.manifest.capabilities.exec is True
    assert tool.manifest.side_effects is True


def test_absent_runtime_and_limits_take_the_configured_defaults() -> None:
    data = with_(with_(WASM, "runtime", DELETE), "limits", DELETE)
    defaults = ManifestDefaults(runner=RunnerKind.WASM, timeout_s=7.5, memory_mb=32)
    tool = parse_manifest(data, file=FILE, folder=FOLDER, defaults=defaults)
    assert tool.runner is RunnerKind.WASM
    limits = tool.manifest.limits
    assert (limits.timeout_s, limits.memory_bytes, limits.fuel) == (7.5, 32 * MIB, None)
    process = with_(PROCESS, "runtime", DELETE)
    tool = parse_manifest(
        process, file=FILE, folder=FOLDER, defaults=ManifestDefaults(runner=RunnerKind.PROCESS)
    )
    assert tool.runner is RunnerKind.PROCESS


def test_a_wasm_tool_that_only_reads_has_no_side_effects() -> None:
    data = with_(
        with_(WASM, "capabilities.model_access", []),
        "capabilities.filesystem.1",
        {
            "path": "docs",
            "access": "read",
        },
    )
    assert parse_manifest(data, file=FILE, folder=FOLDER).manifest.side_effects is False


# --- the shape: every field's error names its path and the reason ---------------------

SHAPE_CASES: list[tuple[str, Any, str, str]] = [
    # (field to set, value, field path in the message, words of the reason)
    ("name", 7, "name", "is not of type 'string'"),
    ("name", "", "name", "should be non-empty"),
    ("name", DELETE, "name", "required, and missing"),
    ("version", 1.0, "version", "is not of type 'string'"),
    ("version", "v" * 65, "version", "is too long"),
    ("description", DELETE, "description", "required, and missing"),
    ("description", "x" * 1001, "description", "is too long"),
    ("input_schema", "object", "input_schema", "is not of type 'object'"),
    ("input_schema", DELETE, "input_schema", "required, and missing"),
    ("runtime", "docker", "runtime", "is not one of ['wasm', 'process']"),
    ("entry", DELETE, "entry", "required, and missing"),
    ("entry", 3, "entry", "is not of type 'string', 'array'"),
    ("entry", "", "entry", "should be non-empty"),
    ("entry", [], "entry", "should be non-empty"),
    ("entry", ["python3", 4], "entry[1]", "is not of type 'string'"),
    ("capabilities", [], "capabilities", "is not of type 'object'"),
    ("capabilities.files", [], "capabilities.files", "unknown field"),
    ("capabilities.filesystem", {}, "capabilities.filesystem", "is not of type 'array'"),
    (
        "capabilities.filesystem.1.access",
        "write",
        "capabilities.filesystem[1].access",
        "'write' is not one of ['read', 'read-write']",
    ),
    (
        "capabilities.filesystem.1.access",
        DELETE,
        "capabilities.filesystem[1].access",
        "required, and missing",
    ),
    (
        "capabilities.filesystem.1.optional",
        "yes",
        "capabilities.filesystem[1].optional",
        "is not of type 'boolean'",
    ),
    ("capabilities.filesystem.0.mode", "ro", "capabilities.filesystem[0].mode", "unknown field"),
    ("capabilities.filesystem.0.path", "", "capabilities.filesystem[0].path", "non-empty"),
    ("capabilities.filesystem.0", "src", "capabilities.filesystem[0]", "is not of type 'object'"),
    (
        "capabilities.network",
        ["Example.COM"],
        "capabilities.network[0]",
        "not a lowercase host name",
    ),
    (
        "capabilities.network",
        [{"host": "a.org"}],
        "capabilities.network[0].domain",
        "required, and missing",
    ),
    (
        "capabilities.network",
        [{"domain": "a.org", "host": 1}],
        "capabilities.network[0].host",
        "unknown field",
    ),
    (
        "capabilities.model_access",
        ["bad alias!"],
        "capabilities.model_access[0]",
        "not a model alias",
    ),
    (
        "capabilities.model_access",
        [3],
        "capabilities.model_access[0]",
        "is not of type 'string', 'object'",
    ),
    ("capabilities.env", ["1ABC"], "capabilities.env[0]", "not an environment variable name"),
    (
        "capabilities.env",
        [{"name": "X=Y"}],
        "capabilities.env[0].name",
        "not an environment variable name",
    ),
    (
        "capabilities.env",
        [{"name": "A", "optional": 1}],
        "capabilities.env[0].optional",
        "is not of type 'boolean'",
    ),
    ("limits.timeout", 0, "limits.timeout", "less than or equal to the minimum of 0"),
    ("limits.timeout", "5s", "limits.timeout", "is not of type 'number'"),
    ("limits.timeout", MAX_TOOL_TIMEOUT_S + 1, "limits.timeout", "is greater than the maximum"),
    ("limits.memory", 1.5, "limits.memory", "is not of type 'integer'"),
    ("limits.memory", 0, "limits.memory", "less than the minimum of 1"),
    ("limits.memory", MAX_TOOL_MEMORY_MIB + 1, "limits.memory", "greater than the maximum"),
    ("limits.fuel", -1, "limits.fuel", "less than the minimum of 1"),
    ("limits.fuel", 2**64, "limits.fuel", "greater than the maximum"),
    ("limits.cpu", 1, "limits.cpu", "unknown field; allowed here: timeout, memory, fuel"),
    ("capabilites", {}, "capabilites", "did you mean 'capabilities'?"),
]


@pytest.mark.parametrize(("field", "value", "where", "reason"), SHAPE_CASES)
def test_a_field_of_the_wrong_shape_is_refused_naming_its_path_and_reason(
    field: str, value: Any, where: str, reason: str
) -> None:
    error = refused(with_(WASM, field, value))
    assert any(p.field == where and reason in p.reason for p in error.problems), str(error)
    assert f"{FILE}: {where}: " in str(error)


def test_every_problem_of_a_document_is_reported_at_once() -> None:
    data = with_(with_(with_(WASM, "version", 1), "limits.fuel", 0), "colour", "red")
    fields = {p.field for p in refused(data).problems}
    assert fields == {"version", "limits.fuel", "colour"}


@pytest.mark.parametrize("document", [None, [], "name: x", 3])
def test_a_document_that_is_not_a_mapping_is_refused(document: Any) -> None:
    error = refused(document)
    assert error.field == ""
    assert "a manifest is a mapping of fields" in error.reason


def test_a_huge_value_is_quoted_short() -> None:
    error = refused(with_(WASM, "version", ["x" * 100_000]))
    assert len(error.reason) <= MAX_REASON_CHARS
    assert error.reason.endswith("is not of type 'string'")  # the reason survives the cut
    error = refused(with_(WASM, "capabilities.env", ["9" * 200]))
    assert error.reason.endswith(
        "is not an environment variable name (letters, digits and '_', not first a digit)"
    )


def test_a_flood_of_problems_is_cut() -> None:
    data = with_(WASM, "capabilities.env", ["1bad"] * 64)
    assert len(refused(data).problems) == MAX_PROBLEMS


def test_too_many_declarations_are_refused() -> None:
    many = [{"path": f"d{i}", "access": "read"} for i in range(MAX_FILE_NEEDS + 1)]
    error = refused(with_(WASM, "capabilities.filesystem", many))
    assert error.field == "capabilities.filesystem"
    assert "is too long" in error.reason


# --- what a schema cannot say ---------------------------------------------------------

BAD_PATHS = [
    ("../secrets", "has a '..' component"),
    ("src/../../etc", "has a '..' component"),
    ("..", "has a '..' component"),
    ("/etc", "is absolute"),
    ("//etc", "is absolute"),
    ("~", "starts with '~'"),
    ("~/.ssh", "starts with '~'"),
    ("src/", "is not normalized"),
    ("./src", "is not normalized"),
    ("src//x", "is not normalized"),
    ("src/./x", "is not normalized"),
    ("a\x00b", "control character or NUL"),
    ("a\nb", "control character or NUL"),
    ("apps", "apps folder"),
    ("APPS/x", "apps folder"),
    ("apps/notes/data", "apps folder"),
    ("é" * (MAX_PATH_BYTES // 2 + 1), "longer than"),
]


@pytest.mark.parametrize(("path", "reason"), BAD_PATHS)
def test_a_filesystem_path_must_be_workspace_relative_and_normalized(
    path: str, reason: str
) -> None:
    error = refused(with_(WASM, "capabilities.filesystem.0.path", path))
    assert error.field == "capabilities.filesystem[0].path"
    assert reason in error.reason


@pytest.mark.parametrize(
    ("entry", "reason"),
    [
        ("../other/tool.wasm", "has a '..' component"),
        ("bin/../../x.wasm", "has a '..' component"),
        ("/usr/lib/tool.wasm", "is absolute"),
        ("~/tool.wasm", "starts with '~'"),
        ("bin//x.wasm", "is not normalized"),
        (".", "is not normalized"),
        (["tool.wasm"], "as one string"),
    ],
)
def test_a_wasm_entry_stays_inside_the_folder(entry: Any, reason: str) -> None:
    error = refused(with_(WASM, "entry", entry))
    assert error.field == "entry"
    assert reason in error.reason


def test_a_process_entry_is_an_argv_list() -> None:
    error = refused(with_(PROCESS, "entry", "python3 /tool/x.py"))
    assert error.field == "entry"
    assert "argv" in error.reason
    error = refused(with_(PROCESS, "entry", ["python3", "a\x00b"]))
    assert error.field == "entry[1]"


def test_fuel_on_a_process_tool_is_refused() -> None:
    error = refused(with_(PROCESS, "limits", {"fuel": 10}))
    assert error.field == "limits.fuel"
    assert "wasm instruction budget" in error.reason


@pytest.mark.parametrize("domain", ["api.example.com", {"domain": "a.org", "optional": True}])
def test_network_on_a_wasm_tool_is_refused(domain: Any) -> None:
    error = refused(with_(WASM, "capabilities.network", [domain]))
    assert error.field == "capabilities.network"
    assert "no sockets" in error.reason


@pytest.mark.parametrize("name", ["OPENAI_API_KEY", "FORGE_TOKEN", "PATH"])
def test_an_env_name_gatewayd_holds_or_sets_is_refused(name: str) -> None:
    defaults = ManifestDefaults(
        refused_env={
            "OPENAI_API_KEY": "gatewayd holds a secret in this variable",
            "FORGE_TOKEN": "gatewayd holds a secret in this variable",
            "PATH": "gatewayd sets this variable",
        }
    )
    data = with_(WASM, "capabilities.env", ["LANG", {"name": name, "optional": True}])
    error = refused(data, defaults)
    assert error.field == "capabilities.env[1]"
    assert name in error.reason and "gatewayd" in error.reason


@pytest.mark.parametrize(
    ("field", "value", "where"),
    [
        (
            "capabilities.filesystem",
            [{"path": "src", "access": "read"}] * 2,
            "capabilities.filesystem[1].path",
        ),
        (
            "capabilities.model_access",
            ["m", {"alias": "m", "optional": True}],
            "capabilities.model_access[1]",
        ),
        ("capabilities.env", ["LANG", "LANG"], "capabilities.env[1]"),
    ],
)
def test_a_need_declared_twice_is_refused(field: str, value: Any, where: str) -> None:
    error = refused(with_(WASM, field, value))
    assert error.field == where
    assert "declared twice" in error.reason


@pytest.mark.parametrize(
    ("name", "reason"),
    [
        ("Text.Count", "is not a tool name"),
        ("text..count", "is not a tool name"),
        ("1text", "is not a tool name"),
        ("mcp.time.now", "reserved"),
        ("app_notes", "reserved"),
    ],
)
def test_a_tool_name_must_be_one_a_request_can_carry_and_not_reserved(
    name: str, reason: str
) -> None:
    error = refused(with_(WASM, "name", name))
    assert error.field == "name"
    assert reason in error.reason


@pytest.mark.parametrize(
    ("schema", "where", "reason"),
    [
        ({"type": "string"}, "input_schema.type", '"type": "object"'),
        (
            {"type": "object", "properties": {"a": {"type": "strnig"}}},
            "input_schema",
            "not a valid JSON Schema",
        ),
        (
            {"type": "object", "properties": {"a": {"type": "string", "pattern": "(a"}}},
            "input_schema",
            "not a valid JSON Schema",
        ),
        (
            {
                "type": "object",
                "properties": {"a": {"type": "string", "pattern": "(?:a{1000}){1000}"}},
            },
            "input_schema",
            "MAX_PATTERN_WEIGHT",
        ),
        (
            {"type": "object", "patternProperties": {"^x": {}}, "unevaluatedProperties": False},
            "input_schema",
            "unevaluatedProperties",
        ),
    ],
)
def test_the_argument_schema_is_a_bounded_json_schema(
    schema: dict[str, Any], where: str, reason: str
) -> None:
    error = refused(with_(WASM, "input_schema", schema))
    assert any(p.field == where and reason in p.reason for p in error.problems), str(error)


def test_field_paths_read_as_the_manifest_is_written() -> None:
    assert field_path(("capabilities", "filesystem", 1, "access")) == (
        "capabilities.filesystem[1].access"
    )
    assert field_path(()) == ""
    assert field_path(("entry", 0)) == "entry[0]"


def test_the_configuration_bounds_and_defaults_are_the_manifests() -> None:
    # gatewayd.config sits below the manifest's module and keeps copies of its bounds.
    assert MAX_TOOL_TIMEOUT_S == manifest_module.MAX_TIMEOUT_S
    assert MAX_TOOL_MEMORY_MIB == manifest_module.MAX_MEMORY_MIB
    # and of its defaults, which a manifest parsed without the configuration gets
    config = GatewaydConfig()
    assert ManifestDefaults().runner == config.tool_default_runner
    assert ManifestDefaults().timeout_s == config.tool_timeout_s == DEFAULT_TOOL_TIMEOUT_S
    assert ManifestDefaults().memory_mb == config.tool_memory_mb == DEFAULT_TOOL_MEMORY_MB


@pytest.mark.parametrize(
    ("argv", "reason"),
    [
        (["./run.sh"], "is a relative path"),
        (["bin/run"], "is a relative path"),
        (["/workspace/run.sh"], "runs a program from the workspace"),
        (["/workspace"], "runs a program from the workspace"),
        (["/tool/../workspace/x"], "runs a program from the workspace"),
    ],
)
def test_a_process_tools_program_is_never_the_workspaces(argv: list[str], reason: str) -> None:
    error = refused(with_(PROCESS, "entry", argv))
    assert error.field == "entry[0]"
    assert reason in error.reason


@pytest.mark.parametrize("argv", [["python3", "/tool/x.py"], ["/usr/bin/env", "x"], ["/tool/run"]])
def test_a_process_tools_program_is_on_path_or_absolute(argv: list[str]) -> None:
    assert parse_manifest(with_(PROCESS, "entry", argv), file=FILE, folder=FOLDER).entry == tuple(
        argv
    )


@pytest.mark.parametrize(
    ("field", "value", "reason"),
    [
        ("version", "1.0\x1b[31m", "holds a control character"),
        ("description", " \n\t ", "is blank"),
        ("description", "Counts\x07 words", "holds a control character"),
    ],
)
def test_text_shown_to_people_holds_no_control_character(
    field: str, value: str, reason: str
) -> None:
    error = refused(with_(WASM, field, value))
    assert error.field == field
    assert reason in error.reason


def test_a_description_is_one_line_in_tools_list() -> None:
    data = with_(WASM, "description", "Counts\n  the words\tof a text.\n")
    assert parse_manifest(data, file=FILE, folder=FOLDER).manifest.summary == (
        "Counts the words of a text."
    )


def test_yaml_keys_that_are_not_strings_are_unknown_fields() -> None:
    data = {**WASM, 1: "x", None: "y"}
    fields = {p.field for p in refused(data).problems}
    assert fields == {"1", "None"}


@pytest.mark.parametrize("dialect", ["http://evil.example/schema", 5, None])
def test_an_unknown_schema_dialect_is_refused(dialect: Any) -> None:
    schema = {"type": "object", "$schema": dialect}
    error = refused(with_(WASM, "input_schema", schema))
    assert error.field == "input_schema.$schema"
    assert "no JSON Schema draft jsonschema knows" in error.reason


def test_a_published_draft_is_accepted() -> None:
    schema = {"type": "object", "$schema": "http://json-schema.org/draft-07/schema#"}
    tool = parse_manifest(with_(WASM, "input_schema", schema), file=FILE, folder=FOLDER)
    assert tool.manifest.args_schema == schema
