"""Policy files: validation, and error messages that name the file and field."""

from __future__ import annotations

import textwrap
from pathlib import Path, PurePosixPath

import pytest

from gatewayd.policy import (
    Limits,
    Policy,
    PolicyError,
    load_policy_text,
)
from gatewayd.policy.model import (
    DEFAULT_CALL_TIMEOUT_S,
    DEFAULT_CALLS_PER_SECOND,
    DEFAULT_MAX_CONCURRENT_CALLS,
    DEFAULT_MAX_OUTPUT_BYTES,
    default_burst,
)

SOURCE = "policies/x.yaml"


def load(text: str) -> Policy:
    return load_policy_text(textwrap.dedent(text), SOURCE)


def problems(text: str) -> tuple[str, ...]:
    with pytest.raises(PolicyError) as info:
        load(text)
    assert info.value.source == SOURCE
    for line in str(info.value).splitlines():
        assert line.startswith(f"{SOURCE}: "), line
    return info.value.problems


FULL = """
version: 1
name: full
description: every field
tools:
  allow: [time.now, "fs.*"]
filesystem:
  paths:
    workspace: {root: ./, mode: rw, suffixes: [.md, .txt], max_file_bytes: 1000}
    reference: {root: ref/, mode: ro}
    docs: {root: /srv//docs/, mode: ro, mount: /data/docs}
limits:
  call_timeout_s: 10
  max_output_bytes: 2048
  calls_per_second: 5
  burst: 7
  max_concurrent_calls: 3
"""


# --- valid files ----------------------------------------------------------------------


def test_minimal_policy_gets_every_default_and_allows_nothing() -> None:
    policy = load("version: 1\nname: tiny\n")
    assert policy.tools.allow == ()
    assert policy.filesystem.paths == {}
    assert policy.description == ""
    assert policy.limits == Limits(
        call_timeout_s=DEFAULT_CALL_TIMEOUT_S,
        max_output_bytes=DEFAULT_MAX_OUTPUT_BYTES,
        calls_per_second=DEFAULT_CALLS_PER_SECOND,
        burst=default_burst(DEFAULT_CALLS_PER_SECOND),
        max_concurrent_calls=DEFAULT_MAX_CONCURRENT_CALLS,
    )
    assert policy.limits.burst == 100
    # The strict side of every sandbox setting: required, nothing passed, default limits.
    assert policy.require_os_sandbox is True
    assert policy.env.allow == ()
    assert policy.sandbox.timeout_s == 600 and policy.sandbox.max_processes == 256


def test_full_policy_keeps_every_field_and_normalizes_roots() -> None:
    policy = load(FULL)
    assert policy.tools.allow == ("time.now", "fs.*")
    ws, ref, docs = (policy.filesystem.paths[n] for n in ("workspace", "reference", "docs"))
    assert (ws.root, ws.mode, ws.suffixes, ws.max_file_bytes) == (".", "rw", (".md", ".txt"), 1000)
    assert ws.visible_root == PurePosixPath("/workspace")
    assert ref.root == "ref"
    assert ref.visible_root == PurePosixPath("/workspace/ref")
    assert docs.root == "/srv/docs"
    assert docs.visible_root == PurePosixPath("/data/docs")
    assert policy.limits == Limits(
        call_timeout_s=10,
        max_output_bytes=2048,
        calls_per_second=5,
        burst=7,
        max_concurrent_calls=3,
    )


def test_absolute_root_without_mount_is_seen_at_the_same_path() -> None:
    policy = load("""
        version: 1
        name: p
        filesystem: {paths: {docs: {root: /srv/docs, mode: ro}}}
    """)
    assert policy.filesystem.paths["docs"].visible_root == PurePosixPath("/srv/docs")


@pytest.mark.parametrize(("rate", "burst"), [(5, 10), (0.2, 1), (0.7, 2), (50, 100), (1.5, 3)])
def test_default_burst_is_two_seconds_of_the_policys_own_rate(rate: float, burst: int) -> None:
    policy = load(f"version: 1\nname: p\nlimits: {{calls_per_second: {rate}}}\n")
    assert policy.limits.burst == burst


def test_keys_left_empty_take_their_defaults() -> None:
    policy = load("""
        version: 1
        name: p
        tools:
          allow:
        filesystem:
        limits:
          calls_per_second: 4
          burst:
          max_concurrent_calls:
    """)
    assert policy.tools.allow == ()
    assert policy.filesystem.paths == {}
    assert policy.limits.burst == 8
    assert policy.limits.max_concurrent_calls == DEFAULT_MAX_CONCURRENT_CALLS


def test_policy_models_are_frozen() -> None:
    policy = load(FULL)
    with pytest.raises(ValueError, match="frozen"):
        policy.name = "other"


# --- invalid fields: each names the file, the dotted field and what was wrong ------------


def test_bad_mode_names_file_field_allowed_values_and_input() -> None:
    text = """
        version: 1
        name: p
        filesystem: {paths: {workspace: {root: ., mode: rwx}}}
    """
    with pytest.raises(PolicyError) as info:
        load(text)
    assert str(info.value) == (
        "policies/x.yaml: filesystem.paths.workspace.mode: Input should be 'ro' or 'rw' (got 'rwx')"
    )


def test_unknown_field_is_refused_with_the_allowed_fields_and_a_close_match() -> None:
    (problem,) = problems("""
        version: 1
        name: p
        filesystem: {paths: {workspace: {root: ., mode: rw, suffix: [.md]}}}
    """)
    assert problem.startswith("filesystem.paths.workspace.suffix: unknown field")
    assert "allowed fields: root, mode, suffixes, max_file_bytes, mount" in problem
    assert "did you mean 'suffixes'?" in problem


@pytest.mark.parametrize(
    ("text", "field", "allowed"),
    [
        ("version: 1\nname: p\ntool: {}\n", "tool", "tools"),
        ("version: 1\nname: p\ntools: {alow: []}\n", "tools.alow", "allow"),
        (
            "version: 1\nname: p\nlimits: {colls_per_second: 1}\n",
            "limits.colls_per_second",
            "calls_per_second",
        ),
        ("version: 1\nname: p\nfilesystem: {path: {}}\n", "filesystem.path", "paths"),
    ],
)
def test_typo_in_any_section_is_caught(text: str, field: str, allowed: str) -> None:
    (problem,) = problems(text)
    assert problem.startswith(f"{field}: unknown field; allowed fields: ")
    assert f"did you mean {allowed!r}?" in problem


def test_every_bad_field_is_reported_at_once() -> None:
    found = problems("""
        version: 1
        name: p
        limits: {call_timeout_s: 0, max_output_bytes: 5, burst: 0, max_concurrent_calls: 0}
    """)
    assert [p.split(":")[0] for p in found] == [
        "limits.call_timeout_s",
        "limits.max_output_bytes",
        "limits.burst",
        "limits.max_concurrent_calls",
    ]
    assert "greater than 0 (got 0)" in found[0]
    assert "greater than or equal to 1024 (got 5)" in found[1]


@pytest.mark.parametrize(
    ("body", "field", "says"),
    [
        (
            "version: 2\nname: p",
            "version",
            "unsupported policy version 2; this gateway reads version 1",
        ),
        ("version: '1'\nname: p", "version", "valid integer (got '1')"),
        ("version: true\nname: p", "version", "valid integer (got True)"),
        ("version: 1", "name", "required field is missing"),
        ("version: 1\nname: 'has space'", "name", "name 'has space' must be 1-64 letters"),
        ("version: 1\nname: 7", "name", "valid string (got 7)"),
        ("version: 1\nname: p\ndescription: [a]", "description", "valid string"),
        ("version: 1\nname: p\ntools: [fs.read]", "tools", "valid dictionary"),
        (
            "version: 1\nname: p\ntools: {allow: fs.read}",
            "tools.allow",
            "valid tuple (got 'fs.read')",
        ),
        (
            "version: 1\nname: p\ntools: {allow: ['*']}",
            "tools.allow.0",
            "'*' is neither an exact tool name",
        ),
        (
            "version: 1\nname: p\ntools: {allow: [FS.read]}",
            "tools.allow.0",
            "family wildcard such as 'fs.*'",
        ),
        ("version: 1\nname: p\ntools: {allow: ['fs.*.read']}", "tools.allow.0", "is neither"),
        ("version: 1\nname: p\ntools: {allow: ['fs*']}", "tools.allow.0", "is neither"),
        (
            "version: 1\nname: p\nlimits: {call_timeout_s: 3601}",
            "limits.call_timeout_s",
            "less than or equal to 3600",
        ),
        (
            "version: 1\nname: p\nlimits: {call_timeout_s: .inf}",
            "limits.call_timeout_s",
            "finite number",
        ),
        (
            "version: 1\nname: p\nlimits: {call_timeout_s: '10'}",
            "limits.call_timeout_s",
            "valid number (got '10')",
        ),
        (
            "version: 1\nname: p\nlimits: {max_output_bytes: 16777217}",
            "limits.max_output_bytes",
            "less than or equal to 16777216",
        ),
        (
            "version: 1\nname: p\nlimits: {calls_per_second: 0}",
            "limits.calls_per_second",
            "greater than 0",
        ),
        (
            "version: 1\nname: p\nlimits: {calls_per_second: .nan}",
            "limits.calls_per_second",
            "finite number",
        ),
        ("version: 1\nname: p\nlimits: {burst: 2.5}", "limits.burst", "valid integer (got 2.5)"),
        (
            "version: 1\nname: p\nlimits: {max_concurrent_calls: yes}",
            "limits.max_concurrent_calls",
            "valid integer (got True)",
        ),
        (
            "version: 1\nname: p\nlimits: {max_concurrent_calls: 1025}",
            "limits.max_concurrent_calls",
            "less than or equal to 1024",
        ),
        ("version: 1\nname: p\nrequire_os_sandbox: 'no'", "require_os_sandbox", "valid boolean"),
        ("version: 1\nname: p\nrequire_os_sandbox: 0", "require_os_sandbox", "valid boolean"),
        ("version: 1\nname: p\nenv: {allow: [1BAD]}", "env.allow.0", "not an environment"),
        ("version: 1\nname: p\nenv: {allow: ['A=B']}", "env.allow.0", "not an environment"),
        ("version: 1\nname: p\nenv: {allow: [HOME]}", "env.allow.0", "reserved: PATH, HOME"),
        (
            "version: 1\nname: p\nenv: {allow: [COGNI_RUN_ID]}",
            "env.allow.0",
            "set by gatewayd in every sandbox",
        ),
        ("version: 1\nname: p\nenv: {pass: [X]}", "env.pass", "allowed fields: allow"),
        ("version: 1\nname: p\nsandbox: {timeout_s: 0}", "sandbox.timeout_s", "greater than 0"),
        (
            "version: 1\nname: p\nsandbox: {timeout_s: 86401}",
            "sandbox.timeout_s",
            "less than or equal to 86400",
        ),
        (
            "version: 1\nname: p\nsandbox: {max_processes: 3}",
            "sandbox.max_processes",
            "greater than or equal to 4",
        ),
        (
            "version: 1\nname: p\nsandbox: {max_open_files: 8}",
            "sandbox.max_open_files",
            "greater than or equal to 16",
        ),
        ("version: 1\nname: p\nsandbox: {cpu_s: 1.5}", "sandbox.cpu_s", "valid integer"),
        ("version: 1\nname: p\nsandbox: {memory_mb: 5}", "sandbox.memory_mb", "unknown field"),
    ],
)
def test_invalid_top_level_and_limit_fields_name_the_field(
    body: str, field: str, says: str
) -> None:
    found = problems(body + "\n")
    matching = [p for p in found if p.startswith(f"{field}: ")]
    assert matching, found
    assert says in matching[0]


def rule(body: str) -> str:
    return f"version: 1\nname: p\nfilesystem:\n  paths:\n    ws: {body}\n"


@pytest.mark.parametrize(
    ("body", "field", "says"),
    [
        ("{mode: rw}", "filesystem.paths.ws.root", "required field is missing"),
        ("{root: .}", "filesystem.paths.ws.mode", "required field is missing"),
        ("{root: '', mode: rw}", "filesystem.paths.ws.root", "root '' must be a non-empty path"),
        (
            "{root: ../up, mode: rw}",
            "filesystem.paths.ws.root",
            "root '../up' must be a non-empty path without '..' or NUL",
        ),
        ("{root: a/../../b, mode: rw}", "filesystem.paths.ws.root", "without '..'"),
        ("{root: /srv/../etc, mode: ro}", "filesystem.paths.ws.root", "without '..'"),
        ('{root: "a\\0b", mode: ro}', "filesystem.paths.ws.root", "without '..' or NUL"),
        ("{root: 5, mode: rw}", "filesystem.paths.ws.root", "valid string (got 5)"),
        (
            "{root: ., mode: RW}",
            "filesystem.paths.ws.mode",
            "Input should be 'ro' or 'rw' (got 'RW')",
        ),
        (
            "{root: ., mode: rw, suffixes: [md]}",
            "filesystem.paths.ws.suffixes.0",
            "suffix 'md' must be '.' followed",
        ),
        (
            "{root: ., mode: rw, suffixes: ['.']}",
            "filesystem.paths.ws.suffixes.0",
            "suffix '.' must be",
        ),
        (
            "{root: ., mode: rw, suffixes: ['.a/b']}",
            "filesystem.paths.ws.suffixes.0",
            "must be '.' followed",
        ),
        ("{root: ., mode: rw, suffixes: .md}", "filesystem.paths.ws.suffixes", "valid tuple"),
        (
            "{root: ., mode: rw, max_file_bytes: 0}",
            "filesystem.paths.ws.max_file_bytes",
            "greater than or equal to 1",
        ),
        (
            "{root: ., mode: rw, max_file_bytes: -5}",
            "filesystem.paths.ws.max_file_bytes",
            "(got -5)",
        ),
        (
            "{root: ., mode: rw, max_file_bytes: 1.5}",
            "filesystem.paths.ws.max_file_bytes",
            "valid integer",
        ),
        (
            "{root: ., mode: rw, mount: /data}",
            "filesystem.paths.ws",
            "mount is only for absolute roots",
        ),
        (
            "{root: /srv/d, mode: ro, mount: data}",
            "filesystem.paths.ws.mount",
            "mount 'data' must be an absolute path",
        ),
        (
            "{root: /srv/d, mode: ro, mount: /data/../etc}",
            "filesystem.paths.ws.mount",
            "without '..'",
        ),
    ],
)
def test_invalid_path_rule_fields_name_the_field(body: str, field: str, says: str) -> None:
    found = problems(rule(body))
    matching = [p for p in found if p.startswith(f"{field}: ")]
    assert matching, found
    assert says in matching[0]


@pytest.mark.parametrize(
    ("body", "reserved"),
    [
        ("{root: /srv/d, mode: ro, mount: /workspace/d}", "/workspace"),
        ("{root: /srv/d, mode: ro, mount: /workspace}", "/workspace"),
        ("{root: /srv/d, mode: ro, mount: /proc/x}", "/proc"),
        ("{root: /srv/d, mode: ro, mount: /dev}", "/dev"),
        ("{root: /srv/d, mode: ro, mount: /run/cogni/x}", "/run/cogni"),
        ("{root: /srv/d, mode: ro, mount: /run}", "/run/cogni"),
        ("{root: /srv/d, mode: ro, mount: /tmp/x}", "/tmp"),
        ("{root: /srv/d, mode: ro, mount: /}", "/workspace"),
        ("{root: /tmp/d, mode: rw}", "/tmp"),
        ("{root: /, mode: ro}", "/workspace"),
        ("{root: /proc, mode: ro, mount: /data/proc}", None),
    ],
)
def test_visible_roots_may_not_overlap_the_sandboxes_reserved_paths(
    body: str, reserved: str | None
) -> None:
    text = rule(body)
    if reserved is None:  # the host side may be anywhere; only the sandbox view is reserved
        assert load(text).filesystem.paths["ws"].visible_root == PurePosixPath("/data/proc")
        return
    (problem,) = problems(text)
    assert problem.startswith("filesystem.paths.ws: ")
    assert f"would overlap {reserved};" in problem
    assert "reserved in the sandbox: /workspace, /proc, /dev, /sys, /run/cogni, /tmp" in problem


def test_bad_path_rule_name_is_reported_at_the_name() -> None:
    (problem,) = problems(rule("{root: ., mode: rw}").replace("ws:", "'bad name!':"))
    assert problem.startswith("filesystem.paths.bad name!: path rule name 'bad name!' must be")


def test_two_rules_seen_at_the_same_path_are_refused() -> None:
    (problem,) = problems("""
        version: 1
        name: p
        filesystem:
          paths:
            a: {root: docs, mode: ro}
            b: {root: ./docs/, mode: rw}
    """)
    assert problem == (
        "filesystem: paths 'a' and 'b' both appear at /workspace/docs; give one of them a "
        "different root or mount"
    )


def test_long_bad_values_are_cut_in_messages() -> None:
    (problem,) = problems(f"version: 1\nname: p\ndescription: {['x' * 500]}\n")
    assert len(problem) < 200
    assert problem.endswith("...)")


# --- YAML-level errors ----------------------------------------------------------------


@pytest.mark.parametrize("text", ["", "\n\n", "# only a comment\n", "---\n"])
def test_empty_file_is_a_clear_error(text: str) -> None:
    with pytest.raises(PolicyError, match=r"^policies/x\.yaml: the file is empty; a policy needs"):
        load_policy_text(text, SOURCE)


@pytest.mark.parametrize(
    ("text", "kind"), [("- a\n- b\n", "list"), ("just words\n", "string"), ("42\n", "int")]
)
def test_non_mapping_top_level_is_a_clear_error(text: str, kind: str) -> None:
    with pytest.raises(PolicyError) as info:
        load_policy_text(text, SOURCE)
    assert str(info.value) == (
        f"policies/x.yaml: the top level must be a mapping of keys (version, name, tools, "
        f"...), not a {kind}"
    )


def test_yaml_syntax_error_names_file_and_line() -> None:
    text = "version: 1\nname: p\ntools:\n  allow: [fs.read,\n"
    with pytest.raises(PolicyError) as info:
        load_policy_text(text, SOURCE)
    assert str(info.value).startswith("policies/x.yaml: line 5, column 1: YAML syntax: ")


def test_bad_indentation_names_its_line() -> None:
    text = "version: 1\nname: p\nlimits:\n  burst: 3\n bad: 1\n"
    with pytest.raises(PolicyError, match=r"^policies/x\.yaml: line 5, column 2: YAML syntax"):
        load_policy_text(text, SOURCE)


def test_duplicate_key_is_refused_instead_of_silently_overriding() -> None:
    text = (
        "version: 1\nname: p\nfilesystem:\n  paths:\n    ws:\n"
        "      root: .\n      mode: ro\n      mode: rw\n"
    )
    with pytest.raises(PolicyError) as info:
        load_policy_text(text, SOURCE)
    assert str(info.value) == (
        "policies/x.yaml: line 8, column 7: YAML syntax: found a key twice in one mapping"
    )


def test_python_object_tags_are_refused_by_the_safe_loader(tmp_path: Path) -> None:
    marker = tmp_path / "ran"
    text = f"version: 1\nname: !!python/object/apply:os.system ['touch {marker}']\n"
    with pytest.raises(PolicyError, match="YAML syntax"):
        load_policy_text(text, SOURCE)
    assert not marker.exists()


# --- network: ports and the egress proxy ------------------------------------------------


def test_network_defaults_to_web_ports_and_no_proxy() -> None:
    network = load("version: 1\nname: p\n").network
    assert network.ports == (80, 443)
    assert network.proxy.enabled is False and network.proxy_enabled is False
    assert network.proxy.max_connections == 32
    assert network.proxy.idle_timeout_s == 60
    assert network.proxy.connections_per_second == 20 and network.proxy.connection_burst == 64
    assert network.proxy.max_connection_bytes == 1 << 30


def test_the_proxy_is_enabled_only_with_a_domain_to_reach() -> None:
    without = load("version: 1\nname: p\nnetwork: {proxy: {enabled: true}}\n").network
    assert without.proxy.enabled is True and without.proxy_enabled is False
    with_domain = load("""
        version: 1
        name: p
        network:
          allow_domains: [pypi.org]
          ports: [443, 8443]
          proxy: {enabled: true, max_connections: 4, idle_timeout_s: 2.5,
                  max_connection_bytes: 1000}
    """).network
    assert with_domain.proxy_enabled is True and with_domain.ports == (443, 8443)
    assert with_domain.proxy.max_connections == 4 and with_domain.proxy.idle_timeout_s == 2.5


@pytest.mark.parametrize(
    ("network", "where"),
    [
        ("{ports: [0]}", "network.ports.0"),
        ("{ports: [65536]}", "network.ports.0"),
        ("{ports: ['443']}", "network.ports.0"),
        ("{proxy: {max_connections: 0}}", "network.proxy.max_connections"),
        ("{proxy: {max_connections: 1025}}", "network.proxy.max_connections"),
        ("{proxy: {idle_timeout_s: 0}}", "network.proxy.idle_timeout_s"),
        ("{proxy: {connections_per_second: 0}}", "network.proxy.connections_per_second"),
        ("{proxy: {connections_per_second: .inf}}", "network.proxy.connections_per_second"),
        ("{proxy: {connection_burst: 0}}", "network.proxy.connection_burst"),
        ("{proxy: {max_connection_bytes: 0}}", "network.proxy.max_connection_bytes"),
        ("{proxy: {enabled: 'yes'}}", "network.proxy.enabled"),
    ],
)
def test_bad_ports_and_proxy_limits_are_refused_naming_the_field(network: str, where: str) -> None:
    (problem,) = problems(f"version: 1\nname: p\nnetwork: {network}\n")
    assert problem.startswith(f"{where}: "), problem


def test_an_unknown_proxy_key_lists_the_allowed_ones() -> None:
    (problem,) = problems("version: 1\nname: p\nnetwork: {proxy: {max_conections: 3}}\n")
    assert problem.startswith("network.proxy.max_conections: unknown field; allowed fields: ")
    assert "did you mean 'max_connections'?" in problem
