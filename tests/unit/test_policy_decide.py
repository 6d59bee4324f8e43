"""Pure decisions: tool allowlists and lexical path resolution against grants."""

from __future__ import annotations

import posixpath
from pathlib import Path, PurePosixPath

import pytest
from hypothesis import given
from hypothesis import strategies as st

from gatewayd.errors import GatewayError, InvalidArguments, PolicyViolation
from gatewayd.hostpaths.binding import bind_paths
from gatewayd.policy import (
    Allow,
    Deny,
    PathAccess,
    PathGrant,
    PathMode,
    ResolvedPath,
    RunRules,
    allowed_tools,
    check_path,
    check_read_size,
    decide,
    load_policy_text,
    resolve_path,
    tool_allowed,
    tool_matches,
    unmatched_patterns,
)
from gatewayd.policy.paths import MAX_PATH_BYTES
from gatewayd.protocol import ErrorCode

WS = PathGrant(
    name="workspace",
    host_root=Path("/host/ws"),
    root_id=(1, 10),
    holds_nested=True,  # ref
    visible_root=PurePosixPath("/workspace"),
    mode=PathMode.RW,
    suffixes=(".md", ".txt", ".json"),
    max_file_bytes=100,
)
REF = PathGrant(
    name="ref",
    host_root=Path("/host/ws/ref"),
    root_id=(1, 11),
    holds_nested=False,
    visible_root=PurePosixPath("/workspace/ref"),
    mode=PathMode.RO,
)
DOCS = PathGrant(
    name="docs",
    host_root=Path("/srv/docs"),
    root_id=(2, 12),
    holds_nested=False,
    visible_root=PurePosixPath("/data/docs"),
    mode=PathMode.RO,
)
GRANTS = (WS, REF, DOCS)
RULES = RunRules(tool_patterns=("fs.*", "time.now"), run_tool_ids=None, grants=GRANTS)
NO_RULES = RunRules(tool_patterns=(), run_tool_ids=None, grants=())

OUTSIDE_READ = (
    "path is outside the readable paths.\nReadable paths: /workspace, /workspace/ref, /data/docs"
)
OUTSIDE_WRITE = (
    "path is outside the writable paths.\nWritable paths: /workspace (except /workspace/ref)"
)
READ_ONLY = "path is read-only.\nWritable paths: /workspace (except /workspace/ref)"
SUFFIX = "suffix not allowed.\nAllowed suffixes: .md, .txt, .json"


# --- the table ------------------------------------------------------------------------

# (path, access, metadata_only, size) -> ("allow", grant name, parts) | ("deny", code, exact message)
TABLE: list[tuple[str, str, bool, int | None, tuple[object, ...]]] = [
    # relative paths start at /workspace
    ("notes.md", "read", False, None, ("allow", "workspace", ("notes.md",))),
    ("./notes.md", "read", False, None, ("allow", "workspace", ("notes.md",))),
    ("a/b/c.txt", "write", False, 5, ("allow", "workspace", ("a", "b", "c.txt"))),
    (".", "read", True, None, ("allow", "workspace", ())),
    ("a/../b.md", "read", False, None, ("allow", "workspace", ("b.md",))),
    # absolute paths, and the normalizations that keep them inside
    ("/workspace/notes.md", "read", False, None, ("allow", "workspace", ("notes.md",))),
    ("/workspace", "read", True, None, ("allow", "workspace", ())),
    ("/workspace/", "read", True, None, ("allow", "workspace", ())),
    ("//workspace//x.md", "read", False, None, ("allow", "workspace", ("x.md",))),
    ("/workspace/./x.md", "read", False, None, ("allow", "workspace", ("x.md",))),
    ("/workspace/d/x.md/", "read", False, None, ("allow", "workspace", ("d", "x.md"))),
    ("/../workspace/x.md", "read", False, None, ("allow", "workspace", ("x.md",))),
    ("/workspace/a/../../workspace/x.md", "read", False, None, ("allow", "workspace", ("x.md",))),
    ("/data/docs/guide.pdf", "read", False, None, ("allow", "docs", ("guide.pdf",))),
    ("/data/docs", "read", True, None, ("allow", "docs", ())),
    # the nested read-only grant wins inside its subtree
    ("ref/spec.md", "read", False, None, ("allow", "ref", ("spec.md",))),
    ("ref/any.bin", "read", False, None, ("allow", "ref", ("any.bin",))),
    ("/workspace/ref", "read", True, None, ("allow", "ref", ())),
    (
        "ref/spec.md",
        "write",
        False,
        1,
        ("deny", ErrorCode.POLICY_DENIED, f"Cannot write to 'ref/spec.md': {READ_ONLY}"),
    ),
    ("ref/../ok.md", "write", False, 1, ("allow", "workspace", ("ok.md",))),
    ("reference/x.md", "write", False, 1, ("allow", "workspace", ("reference", "x.md"))),
    # literal names: nothing here is special on Linux, so nothing is special here
    (
        "%2e%2e/%2e%2e/etc.md",
        "read",
        False,
        None,
        ("allow", "workspace", ("%2e%2e", "%2e%2e", "etc.md")),
    ),
    ("..\\..\\etc.md", "read", False, None, ("allow", "workspace", ("..\\..\\etc.md",))),
    ("\u2025/x.md", "read", False, None, ("allow", "workspace", ("\u2025", "x.md"))),
    ("\uff0e\uff0e/x.md", "read", False, None, ("allow", "workspace", ("\uff0e\uff0e", "x.md"))),
    ("... /x.md", "read", False, None, ("allow", "workspace", ("... ", "x.md"))),
    ("~/x.md", "read", False, None, ("allow", "workspace", ("~", "x.md"))),
    ("$HOME/x.md", "read", False, None, ("allow", "workspace", ("$HOME", "x.md"))),
    # traversal out of every grant
    (
        "/etc/passwd",
        "read",
        False,
        None,
        ("deny", ErrorCode.POLICY_DENIED, f"Cannot read '/etc/passwd': {OUTSIDE_READ}"),
    ),
    (
        "../etc/passwd",
        "read",
        False,
        None,
        ("deny", ErrorCode.POLICY_DENIED, f"Cannot read '../etc/passwd': {OUTSIDE_READ}"),
    ),
    (
        "../../..",
        "read",
        True,
        None,
        ("deny", ErrorCode.POLICY_DENIED, f"Cannot read '../../..': {OUTSIDE_READ}"),
    ),
    (
        "..",
        "read",
        True,
        None,
        ("deny", ErrorCode.POLICY_DENIED, f"Cannot read '..': {OUTSIDE_READ}"),
    ),
    (
        "/",
        "read",
        True,
        None,
        ("deny", ErrorCode.POLICY_DENIED, f"Cannot read '/': {OUTSIDE_READ}"),
    ),
    (
        "//etc/passwd",
        "read",
        False,
        None,
        ("deny", ErrorCode.POLICY_DENIED, f"Cannot read '//etc/passwd': {OUTSIDE_READ}"),
    ),
    (
        "/workspace/../etc/x.md",
        "read",
        False,
        None,
        ("deny", ErrorCode.POLICY_DENIED, f"Cannot read '/workspace/../etc/x.md': {OUTSIDE_READ}"),
    ),
    (
        "/workspace2/x.md",
        "read",
        False,
        None,
        ("deny", ErrorCode.POLICY_DENIED, f"Cannot read '/workspace2/x.md': {OUTSIDE_READ}"),
    ),
    (
        "/data/docsx/a",
        "read",
        False,
        None,
        ("deny", ErrorCode.POLICY_DENIED, f"Cannot read '/data/docsx/a': {OUTSIDE_READ}"),
    ),
    (
        "/data",
        "read",
        True,
        None,
        ("deny", ErrorCode.POLICY_DENIED, f"Cannot read '/data': {OUTSIDE_READ}"),
    ),
    (
        "/proc/self/root/etc",
        "read",
        True,
        None,
        ("deny", ErrorCode.POLICY_DENIED, f"Cannot read '/proc/self/root/etc': {OUTSIDE_READ}"),
    ),
    (
        "/etc/x.md",
        "write",
        False,
        1,
        ("deny", ErrorCode.POLICY_DENIED, f"Cannot write to '/etc/x.md': {OUTSIDE_WRITE}"),
    ),
    # read-only grants
    (
        "/data/docs/x.md",
        "write",
        False,
        1,
        ("deny", ErrorCode.POLICY_DENIED, f"Cannot write to '/data/docs/x.md': {READ_ONLY}"),
    ),
    # suffixes: files only, case-sensitive, and a suffix needs a stem
    (
        "notes.py",
        "read",
        False,
        None,
        ("deny", ErrorCode.POLICY_DENIED, f"Cannot access 'notes.py': {SUFFIX}"),
    ),
    (
        "notes.MD",
        "read",
        False,
        None,
        ("deny", ErrorCode.POLICY_DENIED, f"Cannot access 'notes.MD': {SUFFIX}"),
    ),
    (
        ".md",
        "read",
        False,
        None,
        ("deny", ErrorCode.POLICY_DENIED, f"Cannot access '.md': {SUFFIX}"),
    ),
    (
        "notes",
        "write",
        False,
        1,
        ("deny", ErrorCode.POLICY_DENIED, f"Cannot access 'notes': {SUFFIX}"),
    ),
    ("dir.d", "read", True, None, ("allow", "workspace", ("dir.d",))),
    ("archive.tar.json", "read", False, None, ("allow", "workspace", ("archive.tar.json",))),
    (
        "/workspace",
        "read",
        False,
        None,
        ("deny", ErrorCode.POLICY_DENIED, f"Cannot access '/workspace': {SUFFIX}"),
    ),
    # write sizes (reads are sized by the fs tool after a stat)
    ("big.md", "write", False, 100, ("allow", "workspace", ("big.md",))),
    (
        "big.md",
        "write",
        False,
        101,
        (
            "deny",
            ErrorCode.POLICY_DENIED,
            "Cannot write 'big.md': 101 bytes is over the limit.\nMaximum allowed: 100 bytes",
        ),
    ),
    ("big.md", "read", False, 10**9, ("allow", "workspace", ("big.md",))),
    ("big.md", "write", False, None, ("allow", "workspace", ("big.md",))),
    ("/data/docs/huge", "read", False, 10**12, ("allow", "docs", ("huge",))),
    # malformed paths are the caller's mistake
    (
        "",
        "read",
        False,
        None,
        ("deny", ErrorCode.INVALID_ARGS, "path is empty; name a file or directory"),
    ),
    (
        "a\x00b.md",
        "read",
        False,
        None,
        (
            "deny",
            ErrorCode.INVALID_ARGS,
            "path 'a\\x00b.md' contains a NUL byte, which no file name can hold",
        ),
    ),
    (
        "/workspace/x.md\x00",
        "write",
        False,
        1,
        (
            "deny",
            ErrorCode.INVALID_ARGS,
            "path '/workspace/x.md\\x00' contains a NUL byte, which no file name can hold",
        ),
    ),
    (
        "a/" * 2049,
        "read",
        True,
        None,
        ("deny", ErrorCode.INVALID_ARGS, "path is 4098 bytes long; at most 4096 bytes are allowed"),
    ),
]


@pytest.mark.parametrize(("path", "access", "metadata_only", "size", "expected"), TABLE)
def test_path_decisions_follow_the_table(
    path: str, access: str, metadata_only: bool, size: int | None, expected: tuple[object, ...]
) -> None:
    request = PathAccess(path=path, access=access, metadata_only=metadata_only, size=size)  # type: ignore[arg-type]
    decision = decide("fs.read", (request,), RULES)
    if expected[0] == "allow":
        assert isinstance(decision, Allow), decision
        (resolved,) = decision.resolved
        assert resolved.grant.name == expected[1]
        assert resolved.parts == expected[2]
        assert resolved.access == access
        assert resolved.visible == str(resolved.grant.visible_root.joinpath(*resolved.parts))
    else:
        assert decision == Deny(code=expected[1], message=expected[2])  # type: ignore[arg-type]


def test_a_path_that_is_exactly_the_limit_is_not_refused_for_length() -> None:
    path = "/workspace/" + "a" * (MAX_PATH_BYTES - len("/workspace/") - 3) + ".md"
    assert len(path.encode()) == MAX_PATH_BYTES
    assert isinstance(resolve_path(path, "read", GRANTS), ResolvedPath)


def test_path_length_is_counted_in_utf8_bytes() -> None:
    path = "\u00e9" * (MAX_PATH_BYTES // 2 + 1)  # two bytes each
    denied = resolve_path(path, "read", GRANTS)
    assert isinstance(denied, Deny)
    assert denied.code is ErrorCode.INVALID_ARGS
    assert f"at most {MAX_PATH_BYTES} bytes" in denied.message


def test_long_and_control_character_paths_are_cut_and_escaped_in_messages() -> None:
    path = "/etc/" + "x" * 1000 + "\n\x1b[31m"
    denied = resolve_path(path, "read", GRANTS)
    assert isinstance(denied, Deny)
    first_line = denied.message.splitlines()[0]
    assert len(first_line) < 300
    assert "\x1b" not in denied.message
    assert first_line.startswith("Cannot read '/etc/xxx")
    assert "…': path is outside the readable paths." in first_line


def test_control_characters_in_a_short_path_are_escaped_not_printed() -> None:
    denied = resolve_path("/etc/a\nReadable paths: /", "read", GRANTS)
    assert isinstance(denied, Deny)
    assert denied.message == f"Cannot read '/etc/a\\nReadable paths: /': {OUTSIDE_READ}"


def test_no_grants_lists_none_as_readable_and_writable() -> None:
    read = resolve_path("x.md", "read", ())
    write = resolve_path("x.md", "write", ())
    assert read == Deny(
        code=ErrorCode.POLICY_DENIED,
        message="Cannot read 'x.md': path is outside the readable paths.\nReadable paths: none",
    )
    assert write == Deny(
        code=ErrorCode.POLICY_DENIED,
        message="Cannot write to 'x.md': path is outside the writable paths.\nWritable paths: none",
    )


def test_read_only_everywhere_says_no_path_is_writable() -> None:
    denied = resolve_path("/data/docs/x", "write", (REF, DOCS))
    assert denied == Deny(
        code=ErrorCode.POLICY_DENIED,
        message="Cannot write to '/data/docs/x': path is read-only.\nWritable paths: none",
    )


def test_grant_order_does_not_change_the_longest_match() -> None:
    for grants in [(WS, REF), (REF, WS)]:
        resolved = resolve_path("/workspace/ref/a/b", "read", grants)
        assert isinstance(resolved, ResolvedPath)
        assert resolved.grant is REF
        assert resolved.parts == ("a", "b")


def test_a_rw_grant_nested_in_a_ro_grant_is_writable_inside_only() -> None:
    ro = PathGrant(
        name="ro",
        host_root=Path("/h"),
        root_id=(1, 20),
        holds_nested=True,
        visible_root=PurePosixPath("/workspace"),
        mode=PathMode.RO,
    )
    rw = PathGrant(
        name="out",
        host_root=Path("/h/out"),
        root_id=(1, 21),
        holds_nested=False,
        visible_root=PurePosixPath("/workspace/out"),
        mode=PathMode.RW,
    )
    assert isinstance(resolve_path("out/x", "write", (ro, rw)), ResolvedPath)
    denied = resolve_path("x", "write", (ro, rw))
    assert denied == Deny(
        code=ErrorCode.POLICY_DENIED,
        message="Cannot write to 'x': path is read-only.\nWritable paths: /workspace/out",
    )


def test_every_access_must_pass_and_the_first_refusal_wins() -> None:
    accesses = (
        PathAccess(path="a.md", access="read"),
        PathAccess(path="/data/docs/b", access="write", size=1),
        PathAccess(path="/etc/c", access="read"),
    )
    decision = decide("fs.read", accesses, RULES)
    assert decision == Deny(
        code=ErrorCode.POLICY_DENIED,
        message=f"Cannot write to '/data/docs/b': {READ_ONLY}",
    )


def test_allow_keeps_one_resolved_path_per_access_in_order() -> None:
    accesses = (
        PathAccess(path="/data/docs/src", access="read"),
        PathAccess(path="dst.md", access="write", size=3),
    )
    decision = decide("fs.read", accesses, RULES)
    assert isinstance(decision, Allow)
    assert [(r.grant.name, r.parts, r.access) for r in decision.resolved] == [
        ("docs", ("src",), "read"),
        ("workspace", ("dst.md",), "write"),
    ]


def test_a_call_touching_no_path_is_allowed_with_nothing_resolved() -> None:
    assert decide("time.now", (), RULES) == Allow(resolved=())


def test_check_path_is_the_per_access_part_of_decide() -> None:
    access = PathAccess(path="x.py", access="read")
    assert check_path(access, GRANTS) == decide("fs.read", (access,), RULES)


# --- read size (checked by the fs tool after a stat) ------------------------------------


def test_read_size_over_the_grant_limit_is_refused_with_the_limit() -> None:
    resolved = resolve_path("big.md", "read", GRANTS)
    assert isinstance(resolved, ResolvedPath)
    assert check_read_size(resolved, 100) is None
    assert check_read_size(resolved, 101) == Deny(
        code=ErrorCode.POLICY_DENIED,
        message="Cannot read '/workspace/big.md': file too large (101 bytes).\n"
        "Maximum allowed: 100 bytes",
    )


def test_read_size_is_unlimited_without_a_grant_limit() -> None:
    resolved = resolve_path("/data/docs/huge", "read", GRANTS)
    assert isinstance(resolved, ResolvedPath)
    assert check_read_size(resolved, 10**15) is None


# --- Deny as an exception -----------------------------------------------------------------


@pytest.mark.parametrize(
    ("code", "exc_type"),
    [
        (ErrorCode.POLICY_DENIED, PolicyViolation),
        (ErrorCode.INVALID_ARGS, InvalidArguments),
        (ErrorCode.INTERNAL, GatewayError),
    ],
)
def test_deny_becomes_the_exception_with_the_same_code_and_message(
    code: ErrorCode, exc_type: type[GatewayError]
) -> None:
    exc = Deny(code=code, message="why").as_error()
    assert type(exc) is exc_type
    assert exc.code is code
    assert exc.safe_message == "why"


# --- tools ----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("pattern", "tool", "matches"),
    [
        ("fs.read", "fs.read", True),
        ("fs.read", "fs.readx", False),
        ("fs.read", "fs", False),
        ("fs.*", "fs.read", True),
        ("fs.*", "fs.deep.name", True),
        ("fs.*", "fs", False),
        ("fs.*", "fsx.read", False),
        ("model.chat.*", "model.chat.stream", True),
        ("model.chat.*", "model.embed", False),
    ],
)
def test_tool_patterns_are_exact_names_or_family_wildcards(
    pattern: str, tool: str, matches: bool
) -> None:
    assert tool_matches(pattern, tool) is matches


@pytest.mark.parametrize(
    ("patterns", "run_ids", "tool", "allowed"),
    [
        (("fs.*",), None, "fs.read", True),
        (("fs.*",), ("fs.read",), "fs.read", True),
        (("fs.*",), ("fs.read",), "fs.write", False),  # the run narrows the policy
        (("fs.read",), ("fs.read", "fs.write"), "fs.write", False),  # and cannot widen it
        (("fs.read",), (), "fs.read", False),  # an empty run list allows nothing
        ((), None, "fs.read", False),
        ((), ("fs.read",), "fs.read", False),
        (("time.now",), None, "time.nowx", False),
    ],
)
def test_both_the_policy_and_the_run_must_allow_a_tool(
    patterns: tuple[str, ...], run_ids: tuple[str, ...] | None, tool: str, allowed: bool
) -> None:
    rules = RunRules(tool_patterns=patterns, run_tool_ids=run_ids, grants=())
    assert tool_allowed(tool, rules) is allowed
    assert isinstance(decide(tool, (), rules), Allow) is allowed


def test_allowed_tools_is_the_sorted_allowed_subset_of_known_tools() -> None:
    known = ["time.now", "fs.write", "http.fetch", "fs.read", "fs.read"]
    assert allowed_tools(known, RULES) == ("fs.read", "fs.write", "time.now")
    narrowed = RunRules(tool_patterns=("fs.*",), run_tool_ids=("fs.read", "x.y"), grants=())
    assert allowed_tools(known, narrowed) == ("fs.read",)
    assert allowed_tools(known, NO_RULES) == ()


def test_unmatched_patterns_flags_likely_typos() -> None:
    known = ["fs.read", "time.now"]
    assert unmatched_patterns(["fs.*", "fs.raed", "time.now", "http.*"], known) == (
        "fs.raed",
        "http.*",
    )


def test_denied_tool_lists_the_policys_allowed_tools() -> None:
    assert decide("http.fetch", (), RULES) == Deny(
        code=ErrorCode.POLICY_DENIED,
        message="tool 'http.fetch' is not allowed for this run. Allowed tools: fs.*, time.now",
    )


def test_denied_tool_lists_what_both_the_run_and_the_policy_allow() -> None:
    rules = RunRules(tool_patterns=("fs.*",), run_tool_ids=("fs.read", "time.now"), grants=())
    assert decide("fs.write", (), rules) == Deny(
        code=ErrorCode.POLICY_DENIED,
        message="tool 'fs.write' is not allowed for this run. Allowed tools: fs.read",
    )


def test_denied_tool_says_when_run_and_policy_share_no_tool() -> None:
    rules = RunRules(tool_patterns=("fs.*",), run_tool_ids=("time.now",), grants=())
    decision = decide("fs.read", (), rules)
    assert isinstance(decision, Deny)
    assert decision.message == (
        "tool 'fs.read' is not allowed for this run. None of this run's toolIds is allowed "
        "by its policy, so no tool is allowed."
    )


def test_denied_tool_under_an_empty_policy_says_it_allows_no_tools() -> None:
    assert decide("fs.read", (), NO_RULES) == Deny(
        code=ErrorCode.POLICY_DENIED,
        message="tool 'fs.read' is not allowed for this run. This run's policy allows no tools.",
    )


def test_the_tool_is_checked_before_any_path() -> None:
    decision = decide("http.fetch", (PathAccess(path="", access="read"),), RULES)
    assert isinstance(decision, Deny)
    assert decision.code is ErrorCode.POLICY_DENIED
    assert decision.message.startswith("tool 'http.fetch' is not allowed")


# --- properties -----------------------------------------------------------------------

SEGMENTS = st.sampled_from(
    [
        "..",
        ".",
        "",
        "a",
        "b.md",
        "ref",
        "workspace",
        "data",
        "docs",
        "etc",
        "%2e%2e",
        "..\\..",
        "\u2025",
        "\uff0e\uff0e",
        ". .",
        "...",
        "x.md ",
    ]
)
TRAVERSALS = st.builds(
    lambda lead, segs: lead + "/".join(segs),
    st.sampled_from(["", "/", "//", "///"]),
    st.lists(SEGMENTS, max_size=12),
)
ANY_PATH = st.one_of(st.text(max_size=300), TRAVERSALS, st.text(alphabet="./\\a\x00", max_size=40))
ACCESSES = st.builds(
    PathAccess,
    path=ANY_PATH,
    access=st.sampled_from(["read", "write"]),
    size=st.none() | st.integers(min_value=0, max_value=10**6),
    metadata_only=st.booleans(),
)


def oracle_visible(path: str) -> str:
    """The standard library's lexical normalization, minus POSIX's special '//'."""
    if path.startswith("/"):
        return posixpath.normpath("/" + path.lstrip("/"))
    return posixpath.normpath("/workspace/" + path)


@given(tool=st.text(max_size=50), accesses=st.lists(ACCESSES, max_size=4).map(tuple))
def test_decide_never_raises_and_returns_a_decision(
    tool: str, accesses: tuple[PathAccess, ...]
) -> None:
    for rules in (RULES, NO_RULES):
        decision = decide(tool, accesses, rules)
        assert isinstance(decision, Allow | Deny)
        if isinstance(decision, Deny):
            assert decision.code in (ErrorCode.POLICY_DENIED, ErrorCode.INVALID_ARGS)
            assert decision.message


@given(access=ACCESSES)
def test_an_allowed_path_is_clean_and_under_the_longest_matching_grant(
    access: PathAccess,
) -> None:
    decision = decide("fs.read", (access,), RULES)
    if not isinstance(decision, Allow):
        return
    (resolved,) = decision.resolved
    for part in resolved.parts:
        assert part not in ("", ".", "..")
        assert "/" not in part
        assert "\x00" not in part
    visible = PurePosixPath(resolved.visible)
    assert visible == resolved.grant.visible_root.joinpath(*resolved.parts)
    assert visible.is_relative_to(resolved.grant.visible_root)
    assert resolved.visible == oracle_visible(access.path)
    for other in GRANTS:  # no grant nested deeper also holds the path
        if len(other.visible_root.parts) > len(resolved.grant.visible_root.parts):
            assert not visible.is_relative_to(other.visible_root)


@given(path=TRAVERSALS)
def test_a_path_outside_every_grant_by_the_oracle_is_denied(path: str) -> None:
    if not path:
        return  # empty: INVALID_ARGS, covered by the table
    visible = PurePosixPath(oracle_visible(path))
    outside = not any(visible.is_relative_to(g.visible_root) for g in GRANTS)
    decision = resolve_path(path, "read", GRANTS)
    assert isinstance(decision, Deny) is outside


@given(path=TRAVERSALS)
def test_relative_paths_mean_the_same_as_under_slash_workspace(path: str) -> None:
    relative = path.lstrip("/")
    if not relative:
        return
    plain = resolve_path(relative, "read", GRANTS)
    rooted = resolve_path("/workspace/" + relative, "read", GRANTS)
    if isinstance(plain, Deny):  # messages differ: they quote the path as written
        assert isinstance(rooted, Deny)
        assert plain.code == rooted.code
        assert plain.message.split(": ", 1)[1] == rooted.message.split(": ", 1)[1]
    else:
        assert plain == rooted


@given(tool=st.text(max_size=40), access=ACCESSES)
def test_deny_by_default_an_empty_policy_denies_every_tool_and_path(
    tool: str, access: PathAccess
) -> None:
    policy = load_policy_text("version: 1\nname: empty\n", "empty.yaml")
    grants = bind_paths(policy, Path("/nonexistent-workspace"))
    rules = RunRules(tool_patterns=policy.tools.allow, run_tool_ids=None, grants=grants)
    assert not tool_allowed(tool, rules)
    assert isinstance(decide(tool, (access,), rules), Deny)
    assert isinstance(resolve_path(access.path, access.access, grants), Deny)
