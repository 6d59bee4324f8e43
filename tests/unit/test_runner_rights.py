"""What one call of a folder tool gets (gatewayd/runners/rights.py): the intersection of
its manifest and the calling run's grants. Required needs go through dispatch's policy
step (a run lacking one is refused, naming it); optional ones are granted only where the
run allows them, an optional read-write path on a read-only grant read-only; and a
directory under per-file rules is never handed to a tool whole."""

from __future__ import annotations

from pathlib import Path, PurePosixPath
from typing import Any

import pytest

from gatewayd.policy.capabilities import CapabilityRequest, RunRights, check_call
from gatewayd.policy.decide import Allow, Deny
from gatewayd.policy.model import NetworkSection
from gatewayd.policy.paths import PathAccess, PathGrant, PathMode, ResolvedPath
from gatewayd.protocol import ErrorCode
from gatewayd.runners.manifest import parse_manifest
from gatewayd.runners.rights import (
    NARROWER_PATH_HINT,
    GrantedFile,
    granted_domains,
    granted_env,
    granted_files,
    granted_models,
    required_request,
    whole_directory_refusal,
)
from gatewayd.runners.spec import FolderTool
from gatewayd.tools.registry import ToolContext


def grant(
    visible: str,
    mode: PathMode,
    *,
    host: str | None = None,
    suffixes: tuple[str, ...] = (),
    max_file_bytes: int | None = None,
    holds_nested: bool = False,
    apps_parts: tuple[str, ...] | None = None,
) -> PathGrant:
    return PathGrant(
        name=visible.rsplit("/", 1)[-1],
        host_root=Path(host or "/srv/ws" + visible.removeprefix("/workspace")),
        root_id=(1, hash(visible) & 0xFFFF),
        holds_nested=holds_nested,
        visible_root=PurePosixPath(visible),
        mode=mode,
        suffixes=suffixes,
        max_file_bytes=max_file_bytes,
        apps_parts=apps_parts,
    )


WORKSPACE_RW = grant("/workspace", PathMode.RW, apps_parts=("apps",))
WORKSPACE_RO = grant("/workspace", PathMode.RO, apps_parts=("apps",))


def tool(capabilities: dict[str, Any], runtime: str = "wasm") -> FolderTool:
    return parse_manifest(
        {
            "name": "t.tool",
            "version": "1",
            "description": "A tool.",
            "input_schema": {"type": "object"},
            "runtime": runtime,
            "entry": "t.wasm" if runtime == "wasm" else ["/tool/t"],
            "capabilities": capabilities,
        },
        file="/t/manifest.json",
        folder="/t",
    )


def rights(
    grants: tuple[PathGrant, ...] = (),
    *,
    models: tuple[str, ...] = (),
    env: tuple[str, ...] = (),
    domains: tuple[str, ...] = (),
) -> RunRights:
    class Budget:
        def spent(self) -> str | None:
            return None

    return RunRights(
        grants=grants,
        models=models,
        model_budget=Budget(),
        network=NetworkSection(allow_domains=domains),
        env=env,
        without_sandbox=None,
    )


def context(t: FolderTool, run: RunRights, *, network: NetworkSection | None = None) -> ToolContext:
    """The call's context as dispatch makes it, after its policy step allowed it."""
    decision = check_call(t.name, t.manifest.capabilities, required_request(t), run)
    assert isinstance(decision, Allow), decision
    return ToolContext(
        run_id="r",
        grants=run.grants,
        max_output_bytes=1 << 20,
        resolved=decision.resolved,
        env=run.env,
        model_access=run.models,
        network=network if network is not None else run.network,
    )


def denial(t: FolderTool, run: RunRights) -> Deny:
    decision = check_call(t.name, t.manifest.capabilities, required_request(t), run)
    assert isinstance(decision, Deny), decision
    return decision


# --- the request: required needs only ------------------------------------------------


def test_the_request_holds_only_required_needs_and_exec_for_a_process_tool() -> None:
    t = tool(
        {
            "filesystem": [
                {"path": "src", "access": "read"},
                {"path": "out", "access": "read-write"},
                {"path": "cache", "access": "read-write", "optional": True},
            ],
            "model_access": ["m", {"alias": "big", "optional": True}],
            "env": ["LANG", {"name": "TZ", "optional": True}],
        }
    )
    request = required_request(t)
    assert [(p.path, p.access) for p in request.paths] == [
        ("/workspace/src", "read"),
        ("/workspace/out", "write"),
    ]
    assert request.models == ("m",)
    assert request.env == ("LANG",)
    assert request.exec is False
    process = tool({"network": ["a.org", {"domain": "b.org", "optional": True}]}, "process")
    assert required_request(process) == CapabilityRequest(domains=("a.org",), exec=True)


def test_the_request_never_exceeds_the_declaration() -> None:
    # check_call refuses (internal) anything beyond the manifest: the request is in it.
    t = tool({"filesystem": [{"path": "src", "access": "read-write"}], "env": ["A"]})
    decision = check_call(
        t.name, t.manifest.capabilities, required_request(t), rights((WORKSPACE_RW,), env=("A",))
    )
    assert isinstance(decision, Allow)


@pytest.mark.parametrize(
    ("capabilities", "run", "code", "named"),
    [
        (
            {"filesystem": [{"path": "src", "access": "read"}]},
            rights(),
            ErrorCode.POLICY_DENIED,
            "/workspace/src",
        ),
        (
            {"filesystem": [{"path": "out", "access": "read-write"}]},
            rights((WORKSPACE_RO,)),
            ErrorCode.POLICY_DENIED,
            "read-only",
        ),
        (
            {"model_access": ["big"]},
            rights(models=("small",)),
            ErrorCode.POLICY_DENIED,
            "model 'big'",
        ),
        (
            {"env": ["LANG"]},
            rights(env=("TZ",)),
            ErrorCode.POLICY_DENIED,
            "environment variable 'LANG'",
        ),
    ],
)
def test_a_required_need_the_run_lacks_is_refused_naming_it(
    capabilities: dict[str, Any], run: RunRights, code: ErrorCode, named: str
) -> None:
    refused = denial(tool(capabilities), run)
    assert refused.code is code
    assert named in refused.message


def test_a_required_domain_the_run_lacks_is_refused_naming_it() -> None:
    t = tool({"network": ["api.example.com"]}, "process")
    refused = denial(t, rights(domains=("other.org",)))
    assert refused.code is ErrorCode.POLICY_DENIED
    assert "api.example.com" in refused.message


def test_an_optional_need_is_never_asked_so_the_call_runs_without_it() -> None:
    t = tool(
        {
            "filesystem": [{"path": "out", "access": "read-write", "optional": True}],
            "model_access": [{"alias": "m", "optional": True}],
            "env": [{"name": "TZ", "optional": True}],
        }
    )
    ctx = context(t, rights())
    assert granted_files(t, ctx) == ()
    assert granted_models(t, ctx) == ()
    assert granted_env(t, ctx, {"TZ": "UTC"}) == {}


# --- files ---------------------------------------------------------------------------


def test_required_files_are_the_policy_steps_resolution_in_order() -> None:
    t = tool(
        {
            "filesystem": [
                {"path": "src", "access": "read"},
                {"path": ".", "access": "read-write"},
            ]
        }
    )
    ctx = context(t, rights((WORKSPACE_RW,)))
    files = granted_files(t, ctx)
    assert [(f.visible, f.writable, f.resolved.parts) for f in files] == [
        ("/workspace/src", False, ("src",)),
        ("/workspace", True, ()),
    ]
    assert all(f.resolved.grant is WORKSPACE_RW for f in files)


def test_an_optional_read_write_path_on_a_read_only_grant_is_granted_read_only() -> None:
    t = tool({"filesystem": [{"path": "out", "access": "read-write", "optional": True}]})
    (granted,) = granted_files(t, context(t, rights((WORKSPACE_RO,))))
    assert granted.visible == "/workspace/out"
    assert granted.writable is False
    (granted,) = granted_files(t, context(t, rights((WORKSPACE_RW,))))
    assert granted.writable is True


def test_a_required_read_write_path_on_a_read_only_grant_is_refused() -> None:
    t = tool({"filesystem": [{"path": "out", "access": "read-write"}]})
    refused = denial(t, rights((WORKSPACE_RO,)))
    assert refused.code is ErrorCode.POLICY_DENIED
    assert "Cannot write to '/workspace/out'" in refused.message


def test_an_optional_path_outside_every_grant_is_dropped() -> None:
    docs = grant("/workspace/docs", PathMode.RO)
    t = tool(
        {
            "filesystem": [
                {"path": "docs", "access": "read"},
                {"path": "src", "access": "read", "optional": True},
            ]
        }
    )
    files = granted_files(t, context(t, rights((docs,))))
    assert [f.visible for f in files] == ["/workspace/docs"]


def test_nested_grants_give_each_path_its_own_grant() -> None:
    # A read-only grant inside a writable one: the optional rw need inside it is read-only.
    ref = grant("/workspace/ref", PathMode.RO)
    ws = grant("/workspace", PathMode.RW, holds_nested=True)
    t = tool(
        {
            "filesystem": [
                {"path": "src", "access": "read-write", "optional": True},
                {"path": "ref", "access": "read-write", "optional": True},
            ]
        }
    )
    files = granted_files(t, context(t, rights((ws, ref))))
    # src lies beside ref, not above it: handed over whole (a link in src cannot lead
    # out of it); ref is read-only, its own grant's mode.
    assert [(f.visible, f.writable, f.resolved.grant.name) for f in files] == [
        ("/workspace/src", True, "workspace"),
        ("/workspace/ref", False, "ref"),
    ]
    # The whole workspace holds ref: never handed over whole.
    whole = tool({"filesystem": [{"path": ".", "access": "read", "optional": True}]})
    assert granted_files(whole, context(whole, rights((ws, ref)))) == ()


def test_the_apps_folder_is_never_granted_even_optionally() -> None:
    t = tool({"filesystem": [{"path": ".", "access": "read", "optional": True}]})
    # The whole workspace holds the apps folder: an optional need of it is dropped.
    assert granted_files(t, context(t, rights((WORKSPACE_RW,)))) == ()


def test_granted_files_refuse_a_context_that_is_not_this_tools_call() -> None:
    t = tool({"filesystem": [{"path": "src", "access": "read"}]})
    ctx = ToolContext(run_id="r", grants=(WORKSPACE_RW,), max_output_bytes=1)
    with pytest.raises(Exception, match="resolved paths do not match"):
        granted_files(t, ctx)


# --- whole directories ----------------------------------------------------------------


def resolved(g: PathGrant, *parts: str) -> ResolvedPath:
    visible = str(g.visible_root.joinpath(*parts))
    return ResolvedPath(grant=g, parts=parts, visible=visible, access="read")


@pytest.mark.parametrize(
    ("g", "parts", "reason"),
    [
        (
            grant("/workspace", PathMode.RO, suffixes=(".md",)),
            ("docs",),
            "allows only files ending in .md",
        ),
        (
            grant("/workspace", PathMode.RO, max_file_bytes=1000),
            (),
            "limits each file to 1000 bytes",
        ),
        (
            grant("/workspace", PathMode.RW, holds_nested=True),
            ("src",),
            "holds another grant's directory",
        ),
        (WORKSPACE_RW, (), "apps folder"),  # holds it
        (WORKSPACE_RW, ("apps",), "apps folder"),  # is it
        (WORKSPACE_RW, ("APPS", "notes"), "apps folder"),  # lies in it, any case
        (grant("/data", PathMode.RO, apps_parts=("ws", "apps")), ("ws",), "apps folder"),
    ],
)
def test_a_directory_under_per_file_rules_is_never_handed_over_whole(
    g: PathGrant, parts: tuple[str, ...], reason: str
) -> None:
    message = whole_directory_refusal(resolved(g, *parts))
    assert message is not None
    assert reason in message
    assert NARROWER_PATH_HINT in message


@pytest.mark.parametrize(
    ("g", "parts"),
    [
        (WORKSPACE_RW, ("src",)),
        (WORKSPACE_RW, ("apps2",)),
        (grant("/workspace", PathMode.RO), ()),  # no apps folder beneath it
        (grant("/data", PathMode.RO, apps_parts=("ws", "apps")), ("other",)),
    ],
)
def test_a_plain_directory_is_handed_over(g: PathGrant, parts: tuple[str, ...]) -> None:
    assert whole_directory_refusal(resolved(g, *parts)) is None


def test_an_optional_path_under_a_suffix_rule_is_dropped_and_a_required_one_left_to_the_runner() -> (
    None
):
    md = grant("/workspace", PathMode.RO, suffixes=(".md",))
    optional = tool({"filesystem": [{"path": "docs", "access": "read", "optional": True}]})
    assert granted_files(optional, context(optional, rights((md,)))) == ()
    required = tool({"filesystem": [{"path": "docs", "access": "read"}]})
    (granted,) = granted_files(required, context(required, rights((md,))))
    assert granted == GrantedFile(
        visible="/workspace/docs", resolved=granted.resolved, writable=False
    )
    assert whole_directory_refusal(granted.resolved) is not None


# --- models, env, network -------------------------------------------------------------


def test_models_are_the_required_ones_and_the_optional_ones_the_run_grants() -> None:
    t = tool(
        {
            "model_access": [
                "m",
                {"alias": "big", "optional": True},
                {"alias": "other", "optional": True},
            ]
        }
    )
    ctx = context(t, rights(models=("m", "big")))
    assert granted_models(t, ctx) == ("m", "big")


def test_env_values_come_from_gatewayds_environment_for_granted_names_only() -> None:
    t = tool(
        {"env": ["LANG", {"name": "TZ", "optional": True}, {"name": "HOMEY", "optional": True}]}
    )
    ctx = context(t, rights(env=("LANG", "TZ", "SECRET")))
    environ = {"LANG": "C.UTF-8", "TZ": "UTC", "HOMEY": "x", "SECRET": "s3cret"}
    assert granted_env(t, ctx, environ) == {"LANG": "C.UTF-8", "TZ": "UTC"}
    # Unset, or a value no environment can hold: left out.
    assert granted_env(t, ctx, {"LANG": "a\x00b"}) == {}


def test_optional_domains_only_where_the_run_allows_them() -> None:
    t = tool(
        {
            "network": [
                "a.org",
                {"domain": "b.org", "optional": True},
                {"domain": "c.org", "optional": True},
                {"domain": "*.d.org", "optional": True},
                {"domain": "*.e.org", "optional": True},
            ]
        },
        "process",
    )
    run = rights(domains=("a.org", "b.org", "*.d.org", "x.e.org"))
    ctx = context(t, run)
    assert granted_domains(t, ctx) == ("a.org", "b.org", "*.d.org")
    no_network = tool({"network": [{"domain": "b.org", "optional": True}]}, "process")
    bare = ToolContext(run_id="r", grants=(), max_output_bytes=1, network=None)
    assert granted_domains(no_network, bare) == ()


def test_a_path_access_for_a_whole_directory_skips_the_suffix_rule_in_the_policy_step() -> None:
    # The policy step judges the directory; whole_directory_refusal judges the rule.
    t = tool({"filesystem": [{"path": "docs", "access": "read"}]})
    (access,) = required_request(t).paths
    assert access == PathAccess(path="/workspace/docs", access="read", metadata_only=True)


def test_a_nested_grant_refuses_only_the_directories_that_hold_it() -> None:
    # /workspace (rw) holds /workspace/notes (ro, .md only): a link in a directory that
    # holds notes could reach it under the workspace's rules; one beside it cannot.
    outer = grant("/workspace", PathMode.RW, holds_nested=True)
    notes = grant("/workspace/notes", PathMode.RO, suffixes=(".md",))
    grants = (outer, notes)
    assert whole_directory_refusal(resolved(outer, "src"), grants) is None
    assert whole_directory_refusal(resolved(outer, "notes2"), grants) is None
    for parts in ((), ("notes",)):
        message = whole_directory_refusal(resolved(outer, *parts), grants)
        assert message is not None and "holds another grant's directory" in message
    # Without the run's grants: every directory of a grant that holds another.
    assert whole_directory_refusal(resolved(outer, "src")) is not None
