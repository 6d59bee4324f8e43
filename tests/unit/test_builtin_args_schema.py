"""Built-in tools' argument schemas are built once per argument type and stay exact."""

from __future__ import annotations

from typing import Any

import msgspec

from gatewayd.policy.capabilities import no_request
from gatewayd.tools.builtin import args_schema, builtin_tool
from gatewayd.tools.registry import ToolContext


class _Args(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """Say something."""

    text: str
    times: int = 1


class _OtherArgs(msgspec.Struct, frozen=True, kw_only=True):
    path: str


async def _run(args: Any, ctx: ToolContext) -> None:
    return None


def test_schema_is_msgspecs_and_built_once_per_type() -> None:
    first = builtin_tool(name="t.one", summary="one", args_type=_Args, run=_run)
    second = builtin_tool(
        name="t.two", summary="two", args_type=_Args, run=_run, requests=no_request
    )
    assert first.manifest.args_schema == msgspec.json.schema(_Args)
    # The second tool of the type takes the schema made for the first.
    assert second.manifest.args_schema is first.manifest.args_schema


def test_each_type_has_its_own_schema() -> None:
    assert args_schema(_OtherArgs) == msgspec.json.schema(_OtherArgs)
    assert args_schema(_OtherArgs) != args_schema(_Args)


def test_per_run_admin_tools_reuse_their_schemas() -> None:
    # The tools made for every run of an apps workspace: their schemas are not rebuilt.
    from gatewayd.apps.admintools import InstallAppArgs

    before = args_schema.cache_info().hits
    assert args_schema(InstallAppArgs) == msgspec.json.schema(InstallAppArgs)
    args_schema(InstallAppArgs)
    assert args_schema.cache_info().hits >= before + 1
