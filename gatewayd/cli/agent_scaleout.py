"""``gatewayd agent submit|status|result|cancel``: agent runs as Temporal workflows.

``submit`` takes the task options of ``gatewayd agent run`` and prints the workflow id
(stdout, alone, for scripts); the run happens on whichever gatewayd worker polls the
task queue (docs/scale-out.md). No credential is read or sent: the workers' hosts hold
the git token and the model keys. ``status``, ``result`` and ``cancel`` take that id and
print JSON. The parsers are :mod:`gatewayd.cli.agent`'s; the Temporal calls are
:mod:`gatewayd.scaleout.client`'s, each in one ``asyncio.run`` (the SDK is asyncio's).

Exit status: 0 on success (``result``: the run succeeded), 1 when Temporal refused,
failed or could not be reached, the run is unknown, unfinished (``result`` without
``--wait``), already ended (``cancel``) or failed (``result``), 2 for a usage error.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
from typing import TYPE_CHECKING, Any, NoReturn

from gatewayd.cli.command import EXIT_FAILED, EXIT_OK, EXIT_USAGE

if TYPE_CHECKING:
    from gatewayd.scaleout.submission import AgentSubmission, TemporalTarget


def main(args: argparse.Namespace) -> int:
    command = f"gatewayd agent {args.agent_command}"
    target = _target(args, command)
    if target is None:
        return EXIT_USAGE
    if args.agent_command == "submit":
        submission = _submission(args, command)
        if submission is None:
            return EXIT_USAGE
        return _call(command, target, submission)
    wait = args.agent_command == "result" and args.wait
    timeout_s = args.timeout if wait else None
    if timeout_s is not None and not timeout_s > 0:
        print(f"{command}: --timeout must be a positive number of seconds", file=sys.stderr)
        return EXIT_USAGE
    return _call(
        command, target, None, workflow_id=args.workflow_id, wait=wait, timeout_s=timeout_s
    )


def _target(args: argparse.Namespace, command: str) -> TemporalTarget | None:
    """Where to submit: the options, else the configuration's settings (file and
    ``GATEWAYD_TEMPORAL_*`` variables)."""
    from gatewayd.cli.options import load_settings
    from gatewayd.scaleout.submission import TemporalTarget

    config = load_settings(args.config)
    address = args.temporal or config.temporal_address
    if not address:
        print(
            f"{command}: no Temporal address: give --temporal HOST:PORT, or set "
            "temporal_address in gatewayd's configuration ($GATEWAYD_TEMPORAL_ADDRESS)",
            file=sys.stderr,
        )
        return None
    return TemporalTarget(
        address=address,
        namespace=args.namespace or config.temporal_namespace,
        task_queue=getattr(args, "task_queue", None) or config.temporal_task_queue,
    )


def _submission(args: argparse.Namespace, command: str) -> AgentSubmission | None:
    """The run to submit, checked as the control socket checks a body; None (the
    problems printed) when it is refused."""
    import pydantic

    from gatewayd.runs.model import format_validation_error
    from gatewayd.scaleout.submission import AgentSubmission, wall_time_limit

    try:
        text = args.task if args.task is not None else args.task_file.read_text()
    except (OSError, UnicodeDecodeError) as exc:
        print(f"{command}: cannot read --task-file: {exc}", file=sys.stderr)
        return None
    limits: dict[str, int] = {
        "maxTurns": args.max_turns,
        "maxTokens": args.max_tokens,
        "wallTimeSec": wall_time_limit(args.max_wall_s),
        "maxMemoryMb": args.max_memory_mb,
        "maxWorkspaceBytes": args.max_workspace_bytes,
    }
    if args.max_patch_bytes is not None:
        limits["maxPatchBytes"] = args.max_patch_bytes
    try:
        return AgentSubmission.model_validate(
            {
                # The operator of this host submits: the system grant note 004 asks for.
                "grant": {"allowSandbox": True},
                "repo": args.repo,
                "sha": args.sha,
                "taskInput": text,
                "model": args.model,
                "policy": args.policy,
                "actorId": args.actor,
                "tenantId": args.tenant,
                "limits": limits,
                "backend": args.backend,
                "push": not args.no_push,
                "branch": args.branch,
                "pullRequest": args.pull_request,
            }
        )
    except pydantic.ValidationError as exc:
        print(f"{command}: {format_validation_error(exc)}", file=sys.stderr)
        return None


def _call(
    command: str,
    target: TemporalTarget,
    submission: AgentSubmission | None,
    *,
    workflow_id: str = "",
    wait: bool = False,
    timeout_s: float | None = None,
) -> NoReturn:
    from gatewayd.scaleout import client
    from gatewayd.scaleout.submission import AgentRunsError, ErrorKind

    async def go() -> Any:
        connected = await client.connect(target)
        if submission is not None:
            return await client.submit(connected, target, submission)
        if command.endswith("status"):
            return await client.status(connected, target, workflow_id)
        if command.endswith("cancel"):
            return await client.cancel(connected, target, workflow_id)
        return await asyncio.wait_for(
            client.result(connected, target, workflow_id, wait=wait), timeout_s
        )

    try:
        answer = asyncio.run(go())
    except AgentRunsError as exc:
        print(f"{command}: {exc.message}", file=sys.stderr)
        _exit_now(EXIT_USAGE if exc.kind is ErrorKind.BAD_REQUEST else EXIT_FAILED)
    except TimeoutError:
        print(
            f"{command}: agent run {workflow_id} had not ended after --timeout "
            f"{timeout_s:g} s; it goes on (gatewayd agent status {workflow_id})",
            file=sys.stderr,
        )
        _exit_now(EXIT_FAILED)
    if submission is not None:
        print(
            f"{command}: submitted to {target.address} (namespace {target.namespace}, task "
            f"queue {target.task_queue}); follow it with gatewayd agent status {answer}",
            file=sys.stderr,
        )
        print(answer)
        _exit_now(EXIT_OK)
    print(json.dumps(answer, indent=2))
    _exit_now(EXIT_OK if answer.get("ok") else EXIT_FAILED)


def _exit_now(status: int) -> NoReturn:
    """End the process once its output is out, skipping the interpreter's teardown:
    the Temporal SDK's Rust threads outlive the event loop, and about one exit in three
    after a workflow start aborts there ("PyGILState_Release: thread state must be
    current", a known crash of the SDK; measured here: 6 of 20 `agent submit` runs).
    Nothing of this command is left to tear down: its files are closed, its output is
    flushed below."""
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (BrokenPipeError, ValueError):  # a reader gone (`| head`), a closed stream
            status = status or EXIT_FAILED
    os._exit(status)
