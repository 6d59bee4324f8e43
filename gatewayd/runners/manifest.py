"""A tool folder's manifest: its data (read from ``manifest.json`` or ``manifest.yaml``)
in, a :class:`~gatewayd.runners.spec.FolderTool` out, or every problem with its field.

Two passes, like the other files gatewayd reads from operators:

1. the shape, against :data:`MANIFEST_SCHEMA`, a JSON Schema of ours checked with
   ``jsonschema`` (the maintained implementation the MCP tools' schemas use too): wrong
   types, unknown keys, missing fields, values out of range. Each complaint names the
   field by its path (``capabilities.filesystem[1].access``) and the reason, as the
   library words it or, for missing and unknown keys, as we word it (with the keys
   allowed there and a close match);
2. what a schema cannot say: paths that are workspace-relative and normalized (no
   ``..``, no absolute path, no ``~``, never the workspace's apps folder), a wasm entry
   inside the folder, fuel only for a wasm tool, no network for a wasm tool (WASI
   preview 1 has no sockets), no environment variable whose value gatewayd holds as a
   secret or sets itself, nothing declared twice, and the argument schema
   (``input_schema``) a JSON Schema ``jsonschema`` accepts whose patterns are bounded
   (:mod:`gatewayd.mcp.schemas`).

Pure: data in, data out; the folder's files are read by :mod:`gatewayd.runners.folders`.
jsonschema is imported when the first manifest is checked, so that what only names this
module's limits and problems (the daemon, whether it has tool folders or not) does not
load it (:mod:`gatewayd.libraries`).
"""

from __future__ import annotations

import difflib
import functools
import itertools
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import PurePosixPath
from typing import TYPE_CHECKING, Any, Final, cast

from gatewayd.apps.manifest import TOOL_NAME_PREFIX as APP_TOOL_PREFIX
from gatewayd.mcp.pinset import GATEWAY_PREFIX as MCP_PREFIX
from gatewayd.mcp.schemas import SchemaRefused, bounded_validator
from gatewayd.policy.appsfolder import is_apps_name
from gatewayd.policy.capabilities import Capabilities, FileCapability
from gatewayd.policy.paths import MAX_PATH_BYTES, WORKSPACE_VISIBLE_ROOT, PathMode
from gatewayd.policy.section import MODEL_ALIAS_RE
from gatewayd.protocol import MAX_ID_CHARS, TOOL_NAME_RE
from gatewayd.runners.spec import FOLDER_RUNNERS, FileNeed, FolderTool, NameNeed
from gatewayd.tools.manifest import (
    MAX_SUMMARY_CHARS,
    MAX_VERSION_CHARS,
    RunnerKind,
    ToolLimits,
    ToolManifest,
)

if TYPE_CHECKING:
    import jsonschema.exceptions
    import jsonschema.protocols

MIB: Final = 1 << 20
# A tool's own time limit, in seconds: an hour is longer than any call should hold a
# run's slot (the run's limits.call_timeout_s bounds each call too).
MAX_TIMEOUT_S: Final = 3600
# A tool's memory, in MiB: 16 GiB is more than a wasm32 module can address (4 GiB) and
# than a sandboxed helper program should take of the host.
MAX_MEMORY_MIB: Final = 16 * 1024
# wasmtime's fuel is a u64; 2**63 - 1 keeps it in a signed 64-bit integer everywhere.
MAX_FUEL: Final = 2**63 - 1
# Declarations per kind: a tool names the few things it works on; longer lists are a
# pasted catalogue (and each path is a mount or a preopen per call).
MAX_FILE_NEEDS: Final = 32
MAX_NAME_NEEDS: Final = 64
# A process tool's argv: a program and its arguments, each at most a path's length.
MAX_ARGV_ITEMS: Final = 256
# What one complaint quotes: jsonschema quotes the offending value, which may be long.
MAX_REASON_CHARS: Final = 300
# How much of the offending value a complaint quotes: enough to recognise it.
MAX_QUOTED_CHARS: Final = 60
# How many problems one manifest reports: past this, fixing the first ones comes first.
MAX_PROBLEMS: Final = 20

_ENV_NAME: Final = r"^[A-Za-z_][A-Za-z0-9_]*$"
# A host name as policies write them (gatewayd.policy.review_section), or "*.suffix".
_DOMAIN: Final = r"^(\*\.)?([a-z0-9]([a-z0-9-]{0,61}[a-z0-9])?\.)*[a-z0-9-]{1,63}$"
_ACCESS: Final = {"read": PathMode.RO, "read-write": PathMode.RW}


def _name_list(key: str, value_schema: dict[str, Any]) -> dict[str, Any]:
    """A list of names, each a string or ``{key: name, optional: bool}``: the keywords
    of both shapes in one schema (string keywords apply to strings only, object
    keywords to objects only), so a complaint names the item's own problem."""
    return {
        "type": "array",
        "maxItems": MAX_NAME_NEEDS,
        "items": {
            "type": ["string", "object"],
            **value_schema,
            "required": [key],
            "additionalProperties": False,
            "properties": {
                key: {"type": "string", **value_schema},
                "optional": {"type": "boolean"},
            },
        },
    }


# The manifest file's shape (module doc, pass 1). docs/tool-runners.md describes it.
MANIFEST_SCHEMA: Final[dict[str, Any]] = {
    "$schema": "https://json-schema.org/draft/2020-12/schema",
    "type": "object",
    "required": ["name", "version", "description", "input_schema", "entry"],
    "additionalProperties": False,
    "properties": {
        "name": {"type": "string", "minLength": 1, "maxLength": MAX_ID_CHARS},
        "version": {"type": "string", "minLength": 1, "maxLength": MAX_VERSION_CHARS},
        "description": {"type": "string", "minLength": 1, "maxLength": MAX_SUMMARY_CHARS},
        "input_schema": {"type": "object"},
        "runtime": {"enum": [str(kind) for kind in FOLDER_RUNNERS]},
        "entry": {
            "type": ["string", "array"],
            "minLength": 1,
            "maxLength": MAX_PATH_BYTES,
            "minItems": 1,
            "maxItems": MAX_ARGV_ITEMS,
            "items": {"type": "string", "minLength": 1, "maxLength": MAX_PATH_BYTES},
        },
        "capabilities": {
            "type": "object",
            "additionalProperties": False,
            "properties": {
                "filesystem": {
                    "type": "array",
                    "maxItems": MAX_FILE_NEEDS,
                    "items": {
                        "type": "object",
                        "required": ["path", "access"],
                        "additionalProperties": False,
                        "properties": {
                            "path": {"type": "string", "minLength": 1, "maxLength": MAX_PATH_BYTES},
                            "access": {"enum": list(_ACCESS)},
                            "optional": {"type": "boolean"},
                        },
                    },
                },
                "network": _name_list("domain", {"maxLength": 253, "pattern": _DOMAIN}),
                "model_access": _name_list(
                    "alias", {"pattern": "^" + MODEL_ALIAS_RE.pattern + "$"}
                ),
                "env": _name_list("name", {"maxLength": 255, "pattern": _ENV_NAME}),
            },
        },
        "limits": {
            "type": "object",
            "additionalProperties": False,
            "properties": {
                "timeout": {"type": "number", "exclusiveMinimum": 0, "maximum": MAX_TIMEOUT_S},
                "memory": {"type": "integer", "minimum": 1, "maximum": MAX_MEMORY_MIB},
                "fuel": {"type": "integer", "minimum": 1, "maximum": MAX_FUEL},
            },
        },
    },
}


@functools.cache
def _manifest_validator() -> jsonschema.protocols.Validator:
    """The validator of :data:`MANIFEST_SCHEMA`, made once, at the first manifest."""
    import jsonschema.validators

    return jsonschema.validators.Draft202012Validator(MANIFEST_SCHEMA)


@dataclass(frozen=True, slots=True)
class Problem:
    """One thing wrong with a manifest: its file, the field's path, and why."""

    file: str
    field: str  # "capabilities.filesystem[1].access"; "" for the document as a whole
    reason: str

    def __str__(self) -> str:
        if not self.field:
            return f"{self.file}: {self.reason}"
        return f"{self.file}: {self.field}: {self.reason}"


class ManifestError(ValueError):
    """A manifest that is refused; ``problems`` lists each (at least one), ``str()``
    one per line. ``field`` and ``reason`` are the first problem's."""

    def __init__(self, problems: Sequence[Problem]) -> None:
        if not problems:
            raise ValueError("a ManifestError needs a problem")
        super().__init__("\n".join(str(p) for p in problems))
        self.problems = tuple(problems)

    @property
    def field(self) -> str:
        return self.problems[0].field

    @property
    def reason(self) -> str:
        return self.problems[0].reason


@dataclass(frozen=True, slots=True, kw_only=True)
class ManifestDefaults:
    """What a manifest that leaves it out gets (gatewayd's configuration:
    ``tool_default_runner``, ``tool_timeout_s``, ``tool_memory_mb``), and the
    environment names no tool may declare, each with the reason given."""

    # gatewayd.config's defaults (which this pure module cannot import); the daemon and
    # `gatewayd tools` pass the configuration's own (gatewayd.runners.folders).
    runner: RunnerKind = RunnerKind.WASM
    timeout_s: float = 30.0
    memory_mb: int = 256
    refused_env: Mapping[str, str] = field(default_factory=dict)


DEFAULTS: Final = ManifestDefaults()


def parse_manifest(
    data: Any, *, file: str, folder: str, defaults: ManifestDefaults = DEFAULTS
) -> FolderTool:
    """The tool ``data`` (a manifest's document, as JSON or YAML decoded it) declares,
    for the folder at ``folder`` (an absolute host path). ``file`` names the manifest in
    messages. The digests are left empty for the caller, who has the bytes.

    Error handling: :class:`ManifestError` listing each problem (at most
    :data:`MAX_PROBLEMS`) with its field's path and the reason.
    """
    problems = _shape_problems(data, file)
    if problems:
        raise ManifestError(problems)
    return _Reader(file, folder, defaults).tool(data)


# --- pass 1: the shape -----------------------------------------------------------------


def field_path(parts: Iterable[str | int]) -> str:
    """``capabilities.filesystem[1].access`` for ``("capabilities", "filesystem", 1,
    "access")``."""
    out = ""
    for part in parts:
        out += f"[{part}]" if isinstance(part, int) else (f".{part}" if out else str(part))
    return out


def _cut(text: str) -> str:
    return text if len(text) <= MAX_REASON_CHARS else text[: MAX_REASON_CHARS - 1] + "…"


def _shape_problems(data: Any, file: str) -> list[Problem]:
    if not isinstance(data, dict):
        kind = "nothing (an empty file)" if data is None else type(data).__name__
        return [Problem(file, "", f"a manifest is a mapping of fields, not {kind}")]
    problems: list[Problem] = []
    # jsonschema finds errors lazily: a list of 60,000 bad items stops here, not after
    # every item was checked.
    for error in itertools.islice(_manifest_validator().iter_errors(data), MAX_PROBLEMS):
        problems.extend(_explained(error, file))
    problems.sort(key=lambda p: p.field)
    return problems[:MAX_PROBLEMS]


def _explained(error: jsonschema.exceptions.ValidationError, file: str) -> Iterator[Problem]:
    """``error`` as problems: missing and unknown keys one per key, in our words (the
    library's would name the parent object and quote it whole)."""
    where = list(error.absolute_path)
    schema = error.schema if isinstance(error.schema, dict) else {}
    rule: Any = error.validator_value
    if error.validator == "required" and isinstance(error.instance, dict):
        for key in rule:
            if key not in error.instance:
                yield Problem(file, field_path([*where, key]), "required, and missing")
        return
    if error.validator == "additionalProperties" and isinstance(error.instance, dict):
        allowed = list(schema.get("properties", {}))
        for key in error.instance:
            if key in allowed:
                continue
            close = difflib.get_close_matches(str(key), allowed, n=1)
            hint = f" (did you mean {close[0]!r}?)" if close else ""
            yield Problem(
                file,
                field_path([*where, str(key)]),
                f"unknown field{hint}; allowed here: {', '.join(allowed)}",
            )
        return
    if error.validator == "pattern" and isinstance(error.instance, str):
        words = _PATTERN_WORDS.get(rule, "not of the allowed form")
        shown = _quoted_short(repr(error.instance), error.instance)
        yield Problem(file, field_path(where), _cut(f"{shown} is {words}"))
        return
    yield Problem(file, field_path(where), _cut(_quoted_short(error.message, error.instance)))


def _quoted_short(message: str, instance: Any) -> str:
    """jsonschema's ``message`` with its quote of the value cut, so the reason after it
    stays readable (``'xxxx…' is too long``)."""
    quoted = repr(instance)
    if len(quoted) <= MAX_QUOTED_CHARS:
        return message
    return message.replace(quoted, quoted[: MAX_QUOTED_CHARS - 1] + "…", 1)


_PATTERN_WORDS: Final = {
    _ENV_NAME: "not an environment variable name (letters, digits and '_', not first a digit)",
    _DOMAIN: "not a lowercase host name ('example.org') or subdomain wildcard ('*.example.org')",
    "^" + MODEL_ALIAS_RE.pattern + "$": (
        f"not a model alias (letters, digits, '.', '_', '-': {MODEL_ALIAS_RE.pattern})"
    ),
}


# --- pass 2: what a schema cannot say ---------------------------------------------------


class _Reader:
    """Pass 2 over a document of the right shape: collects every problem, then makes
    the tool or raises them all."""

    def __init__(self, file: str, folder: str, defaults: ManifestDefaults) -> None:
        self.file = file
        self.folder = folder
        self.defaults = defaults
        self.problems: list[Problem] = []

    def refuse(self, where: Sequence[str | int], reason: str) -> None:
        self.problems.append(Problem(self.file, field_path(where), reason))

    def tool(self, data: dict[str, Any]) -> FolderTool:
        name = self._name(data["name"])
        if not data["version"].isprintable():
            self.refuse(["version"], "holds a control character")
        summary = " ".join(data["description"].split())
        if not summary:
            self.refuse(["description"], "is blank; say in a sentence what the tool does")
        elif not summary.isprintable():
            self.refuse(["description"], "holds a control character")
        runner = RunnerKind(data.get("runtime", self.defaults.runner))
        entry = self._entry(data["entry"], runner)
        self._input_schema(data["input_schema"])
        caps = data.get("capabilities", {})
        files = self._files(caps.get("filesystem", []))
        network = self._names(caps, "network", "domain")
        if network and runner is RunnerKind.WASM:
            self.refuse(
                ["capabilities", "network"],
                "a wasm tool has no sockets (WASI preview 1), so it cannot use the network; "
                "declare none, or make it a process tool",
            )
        models = self._names(caps, "model_access", "alias")
        env = self._env(self._names(caps, "env", "name"))
        limits = self._limits(data.get("limits", {}), runner)
        if self.problems:
            raise ManifestError(self.problems[:MAX_PROBLEMS])
        capabilities = Capabilities(
            files=tuple(FileCapability(path=f.path, mode=f.mode) for f in files),
            network=tuple(n.name for n in network),
            model_access=tuple(m.name for m in models),
            env=tuple(e.name for e in env),
            exec=runner is RunnerKind.PROCESS,
        )
        manifest = ToolManifest(
            name=name,
            version=data["version"],
            summary=summary,
            args_schema=data["input_schema"],
            runner=runner,
            capabilities=capabilities,
            limits=limits,
            side_effects=_side_effects(runner, files, network, models),
        )
        return FolderTool(
            manifest=manifest,
            folder=self.folder,
            manifest_path=str(PurePosixPath(self.folder) / PurePosixPath(self.file).name),
            entry=entry,
            files=files,
            network=network,
            models=models,
            env=env,
        )

    def _name(self, name: str) -> str:
        if not TOOL_NAME_RE.fullmatch(name):
            self.refuse(
                ["name"],
                f"{name[:MAX_ID_CHARS]!r} is not a tool name: dotted lowercase words such as "
                "'text.wordcount' (letters, digits and '_', each word starting with a letter)",
            )
        elif name.startswith(f"{MCP_PREFIX}.") or name.startswith(APP_TOOL_PREFIX):
            self.refuse(
                ["name"],
                f"{name!r} takes a name reserved for MCP servers' tools ('{MCP_PREFIX}.*') or "
                f"apps' tools ('{APP_TOOL_PREFIX}*'); choose another",
            )
        return name

    def _entry(self, entry: str | list[str], runner: RunnerKind) -> tuple[str, ...]:
        if runner is RunnerKind.WASM:
            if not isinstance(entry, str):
                self.refuse(
                    ["entry"],
                    "a wasm tool's entry is its module's path in the folder, as one string "
                    "('wordcount.wasm'), not a list",
                )
                return ()
            reason = _relative_path_problem(entry, "the module")
            if reason is not None:
                self.refuse(["entry"], reason + " (a path inside the tool's folder)")
                return ()
            return (str(PurePosixPath(self.folder) / entry),)
        if isinstance(entry, str):
            self.refuse(
                ["entry"],
                "a process tool's entry is its argv, a list such as "
                "['python3', '/tool/search.py'] (/tool is the folder, read-only), not a string",
            )
            return ()
        for index, item in enumerate(entry):
            if not item.isprintable():
                self.refuse(["entry", index], "holds a control character or NUL byte")
        program = PurePosixPath(entry[0])
        if "/" in entry[0] and not program.is_absolute():
            self.refuse(
                ["entry", 0],
                f"{entry[0]!r} is a relative path, which the sandbox would look up in the "
                "working directory (the workspace); name a program on the sandbox's PATH "
                "('python3') or by its absolute path ('/tool/run')",
            )
        elif program.is_relative_to(WORKSPACE_VISIBLE_ROOT) or ".." in program.parts:
            self.refuse(
                ["entry", 0],
                f"{entry[0]!r} runs a program from the workspace, which the run's agent "
                "writes; a tool's program is the operator's: in its folder (/tool) or the "
                "sandbox's image",
            )
        return tuple(entry)

    def _input_schema(self, schema: dict[str, Any]) -> None:
        if schema.get("type") != "object":
            self.refuse(
                ["input_schema", "type"],
                'the arguments are a JSON object, so the schema says "type": "object"',
            )
        import jsonschema.validators

        dialect = schema.get("$schema")
        if "$schema" in schema and (
            not isinstance(dialect, str)
            # (None as the default: typed as a validator class, returned as given.)
            or jsonschema.validators.validator_for(schema, default=cast(Any, None)) is None
        ):
            # jsonschema would take an unknown one for the latest draft, or fail on it.
            self.refuse(
                ["input_schema", "$schema"],
                f"{str(dialect)[:MAX_QUOTED_CHARS]!r} is no JSON Schema draft jsonschema "
                "knows; leave it out (Draft 2020-12) or name a published one",
            )
            return
        try:
            bounded_validator(schema)
        except SchemaRefused as exc:
            self.refuse(["input_schema"], _cut(str(exc)))

    def _files(self, entries: list[dict[str, Any]]) -> tuple[FileNeed, ...]:
        needs: list[FileNeed] = []
        seen: dict[str, int] = {}
        for index, entry in enumerate(entries):
            where: list[str | int] = ["capabilities", "filesystem", index, "path"]
            path = entry["path"]
            reason = _relative_path_problem(path, "a path", allow_dot=True)
            if reason is not None:
                self.refuse(where, reason + " (workspace-relative: 'src', or '.' for all of it)")
                continue
            parts = () if path == "." else tuple(path.split("/"))
            if parts and is_apps_name(parts[0]):
                self.refuse(
                    where,
                    f"{path!r} is in the workspace's apps folder, which no run or tool reaches "
                    "(an app is reached by calling its tool)",
                )
                continue
            if path in seen:
                self.refuse(where, f"{path!r} is declared twice (also filesystem[{seen[path]}])")
                continue
            seen[path] = index
            visible = str(WORKSPACE_VISIBLE_ROOT.joinpath(*parts))
            needs.append(
                FileNeed(
                    path=visible,
                    mode=_ACCESS[entry["access"]],
                    optional=entry.get("optional", False),
                )
            )
        return tuple(needs)

    def _names(self, caps: dict[str, Any], kind: str, key: str) -> tuple[NameNeed, ...]:
        needs: list[NameNeed] = []
        seen: dict[str, int] = {}
        for index, item in enumerate(caps.get(kind, [])):
            need = (
                NameNeed(name=item)
                if isinstance(item, str)
                else NameNeed(name=item[key], optional=item.get("optional", False))
            )
            if need.name in seen:
                self.refuse(
                    ["capabilities", kind, index],
                    f"{need.name!r} is declared twice (also {kind}[{seen[need.name]}])",
                )
                continue
            seen[need.name] = index
            needs.append(need)
        return tuple(needs)

    def _env(self, needs: tuple[NameNeed, ...]) -> tuple[NameNeed, ...]:
        kept = []
        for index, need in enumerate(needs):
            why = self.defaults.refused_env.get(need.name)
            if why is not None:
                self.refuse(["capabilities", "env", index], f"{need.name!r}: {why}")
            else:
                kept.append(need)
        return tuple(kept)

    def _limits(self, limits: dict[str, Any], runner: RunnerKind) -> ToolLimits:
        fuel = limits.get("fuel")
        if fuel is not None and runner is not RunnerKind.WASM:
            self.refuse(
                ["limits", "fuel"],
                f"fuel is a wasm instruction budget, and this is a {runner} tool; "
                "its limits are timeout and memory",
            )
            fuel = None
        return ToolLimits(
            timeout_s=float(limits.get("timeout", self.defaults.timeout_s)),
            memory_bytes=int(limits.get("memory", self.defaults.memory_mb)) * MIB,
            fuel=fuel,
        )


def _relative_path_problem(path: str, what: str, *, allow_dot: bool = False) -> str | None:
    """Why ``path`` is not a normalized relative path, or None. ``.`` alone is allowed
    when ``allow_dot`` (the whole workspace)."""
    if allow_dot and path == ".":
        return None
    if not path.isprintable():
        return f"{what} holds a control character or NUL byte"
    if path.startswith("/"):
        return f"{path!r} is absolute; {what} is relative"
    if path.startswith("~"):
        return f"{path!r} starts with '~', which is no home directory here; {what} is relative"
    parts = path.split("/")
    if ".." in parts:
        return f"{path!r} has a '..' component; {what} stays inside"
    if any(part in ("", ".") for part in parts):
        return f"{path!r} is not normalized (an empty or '.' component, or a trailing '/')"
    if len(path.encode("utf-8", "surrogatepass")) > MAX_PATH_BYTES:
        return f"{what} is longer than {MAX_PATH_BYTES} bytes"
    return None


def _side_effects(
    runner: RunnerKind,
    files: tuple[FileNeed, ...],
    network: tuple[NameNeed, ...],
    models: tuple[NameNeed, ...],
) -> bool:
    """Whether a call can change or reveal anything outside gatewayd before its answer
    (ToolManifest.side_effects). A wasm tool that may write no file, spends no model
    budget and has no network (no wasm tool has) only computes on what it reads: its
    call entry need not be durable before it runs. A process tool starts a process."""
    if runner is not RunnerKind.WASM:
        return True
    return bool(models or network or any(f.mode is PathMode.RW for f in files))
