"""The hint of a sandboxed command: from gatewayd's own facts first, from stderr only
where the sandbox alone causes the message, and never a cause it cannot know. Pure and
table-driven; the same hints from inside real sandboxes: tests/integration/
test_exec_options.py."""

from __future__ import annotations

import signal
from dataclasses import replace

import pytest

from gatewayd.sandbox.hints import (
    HINT_SCAN_BYTES,
    CommandEnd,
    CommandNetworkFacts,
    HintFacts,
    command_hint,
)
from gatewayd.sandbox.limits import ErrorKind, LimitMechanism, SandboxLimits

NO_PROXY = CommandNetworkFacts(
    proxy=False, domains=(), source="network.allow_domains", fetch_domains=("example.org",)
)
PROXY = CommandNetworkFacts(
    proxy=True,
    domains=("example.org", "pypi.org"),
    source="network.allow_domains",
    fetch_domains=("example.org", "pypi.org"),
)
FACTS = HintFacts(
    limits=SandboxLimits(
        timeout_s=5,
        cpu_s=7,
        memory_bytes=256 << 20,
        max_processes=32,
        max_file_bytes=3 << 20,
        max_output_bytes=1000,
    ),
    run_timeout_s=600,
    memory_limit=LimitMechanism.CGROUP,
    network=NO_PROXY,
    writable=("/workspace (except /workspace/docs)", "/tmp"),
    visible=("/usr", "/bin", "/etc/passwd", "/etc/ssl/certs", "/tmp", "/workspace", "/data"),
    covered=("/workspace/apps",),
)


def end(
    stderr: bytes = b"",
    *,
    exit_code: int | None = 1,
    sig: int | None = None,
    error: ErrorKind | None = None,
    cut: bool = False,
) -> CommandEnd:
    return CommandEnd(
        exit_code=exit_code,
        signal=sig,
        error=error,
        stderr=stderr,
        stdout_truncated=cut,
        stderr_truncated=False,
    )


@pytest.mark.parametrize(
    ("ended", "facts", "phrases"),
    [
        (
            end(exit_code=None, sig=9, error=ErrorKind.TIMEOUT),
            FACTS,
            ("time limit of 5 s", "sandbox.timeout_s; a call may ask for up to 600 s"),
        ),
        (
            end(exit_code=None, sig=9, error=ErrorKind.OOM_KILLED),
            FACTS,
            ("memory limit of 256 MiB", "limits.maxMemoryMb"),
        ),
        (
            end(exit_code=None, sig=signal.SIGXCPU, error=ErrorKind.LIMIT_EXCEEDED),
            FACTS,
            ("CPU time limit of 7 s", "sandbox.cpu_s"),
        ),
        (
            end(exit_code=None, sig=signal.SIGXFSZ, error=ErrorKind.LIMIT_EXCEEDED),
            FACTS,
            ("file size limit of 3 MiB", "sandbox.max_file_mb"),
        ),
        (
            end(b"curl: (6) Could not resolve host: example.org\n"),
            FACTS,
            ("Network access is disabled in this sandbox", "cogni-tool exec http.fetch"),
        ),
        (
            end(b"socket.gaierror: [Errno -3] Temporary failure in name resolution"),
            replace(FACTS, network=PROXY),
            ("only through the egress proxy at http://127.0.0.1:3128", "example.org, pypi.org"),
        ),
        (
            end(b"curl: (56) CONNECT tunnel failed, response 403"),
            replace(FACTS, network=PROXY),
            ("proxy refused a connection", "may reach only example.org, pypi.org"),
        ),
        (
            end(b"curl: (7) Failed to connect to 1.1.1.1 port 80 after 0 ms: Couldn't connect"),
            FACTS,
            ("Network access is disabled",),
        ),
        (
            end(b"touch: cannot touch '/usr/x': Read-only file system"),
            FACTS,
            ("read-only in this sandbox", "writable: /workspace (except /workspace/docs), /tmp"),
        ),
        (
            end(b"sh: 1: Cannot fork\n"),
            FACTS,
            ("at most 32 processes and threads", "sandbox.max_processes"),
        ),
        (
            end(b"MemoryError"),
            replace(FACTS, memory_limit=LimitMechanism.RLIMIT),
            ("256 MiB of address space",),
        ),
        (
            end(exit_code=0, cut=True),
            FACTS,
            ("Output was cut at 1000 bytes (stdout", "sandbox.max_output_bytes"),
        ),
        (
            end(exit_code=None, sig=9, error=ErrorKind.TIMEOUT, cut=True),
            FACTS,
            ("time limit of 5 s", "Also: output was cut at 1000 bytes"),
        ),
    ],
)
def test_each_cause_is_named_with_its_rule_and_value(
    ended: CommandEnd, facts: HintFacts, phrases: tuple[str, ...]
) -> None:
    hint = command_hint(ended, facts)
    assert hint is not None and "\n" not in hint
    for phrase in phrases:
        assert phrase in hint, (phrase, hint)


@pytest.mark.parametrize(
    ("ended", "facts"),
    [
        # The command's own failure, or one the host could cause as well: no hint.
        (end(b"make: *** [all] Error 2"), FACTS),
        (end(b"open: Permission denied"), FACTS),
        (end(b"curl: (7) Failed to connect to 127.0.0.1 port 8080: Connection refused"), FACTS),
        (end(b"curl: (7) Failed to connect to localhost port 8080"), FACTS),
        # Missing beneath what the sandbox shows of the host: missing for real.
        (end(b"cat: /workspace/notes.txt: No such file or directory"), FACTS),
        (end(b"ls: cannot access '/etc/ssl/certs/x.pem': No such file or directory"), FACTS),
        (end(b"FileNotFoundError: [Errno 2] No such file or directory: '/data/x'"), FACTS),
        (end(b"cat: notes.txt: No such file or directory"), FACTS),  # relative: unknown
        # Where the sandbox's view is not a fixed list (an image's root): no claim.
        (end(b"cat: /home/u/x: No such file or directory"), replace(FACTS, visible=None)),
        # Memory held by a cgroup: a failed allocation is not the per-process limit.
        (end(b"MemoryError"), FACTS),
        # A command that succeeded, whatever it printed.
        (end(b"warning: Read-only file system, skipped cache", exit_code=0), FACTS),
        (end(b"Could not resolve host (retrying, then ok)", exit_code=0), FACTS),
        # Without the proxy, a 403 from a proxy is not ours to explain.
        (end(b"Received HTTP code 403 from proxy after CONNECT"), FACTS),
    ],
)
def test_no_hint_where_the_sandbox_is_not_known_to_be_the_cause(
    ended: CommandEnd, facts: HintFacts
) -> None:
    assert command_hint(ended, facts) is None


def test_a_narrowed_command_without_network_is_told_so_and_where_to_go() -> None:
    narrowed = replace(NO_PROXY, narrowed=True)
    hint = command_hint(end(b"Could not resolve host: x"), replace(FACTS, network=narrowed))
    assert hint is not None
    assert hint.startswith("Network access is disabled for this command (allowedDomains")
    no_fetch = replace(NO_PROXY, fetch_domains=())
    hint = command_hint(end(b"Could not resolve host: x"), replace(FACTS, network=no_fetch))
    assert hint == "Network access is disabled in this sandbox (it has no egress proxy)."


def test_only_the_end_of_a_flood_is_scanned() -> None:
    # An error message buried under more than the scan window is not looked at.
    flood = b"Read-only file system\n" + b"x" * HINT_SCAN_BYTES
    assert command_hint(end(flood), FACTS) is None
    assert command_hint(end(b"x" * HINT_SCAN_BYTES + b"Read-only file system"), FACTS)


def test_the_hint_names_at_most_a_few_domains() -> None:
    many = replace(PROXY, domains=tuple(f"d{i}.org" for i in range(20)))
    hint = command_hint(end(b"Could not resolve host"), replace(FACTS, network=many))
    assert hint is not None and "d7.org and 12 more" in hint and "d8.org" not in hint


def test_the_pids_cgroups_count_decides_the_process_limit_before_any_message() -> None:
    quiet = end(b"", exit_code=1)
    hit = replace(quiet, process_limit_hit=True)
    assert "at most 32 processes" in (command_hint(hit, FACTS) or "")
    # Counted and not hit: a fork refused for another reason is not ours to explain.
    not_hit = replace(end(b"fork: Resource temporarily unavailable"), process_limit_hit=False)
    assert command_hint(not_hit, FACTS) is None
    # Hit, but the command succeeded all the same (it retried): nothing to explain.
    assert command_hint(replace(hit, exit_code=0), FACTS) is None


@pytest.mark.parametrize(
    "stderr",
    [
        b"cat: /etc/shadow: No such file or directory",
        b"ls: cannot access '/home/u/.ssh/id_rsa': No such file or directory",
        b"FileNotFoundError: [Errno 2] No such file or directory: '/var/lib/secret'",
        b"sh: 1: cannot open /root/x: No such file",  # not the kernel's words: no claim
    ],
)
def test_a_path_the_sandbox_does_not_show_is_named_as_hidden(stderr: bytes) -> None:
    hint = command_hint(end(stderr), FACTS)
    if b"No such file or directory" not in stderr:
        assert hint is None
        return
    assert hint is not None and "is outside what this sandbox shows" in hint, hint
    assert "writable: /workspace (except /workspace/docs), /tmp" in hint


def test_the_apps_folder_is_named_as_hidden_and_a_crafted_path_is_shown_safely() -> None:
    hint = command_hint(end(b"cat: /workspace/apps/x/APP.md: No such file or directory"), FACTS)
    assert hint is not None and "apps folder" in hint
    hint = command_hint(end(b"cat: /home/\x1b[2Jevil: No such file or directory"), FACTS)
    assert hint is not None and "\x1b" not in hint


def test_a_timeout_the_call_asked_for_is_not_blamed_on_the_policy() -> None:
    """A command stopped at a shorter limit its call asked for (timeout_s) was stopped by
    that call's own choice, not by the policy's sandbox.timeout_s; at the run's own
    limit it was the policy's."""
    stopped = end(exit_code=None, sig=9, error=ErrorKind.TIMEOUT)
    hint = command_hint(stopped, FACTS)
    assert hint is not None and "time limit of 5 s" in hint
    assert "this call asked for" in hint and "timeout_s" in hint
    assert "5 s (the policy's" not in hint, hint
    at_run_limit = replace(FACTS, limits=replace(FACTS.limits, timeout_s=600))
    hint = command_hint(stopped, at_run_limit)
    assert hint is not None and "time limit of 600 s (the policy's sandbox.timeout_s)" in hint
    assert "asked for" not in hint
