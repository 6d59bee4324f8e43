"""A readable summary of a validated policy, for ``gatewayd policy check FILE``."""

from __future__ import annotations

from gatewayd.policy.model import PathRule, Policy


def _path_line(name: str, rule: PathRule) -> str:
    if rule.is_absolute:
        host = f"host {rule.root}"
    else:
        host = "the workspace" if rule.root == "." else f"workspace/{rule.root}"
    mode = "read-write" if rule.mode == "rw" else "read-only"
    suffixes = ", ".join(rule.suffixes) if rule.suffixes else "any"
    size = f"{rule.max_file_bytes} bytes" if rule.max_file_bytes is not None else "no limit"
    return (
        f"  {name}: {rule.visible_root} ({host}), {mode}\n"
        f"    suffixes: {suffixes}; max file size: {size}"
    )


def summarize(policy: Policy, source: str) -> str:
    """A multi-line, human summary of ``policy`` (loaded from ``source``)."""
    lines = [f"policy {policy.name} (version {policy.version}) from {source}"]
    if policy.description:
        lines.append(f"  {policy.description.strip()}")
    allow = policy.tools.allow
    lines.append("tools: " + (", ".join(allow) if allow else "none (deny all)"))
    paths = policy.filesystem.paths
    if paths:
        lines.append("paths (as the sandbox sees them):")
        lines.extend(_path_line(name, rule) for name, rule in paths.items())
    else:
        lines.append("paths: none (no file is reachable)")
    limits = policy.limits
    lines += [
        "limits:",
        f"  call timeout: {limits.call_timeout_s:g} s",
        f"  max output: {limits.max_output_bytes} bytes per response value",
        f"  rate: {limits.calls_per_second:g} calls/s, burst {limits.burst}",
        f"  concurrent calls: {limits.max_concurrent_calls}",
    ]
    box = policy.sandbox
    lines += [
        "sandbox:",
        "  OS sandbox: "
        + ("required" if policy.require_os_sandbox else "optional (runs degraded without it)"),
        "  host variables passed: "
        + (", ".join(policy.env.allow) if policy.env.allow else "none (LANG, TERM only)"),
        f"  per command: {box.timeout_s:g} s wall, {box.cpu_s} s CPU, {box.max_processes} "
        f"processes, {box.max_file_mb} MiB per file, {box.max_open_files} open files, "
        f"{box.max_output_bytes} bytes of output kept, {box.tmp_mb} MiB each for /tmp "
        "and /dev/shm",
    ]
    review = policy.review
    if review.mode == "off" and not review.structured:
        lines.append("review: off")
    else:
        tools = ", ".join(review.tools) if review.tools is not None else "every tool"
        if review.mode != "llm":
            tools = "none (structured rules only)"
        model = f" by model {review.model}, {review.timeout_s:g} s timeout" if review.model else ""
        lines += [
            f"review: {review.mode}{model}",
            f"  reviewed tools: {tools}",
            f"  rules: {len(review.rules.allow)} allow, {len(review.rules.deny)} deny, "
            f"{len(review.structured)} structured",
        ]
    return "\n".join(lines)
