"""What network a process tool's call gets: the run's network section with its domains
narrowed to those the manifest declares and the run allows (the call's own proxy
enforces exactly that list)."""

from __future__ import annotations

from contextlib import AbstractAsyncContextManager
from pathlib import Path
from typing import Any

import pytest

from gatewayd.errors import PolicyViolation
from gatewayd.policy.model import NetworkSection
from gatewayd.runners.manifest import parse_manifest
from gatewayd.runners.process import ProcessToolRunner
from gatewayd.runners.spec import FolderTool
from gatewayd.tools.registry import ToolContext


def tool(network: list[Any]) -> FolderTool:
    data = {
        "name": "net.tool",
        "version": "1.0.0",
        "description": "a process tool with network",
        "input_schema": {"type": "object"},
        "runtime": "process",
        "entry": ["python3", "/tool/t.py"],
        "capabilities": {"network": network},
    }
    return parse_manifest(data, file="/srv/tools/net/manifest.json", folder="/srv/tools/net")


def no_proxy(
    *, ctx: ToolContext, tool: str, network: NetworkSection, socket: Path
) -> AbstractAsyncContextManager[None]:
    raise AssertionError("not started here")


def narrowed(declared: list[Any], allowed: list[str], **section: Any) -> tuple[str, ...] | None:
    net = NetworkSection.model_validate(
        {"allow_domains": allowed, "proxy": {"enabled": True}, **section}
    )
    ctx = ToolContext(run_id="r1", grants=(), max_output_bytes=1000, network=net)
    result = ProcessToolRunner(tool(declared), egress=no_proxy).call_network(ctx)
    return None if result is None else result.allow_domains


@pytest.mark.parametrize(
    ("declared", "allowed", "granted"),
    [
        # a host the run lists, or one beneath a wildcard it lists
        (["api.example.org"], ["api.example.org", "other.example.org"], ("api.example.org",)),
        (["api.example.org"], ["*.example.org"], ("api.example.org",)),
        # a wildcard: as the run lists it, or beneath the run's; never wider than the run's
        (["*.example.org"], ["*.example.org"], ("*.example.org",)),
        (["*.a.example.org"], ["*.example.org"], ("*.a.example.org",)),
        ([{"domain": "*.example.org", "optional": True}], ["api.example.org"], None),
        # optional ones the run lacks are dropped; none left: no proxy at all
        (
            ["api.example.org", {"domain": "x.example.net", "optional": True}],
            ["api.example.org"],
            ("api.example.org",),
        ),
        ([{"domain": "x.example.net", "optional": True}], ["api.example.org"], None),
        ([{"domain": "x.example.net", "optional": True}], [], None),
        ([], ["api.example.org"], None),
    ],
)
def test_the_calls_domains_are_the_declared_ones_the_run_allows(
    declared: list[Any], allowed: list[str], granted: tuple[str, ...] | None
) -> None:
    assert narrowed(declared, allowed) == granted


def test_a_required_domain_the_run_lacks_is_never_handed_to_the_proxy() -> None:
    # The policy step refuses such a call first; were it reached, the proxy still
    # enforces only what the run allows.
    assert narrowed(["x.example.net", "api.example.org"], ["api.example.org"]) == (
        "api.example.org",
    )


def test_the_rest_of_the_section_is_the_runs() -> None:
    net = NetworkSection.model_validate(
        {
            "allow_domains": ["api.example.org", "other.example.org"],
            "ports": [8443],
            "allow_private": ["api.example.org"],
            "methods": ["GET", "POST"],
            "proxy": {"enabled": True, "max_connections": 3},
        }
    )
    ctx = ToolContext(run_id="r1", grants=(), max_output_bytes=1000, network=net)
    result = ProcessToolRunner(tool(["api.example.org"]), egress=no_proxy).call_network(ctx)
    assert result is not None
    assert result.model_dump() == net.model_dump() | {"allow_domains": ("api.example.org",)}


def test_a_run_without_network_gives_none() -> None:
    ctx = ToolContext(run_id="r1", grants=(), max_output_bytes=1000, network=None)
    assert ProcessToolRunner(tool(["api.example.org"]), egress=no_proxy).call_network(ctx) is None


def test_without_a_per_call_proxy_a_required_domain_is_refused_and_optional_dropped() -> None:
    net = NetworkSection.model_validate({"allow_domains": ["api.example.org"]})
    ctx = ToolContext(run_id="r1", grants=(), max_output_bytes=1000, network=net)
    with pytest.raises(PolicyViolation, match=r"net\.tool .*api\.example\.org.*per-call egress"):
        ProcessToolRunner(tool(["api.example.org"])).call_network(ctx)
    optional = tool([{"domain": "api.example.org", "optional": True}])
    assert ProcessToolRunner(optional).call_network(ctx) is None


def test_a_run_whose_proxy_is_off_gives_its_process_tools_no_network() -> None:
    net = NetworkSection.model_validate({"allow_domains": ["api.example.org"]})
    ctx = ToolContext(run_id="r1", grants=(), max_output_bytes=1000, network=net)
    runner = ProcessToolRunner(tool(["api.example.org"]), egress=no_proxy)
    with pytest.raises(PolicyViolation, match=r"api\.example\.org.*network\.proxy\.enabled"):
        runner.call_network(ctx)
    optional = tool([{"domain": "api.example.org", "optional": True}])
    assert ProcessToolRunner(optional, egress=no_proxy).call_network(ctx) is None
