"""`gatewayd review replay`: recorded calls reviewed afresh under a policy's rules with
the configured model; agreement, false allows and denies, latency."""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path
from typing import TYPE_CHECKING

from gatewayd.cli.command import EXIT_FAILED, EXIT_OK, EXIT_USAGE
from gatewayd.cli.options import load_settings

if TYPE_CHECKING:
    from gatewayd.cli.command import Subparsers


def add_parsers(sub: Subparsers) -> None:
    review = sub.add_parser("review", help="evaluate review rules").add_subparsers(
        dest="review_command", required=True
    )
    replay = review.add_parser(
        "replay",
        help="review recorded calls (JSON lines: tool, args, optional expect) under a "
        "policy's rules with the configured model; report agreement, false allows and "
        "denies, latency; exit 1 on any disagreement or failed review",
    )
    replay.add_argument("calls", type=Path, metavar="CALLS.jsonl")
    replay.add_argument(
        "--policy", required=True, help="policy file, or the name of a shipped policy"
    )
    replay.add_argument(
        "--policy-dir",
        type=Path,
        action="append",
        default=[],
        help="directory searched for policies named without a path (repeatable)",
    )
    replay.add_argument(
        "--config",
        type=Path,
        default=None,
        help="gatewayd's configuration file (model aliases); default $GATEWAYD_CONFIG, "
        "else /etc/gatewayd/gatewayd.yaml when it exists",
    )
    replay.add_argument(
        "--concurrency", type=int, default=None, help="reviews at a time (1-64, default 4)"
    )
    replay.add_argument("--json", action="store_true", help="print the results and summary as JSON")


def main(args: argparse.Namespace) -> int:
    return _review_replay(args)


def _review_replay(args: argparse.Namespace) -> int:
    """`gatewayd review replay`: every recorded call reviewed afresh, a verdict table
    and the summary; EXIT_FAILED on a disagreement or a failed review, so CI can gate a
    rule-set change on it; EXIT_USAGE when the replay cannot start."""
    import shutil
    import time

    import trio

    from gatewayd import model_client
    from gatewayd.config import SHIPPED_POLICY_DIRS
    from gatewayd.policy import PolicyError
    from gatewayd.policyfile import PolicyLoader
    from gatewayd.review import replay
    from gatewayd.review.ruleset import RuleSet
    from gatewayd.tools import builtin_tools

    def usage(message: str) -> int:
        print(f"gatewayd review replay: {message}", file=sys.stderr)
        return EXIT_USAGE

    concurrency = replay.DEFAULT_CONCURRENCY if args.concurrency is None else args.concurrency
    if not 1 <= concurrency <= replay.MAX_CONCURRENCY:
        return usage(f"--concurrency must be 1..{replay.MAX_CONCURRENCY}, not {concurrency}")
    policy_dirs = tuple(args.policy_dir) or SHIPPED_POLICY_DIRS
    try:
        policy, policy_source = PolicyLoader(policy_dirs)(args.policy)
    except PolicyError as exc:
        return usage(f"invalid policy:\n{exc}")
    section = policy.review
    if section.mode != "llm":
        return usage(
            f"policy {policy.name} ({policy_source}) has review.mode {section.mode}; "
            "a replay evaluates a policy with review.mode: llm and a review.model"
        )
    try:
        settings = load_settings(args.config)
    except SystemExit as exc:  # a named configuration that is missing or invalid
        return usage(str(exc.code).removeprefix("gatewayd: "))
    alias = settings.models.get(section.model or "")
    if alias is None:
        known = ", ".join(sorted(settings.models)) or "none"
        return usage(
            f"policy {policy.name} reviews with model alias {section.model!r}, which "
            f"gatewayd's configuration does not define (known: {known}); give --config"
        )
    if alias.api_key_env is not None:
        from gatewayd.secrets import SecretError, read_secret

        try:  # where the daemon looks: the variable, then the systemd credential
            read_secret(alias.api_key_env, holds="its key")
        except SecretError as exc:
            return usage(f"model alias {section.model!r} has no key here: {exc}")
    try:
        calls = replay.load_calls(args.calls, tools=builtin_tools())
    except replay.CallsFileError as exc:
        return usage(f"refused the calls file (nothing was reviewed):\n{exc}")

    def progress(done: int, total: int) -> None:
        if total > replay.PROGRESS_EVERY and (done % replay.PROGRESS_EVERY == 0 or done == total):
            print(f"gatewayd review replay: {done}/{total} reviewed", file=sys.stderr)

    reviewer = replay.replay_reviewer(settings.models)
    # litellm's import takes seconds: paid before the clock starts, not counted as replay.
    model_client.preload()
    started = time.monotonic()
    results = trio.run(
        lambda: replay.replay_calls(
            calls, reviewer, section, concurrency=concurrency, on_progress=progress
        )
    )
    elapsed_s = time.monotonic() - started
    summary = replay.summarize_results(results)
    try:
        if args.json:
            document = {
                "policy": policy.name,
                "policySource": policy_source,
                "ruleset": RuleSet.from_section(section).digest,
                "model": section.model,
                "concurrency": concurrency,
                "elapsedS": round(elapsed_s, 3),
                "results": [replay.result_json(r) for r in results],
                "summary": replay.summary_json(summary),
            }
            print(json.dumps(document, indent=2))
        else:
            width = shutil.get_terminal_size((120, 24)).columns
            print(replay.render_table(results, width))
            print()
            print(
                f"policy {policy.name} ({policy_source}), model alias {section.model!r}, "
                f"{elapsed_s:.1f} s at concurrency {concurrency}"
            )
            print(replay.render_summary(summary))
    except BrokenPipeError:  # `... | head`: the reader has enough
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
    return EXIT_OK if summary.passed else EXIT_FAILED
