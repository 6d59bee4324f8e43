"""`gatewayd tools list|check|show|run`: the tool folders of the configured tool directories
(``tool_dirs``), read as the daemon reads them at start.

* ``list``: each tool a daemon would register (name, runtime, version, folder);
  ``--json`` for scripts. Folders that would be skipped are counted on stderr.
* ``check [PATH...]``: the configured directories, or each PATH (a tool directory, or
  one tool's folder): every manifest validated, every wasm module compiled (which warms
  the daemon's module cache); one line per problem, ``FILE: FIELD: REASON``. Exit
  status 0 when everything is valid, 1 otherwise.
* ``show NAME``: one tool as loaded: its manifest, digests, entry and what it declares.

These read the folders themselves and start no daemon: a running daemon read them when
it started (a change needs a restart). ``run NAME ARGS --workspace W`` is one call of a
tool through an in-process daemon (:mod:`gatewayd.cli.tools_run`).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

from gatewayd.cli import tools_run
from gatewayd.cli.command import EXIT_FAILED, EXIT_OK
from gatewayd.cli.options import add_daemon_options, settings_from_options

if TYPE_CHECKING:
    from gatewayd.cli.command import Subparsers
    from gatewayd.config import GatewaydConfig
    from gatewayd.runners.folders import ToolFolders
    from gatewayd.runners.spec import FolderTool


def add_parsers(sub: Subparsers) -> None:
    tools = sub.add_parser(
        "tools", help="tool folders: operators' own wasm and process tools (docs/tool-runners.md)"
    ).add_subparsers(dest="tools_command", required=True)
    listing = tools.add_parser("list", help="the tools of the configured tool_dirs")
    add_daemon_options(listing)
    listing.add_argument("--json", action="store_true", help="as JSON")
    check = tools.add_parser(
        "check",
        help="validate tool folders and compile their wasm modules (exit 0 all valid, 1 not)",
    )
    add_daemon_options(check)
    check.add_argument(
        "paths",
        nargs="*",
        type=Path,
        metavar="PATH",
        help="a tool directory or one tool's folder (default: the configured tool_dirs)",
    )
    show = tools.add_parser("show", help="one tool as loaded: manifest, digests, declarations")
    add_daemon_options(show)
    show.add_argument("name", metavar="NAME", help="the tool's name")
    # `tools run`: one call of a tool against a workspace (gatewayd/cli/tools_run.py).
    tools_run.add_run_parser(tools)


def main(args: argparse.Namespace) -> int:
    command: str = args.tools_command
    if command == "run":  # it reads its settings itself, as `gatewayd run` does
        return tools_run.run_tool(args)
    config = settings_from_options(args).config
    if command == "list":
        return _list(config, as_json=args.json)
    if command == "check":
        return _check(config, args.paths)
    if command == "show":
        return _show(config, args.name)
    raise AssertionError(f"unknown tools command {command!r}")


def _builtin_names() -> frozenset[str]:
    from gatewayd.tools import builtin_tools

    return frozenset(builtin_tools())


def _loaded(config: GatewaydConfig) -> ToolFolders:
    from gatewayd.runners.folders import load_tool_dirs, manifest_defaults

    return load_tool_dirs(
        config.tool_dirs, defaults=manifest_defaults(config), taken=_builtin_names()
    )


def _list(config: GatewaydConfig, *, as_json: bool) -> int:
    folders = _loaded(config)
    rows = [
        {
            "name": tool.name,
            "runtime": str(tool.runner),
            "version": tool.manifest.version,
            "folder": tool.folder,
        }
        for tool in folders.tools
    ]
    if as_json:
        print(json.dumps(rows, indent=2))
    elif not config.tool_dirs:
        print("no tool directories configured (tool_dirs)")
    elif not rows:
        print("no tools in " + ", ".join(str(d) for d in config.tool_dirs))
    else:
        widths = [max(len(row[key]) for row in rows) for key in ("name", "runtime", "version")]
        for row in rows:
            name, runtime, version = (
                row[key].ljust(width)
                for key, width in zip(("name", "runtime", "version"), widths, strict=True)
            )
            print(f"{name}  {runtime}  {version}  {row['folder']}")
    if folders.problems:
        print(
            f"gatewayd tools list: {len(folders.problems)} folder(s) skipped; "
            "`gatewayd tools check` says why",
            file=sys.stderr,
        )
    return EXIT_OK


def _check(config: GatewaydConfig, paths: list[Path]) -> int:
    from gatewayd.errors import GatewayError
    from gatewayd.runners.folders import load_paths, manifest_defaults
    from gatewayd.runners.manifest import Problem
    from gatewayd.runners.wasm import WasmEngine
    from gatewayd.tools.manifest import RunnerKind

    targets = paths or list(config.tool_dirs)
    if not targets:
        print("gatewayd tools check: nothing to check: no PATH given and no tool_dirs configured")
        return EXIT_OK
    folders = load_paths(targets, defaults=manifest_defaults(config), taken=_builtin_names())
    problems = list(folders.problems)
    valid = []
    wasm_tools = [tool for tool in folders.tools if tool.runner is RunnerKind.WASM]
    # The daemon's module cache is warmed where it can be; the check never makes
    # gatewayd's state directory (the daemon makes it, with its own modes).
    cache = config.resolved_tool_cache_dir
    engine = WasmEngine(cache if cache.parent.is_dir() else None) if wasm_tools else None
    try:
        for tool in folders.tools:
            if engine is not None and tool.runner is RunnerKind.WASM:
                try:
                    engine.load(tool)
                except GatewayError as exc:
                    problems.append(Problem(tool.manifest_path, "entry", exc.safe_message))
                    continue
            valid.append(tool)
    finally:
        if engine is not None:
            engine.close()
    for tool in valid:
        print(f"ok: {tool.name} ({tool.runner}, {tool.manifest.version}) in {tool.folder}")
    for problem in problems:
        print(str(problem), file=sys.stderr)
    if problems:
        print(
            f"gatewayd tools check: {len(problems)} problem(s), {len(valid)} valid tool(s)",
            file=sys.stderr,
        )
        return EXIT_FAILED
    print(f"gatewayd tools check: {len(valid)} valid tool(s)")
    return EXIT_OK


def _show(config: GatewaydConfig, name: str) -> int:
    folders = _loaded(config)
    for tool in folders.tools:
        if tool.name == name:
            print(json.dumps(shown(tool), indent=2))
            return EXIT_OK
    names = ", ".join(tool.name for tool in folders.tools) or "none"
    print(
        f"gatewayd tools show: no tool named {name!r} in the tool directories; tools: {names}"
        + (" (`gatewayd tools check` lists the folders skipped)" if folders.problems else ""),
        file=sys.stderr,
    )
    return EXIT_FAILED


def shown(tool: FolderTool) -> dict[str, Any]:
    """``tool`` as ``tools show`` prints it: where it comes from, its digests, its
    manifest as dispatch sees it, and each need with whether it is optional."""
    import msgspec

    return {
        "name": tool.name,
        "runtime": str(tool.runner),
        "folder": tool.folder,
        "manifestFile": tool.manifest_path,
        "manifestDigest": tool.manifest_digest,
        "entry": list(tool.entry),
        "entryDigest": tool.entry_digest or None,
        "needs": {
            "filesystem": [msgspec.to_builtins(need) for need in tool.files],
            "network": [msgspec.to_builtins(need) for need in tool.network],
            "model_access": [msgspec.to_builtins(need) for need in tool.models],
            "env": [msgspec.to_builtins(need) for need in tool.env],
        },
        "manifest": msgspec.to_builtins(tool.manifest),
    }
