"""``gatewayd agent run``: one host-owned agent run from the command line (``agent
submit|status|result|cancel``, the same runs on Temporal: :mod:`gatewayd.cli.agent_scaleout`).

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

from gatewayd.cli import agent_scaleout
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
    add_task_options(run, max_patch_bytes=64 << 20)
    run.add_argument(
        "--git-token-env",
        default=DEFAULT_GIT_TOKEN_ENV,
        help="variable (or systemd credential) holding the git token, used on the host only "
        f"(default {DEFAULT_GIT_TOKEN_ENV}; unset: no credentials)",
    )
    run.add_argument(
        "--git-username", default="x-access-token", help="the user name sent with the token"
    )
    run.add_argument("--forge-api", help="the forge's API base, e.g. https://api.github.com")
    run.add_argument("--forge-repo", help="the repository on the forge, as owner/name")
    run.add_argument("--base-branch", default="main", help="the pull request's target branch")
    run.add_argument(
        "--forge-token-env",
        default=None,
        help="variable holding the forge API token (default: the git token's)",
    )
    run.add_argument("--result", type=Path, help="write the result JSON here, not to stdout")
    _add_scaleout_parsers(commands)


def _add_scaleout_parsers(commands: Subparsers) -> None:
    """`agent submit|status|result|cancel`: the same runs as workflows on Temporal,
    run by the gatewayd workers of many hosts (docs/scale-out.md)."""
    submit = commands.add_parser(
        "submit",
        help="submit the same run as `agent run` to Temporal, for a gatewayd worker to run; "
        "prints the workflow id",
    )
    add_temporal_options(submit, task_queue=True)
    add_task_options(submit, max_patch_bytes=None)
    submit.add_argument(
        "--branch", help="push to this new branch (default cogni/<run-id>; never main)"
    )
    for name, what in (
        ("status", "where a submitted run is: Temporal's status and the worker's progress"),
        ("result", "a submitted run's result (JSON), once it has ended"),
        ("cancel", "cancel a submitted run: its sandbox killed, its partial result kept"),
    ):
        command = commands.add_parser(name, help=what)
        add_temporal_options(command, task_queue=False)
        command.add_argument("workflow_id", metavar="ID", help="the id `agent submit` printed")
        if name == "result":
            command.add_argument("--wait", action="store_true", help="wait until the run has ended")
            command.add_argument(
                "--timeout", type=float, default=None, help="with --wait: give up after S seconds"
            )


def add_temporal_options(p: argparse.ArgumentParser, *, task_queue: bool) -> None:
    """Where agent runs are: the options over the configuration's settings (a run is
    found by its workflow id alone, so only ``submit`` takes a ``task_queue``)."""
    p.add_argument(
        "--temporal",
        metavar="ADDRESS",
        help="the Temporal frontend, host:port (default: temporal_address of the "
        "configuration, $GATEWAYD_TEMPORAL_ADDRESS)",
    )
    p.add_argument(
        "--namespace", help="the Temporal namespace (default: temporal_namespace, 'default')"
    )
    if task_queue:
        p.add_argument(
            "--task-queue",
            help="the task queue the workers poll (default: temporal_task_queue, "
            "'gatewayd-agent-runs')",
        )
    p.add_argument(
        "--config",
        type=Path,
        default=None,
        help="gatewayd's configuration file, read for the defaults above",
    )


def add_task_options(p: argparse.ArgumentParser, *, max_patch_bytes: int | None) -> None:
    """What an agent run is asked to do and within which limits: the options `agent run`
    and `agent submit` share (``max_patch_bytes``: the default, None: the worker's)."""
    p.add_argument("--repo", required=True, help="the repository's URL (no credentials in it)")
    p.add_argument("--sha", required=True, help="the commit to start from (full hex id)")
    task = p.add_mutually_exclusive_group(required=True)
    task.add_argument("--task", help="what the agent should do, in plain language")
    task.add_argument("--task-file", type=Path, help="read the task from this file")
    p.add_argument("--model", required=True, help="a model alias of gatewayd's configuration")
    p.add_argument(
        "--policy",
        default=DEFAULT_AGENT_POLICY,
        help="the run's policy (default: the shipped 'agent' policy)",
    )
    p.add_argument(
        "--backend",
        choices=("overlay", "host"),
        default="overlay",
        help="the workspace backend (docs/workspaces.md); default overlay",
    )
    p.add_argument("--no-push", action="store_true", help="keep the patch; push nothing")
    p.add_argument("--pull-request", action="store_true", help="open a pull request too")
    p.add_argument("--max-turns", type=int, default=40, help="model turns at most (40)")
    p.add_argument("--max-tokens", type=int, default=400_000, help="tokens at most (400000)")
    p.add_argument(
        "--max-wall-s", type=float, default=1800.0, help="wall time at most, seconds (1800)"
    )
    p.add_argument("--max-memory-mb", type=int, default=2048, help="the sandbox's memory")
    shown = "the worker's" if max_patch_bytes is None else f"{max_patch_bytes >> 20} MiB"
    p.add_argument(
        "--max-patch-bytes",
        type=int,
        default=max_patch_bytes,
        help=f"file contents one patch may carry ({shown}); larger changes are left out and "
        "listed in the result's skipped",
    )
    p.add_argument(
        "--max-workspace-bytes",
        type=int,
        default=1 << 30,
        help="overlay backend: what the run may write in all, held on a private tmpfs "
        "(1 GiB; 0: no limit, on disk); past it, writes fail with ENOSPC",
    )
    p.add_argument("--actor", default="operator")
    p.add_argument("--tenant", default="local")


def main(args: argparse.Namespace) -> int:
    if args.agent_command != "run":
        return agent_scaleout.main(args)
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
        async with open_daemon(config, preload=True) as daemon:
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
