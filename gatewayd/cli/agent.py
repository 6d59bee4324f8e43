"""``gatewayd agent run``: one host-owned agent run from the command line.

Progress goes to stderr as it happens (turn, tool, verdict); the result
(docs/agent-runs.md) goes to stdout as JSON, or to ``--result FILE``.
Exit status: 0 when the task finished (and was pushed, unless ``--no-push``), 1 when it
did not, 2 for a usage error.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any, Final

from gatewayd.cli.command import EXIT_FAILED, EXIT_OK, EXIT_USAGE, refusing
from gatewayd.cli.options import add_daemon_options, config_from_options, log_scrubber

if TYPE_CHECKING:
    from gatewayd.cli.command import Subparsers

DEFAULT_GIT_TOKEN_ENV: Final = "COGNI_GIT_TOKEN"  # noqa: S105 (a variable's name)
DEFAULT_AGENT_POLICY: Final = "agent"


def add_parsers(sub: Subparsers) -> None:
    agent = sub.add_parser("agent", help="host-owned agent runs (docs/agent-runs.md)")
    commands = agent.add_subparsers(dest="agent_command", required=True)
    run = commands.add_parser(
        "run",
        help="clone REPO at SHA, let MODEL do TASK with tools that run in a sandbox, "
        "push the result to cogni/<run-id>",
    )
    add_daemon_options(run)
    run.add_argument("--repo", required=True, help="the repository's URL (no credentials in it)")
    run.add_argument("--sha", required=True, help="the commit to start from (full hex id)")
    task = run.add_mutually_exclusive_group(required=True)
    task.add_argument("--task", help="what the agent should do, in plain language")
    task.add_argument("--task-file", type=Path, help="read the task from this file")
    run.add_argument("--model", required=True, help="a model alias of gatewayd's configuration")
    run.add_argument(
        "--policy",
        default=DEFAULT_AGENT_POLICY,
        help="the run's policy (default: the shipped 'agent' policy)",
    )
    run.add_argument(
        "--backend",
        choices=("overlay", "host"),
        default="overlay",
        help="the workspace backend (docs/workspaces.md); default overlay",
    )
    run.add_argument("--no-push", action="store_true", help="keep the patch; push nothing")
    run.add_argument(
        "--git-token-env",
        default=DEFAULT_GIT_TOKEN_ENV,
        help="variable (or systemd credential) holding the git token, used on the host only "
        f"(default {DEFAULT_GIT_TOKEN_ENV}; unset: no credentials)",
    )
    run.add_argument(
        "--git-username", default="x-access-token", help="the user name sent with the token"
    )
    run.add_argument("--pull-request", action="store_true", help="open a pull request too")
    run.add_argument("--forge-api", help="the forge's API base, e.g. https://api.github.com")
    run.add_argument("--forge-repo", help="the repository on the forge, as owner/name")
    run.add_argument("--base-branch", default="main", help="the pull request's target branch")
    run.add_argument(
        "--forge-token-env",
        default=None,
        help="variable holding the forge API token (default: the git token's)",
    )
    run.add_argument("--max-turns", type=int, default=40, help="model turns at most (40)")
    run.add_argument("--max-tokens", type=int, default=400_000, help="tokens at most (400000)")
    run.add_argument(
        "--max-wall-s", type=float, default=1800.0, help="wall time at most, seconds (1800)"
    )
    run.add_argument("--max-memory-mb", type=int, default=2048, help="the sandbox's memory")
    run.add_argument(
        "--max-patch-bytes",
        type=int,
        default=64 << 20,
        help="file contents one patch may carry (64 MiB); larger changes are left out and "
        "listed in the result's skipped",
    )
    run.add_argument(
        "--max-workspace-bytes",
        type=int,
        default=1 << 30,
        help="overlay backend: what the run may write in all, held on a private tmpfs "
        "(1 GiB; 0: no limit, on disk); past it, writes fail with ENOSPC",
    )
    run.add_argument("--actor", default="operator")
    run.add_argument("--tenant", default="local")
    run.add_argument("--result", type=Path, help="write the result JSON here, not to stdout")


def main(args: argparse.Namespace) -> int:
    return refusing(_agent_run, args)


def _agent_run(args: argparse.Namespace) -> int:
    import trio

    from gatewayd.agent.loop import run_agent
    from gatewayd.agent.repo import SHA_RE, RepoCredentials
    from gatewayd.agent.task import AgentLimits, AgentTask, PullRequestSpec
    from gatewayd.daemon import open_daemon
    from gatewayd.logs import configure_logging
    from gatewayd.secrets import SecretError, SecretMissing, read_secret

    def usage(message: str) -> int:
        print(f"gatewayd agent run: {message}", file=sys.stderr)
        return EXIT_USAGE

    if not SHA_RE.fullmatch(args.sha):
        return usage(f"--sha must be a full lowercase hex commit id, not {args.sha!r}")
    if args.pull_request and not (args.forge_api and args.forge_repo):
        return usage("--pull-request needs --forge-api and --forge-repo")
    try:
        text = args.task if args.task is not None else args.task_file.read_text()
        limits = AgentLimits(
            max_turns=args.max_turns, max_tokens=args.max_tokens, max_wall_s=args.max_wall_s
        )
    except (OSError, ValueError) as exc:
        return usage(str(exc))
    if not text.strip():
        return usage("the task is empty")
    if args.max_patch_bytes < 1 or args.max_memory_mb < 64 or args.max_workspace_bytes < 0:
        return usage(
            "--max-patch-bytes must be positive, --max-workspace-bytes 0 or more, and "
            "--max-memory-mb at least 64"
        )
    token: str | None = None
    try:
        token = read_secret(args.git_token_env, holds="the git token").value
    except SecretMissing:
        token = None  # a public or local repository
    except (SecretError, ValueError) as exc:
        return usage(str(exc))
    config = config_from_options(args)
    # The tokens are gatewayd's secrets for this process: scrubbed from every output.
    names = [args.git_token_env] + ([args.forge_token_env] if args.forge_token_env else [])
    config = config.changed(secret_env=tuple(dict.fromkeys([*config.secret_env, *names])))
    configure_logging(logging.WARNING, scrubber=log_scrubber(config))
    task = AgentTask(
        repo_url=args.repo,
        sha=args.sha,
        task=text,
        model=args.model,
        policy=args.policy,
        backend=args.backend,
        push=not args.no_push,
        pull_request=PullRequestSpec(
            api_base=args.forge_api,
            repository=args.forge_repo,
            target_branch=args.base_branch,
            token_env=args.forge_token_env or args.git_token_env,
        )
        if args.pull_request
        else None,
        credentials=RepoCredentials(token=token, username=args.git_username),
        limits=limits,
        actor=args.actor,
        tenant=args.tenant,
        max_memory_mb=args.max_memory_mb,
        max_patch_bytes=args.max_patch_bytes,
        max_workspace_bytes=args.max_workspace_bytes,
    )
    out: dict[str, Any] = {}

    def progress(line: str) -> None:
        print(f"gatewayd agent: {line}", file=sys.stderr, flush=True)

    async def go() -> None:
        async with open_daemon(config) as daemon:
            result = await run_agent(
                daemon.runs,
                daemon.dispatcher,
                task,
                progress,
                mcp=daemon.mcp_tools,
                folder_tools=tuple(tool.name for tool in daemon.tool_folders.tools),
            )
            out.update(result.to_json())

    trio.run(go)
    text_out = json.dumps(out, indent=2)
    if args.result is not None:
        args.result.write_text(text_out + "\n")
        print(f"gatewayd agent: result in {args.result}", file=sys.stderr)
    else:
        print(text_out)
    return EXIT_OK if out.get("ok") else EXIT_FAILED
