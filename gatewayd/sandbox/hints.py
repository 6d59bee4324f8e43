"""One line telling whoever ran a command why the *sandbox* made it fail, and what to use
instead: the ``hint`` of ``sandbox.exec``'s result and of the control socket's exec.

A command in the sandbox fails the way the kernel lets it: ``curl`` says "Could not
resolve host", ``touch`` says "Read-only file system". An agent reading that cannot tell
a broken command from a sandbox rule; the hint says which rule, with its value, and the
way that does work (the egress proxy and its domains, ``cogni-tool exec http.fetch``,
the writable paths, a shorter command).

Rule: a hint is never wrong about the cause. So it comes first from what gatewayd did
or set itself (the timeout it enforced, the cgroup's OOM kill, the signal of an rlimit
it set, the output it cut, whether the command had a network namespace with a proxy and
which domains that proxy allows), and only then from the command's stderr, for errors
whose cause the sandbox fixes: in a network namespace with nothing but loopback a name
lookup *always* fails, a read-only mount *always* says EROFS, a ``fork`` refused with
EAGAIN is the process limit. A message the sandbox could not have caused alone (a
permission denied, a file missing where the sandbox shows the host's) gets no hint; a
file missing where the sandbox shows nothing of the host does, whatever the host has
there (the hint never says whether the host has it).

Pure: the facts and the captured output in, a line or None out. Nothing here reads a
file or a process.
"""

from __future__ import annotations

import posixpath
import re
import signal
from dataclasses import dataclass
from typing import Final

from gatewayd.policy.paths import shown
from gatewayd.sandbox.limits import ErrorKind, LimitMechanism, SandboxLimits

_MIB: Final = 1024 * 1024
# Errors are printed last: the end of stderr is where they are, and scanning at most
# this much keeps a hint cheap whatever the output limit is.
HINT_SCAN_BYTES: Final = 64 * 1024
# A hint names the domains a command may reach; past this many it says how many more.
HINT_MAX_DOMAINS: Final = 8
# How a command's proxy is reached inside the sandbox (cogni-tool's bridge).
PROXY_URL: Final = "http://127.0.0.1:3128"

# What resolvers, curl, wget, Python, Node, Go, git and pip print when a name cannot be
# looked up or no route leads out: in a namespace with loopback only, that is the sandbox.
_NO_NETWORK: Final = re.compile(
    rb"could not resolve host|temporary failure in name resolution|name or service not "
    rb"known|no address associated with hostname|unable to resolve host address|"
    rb"failed to resolve|getaddrinfo (?:enotfound|eai_again)|nodename nor servname|"
    rb"network is unreachable|no route to host|name resolution failed|"
    rb"could not resolve proxy|lookup [^\s]+ on [^\s]+: |server misbehaving|"
    # curl's connect to an address (never loopback: a local server may just be down)
    rb"failed to connect to (?!localhost|127\.|::1|\[::1\])[^\s]+ port",
    re.IGNORECASE,
)
# What clients print when the proxy answers a CONNECT or a request with 403 (the proxy
# refuses a host, port or address off the policy's list with 403, and nothing else does).
_PROXY_REFUSED: Final = re.compile(
    rb"connect tunnel failed, response 403|received http code 403 from proxy|"
    rb"tunnel connection failed: 403|proxy ?error.{0,80}403|403 forbidden.{0,80}proxy",
    re.IGNORECASE | re.DOTALL,
)
_READ_ONLY: Final = re.compile(rb"read-only file system|\berofs\b", re.IGNORECASE)
# fork/clone refused with EAGAIN: the process (task) limit, where the sandbox sets one.
_FORK_REFUSED: Final = re.compile(
    rb"(?:fork|clone|vfork)[^\n]{0,40}resource temporarily unavailable|can't start new "
    rb"thread|cannot fork|pthread_create failed|unable to create native thread",
    re.IGNORECASE,
)
# A missing path as tools report it: `cat: /x: No such...`, `ls: cannot access '/x': No
# such...`, Python's `No such file or directory: '/x'`. Absolute paths only: a relative
# one says nothing of what the sandbox shows.
_MISSING_PATH: Final = re.compile(
    rb"'?(/[^\s'\":]{1,512})'?: no such file or directory|"
    rb"no such file or directory: '(/[^'\n]{1,512})'",
    re.IGNORECASE,
)
# An allocation refused under RLIMIT_AS (the sandbox's per-process address space limit).
_NO_MEMORY: Final = re.compile(
    rb"cannot allocate memory|memoryerror|std::bad_alloc|out of memory|"
    rb"javascript heap out of memory",
    re.IGNORECASE,
)


@dataclass(frozen=True, slots=True, kw_only=True)
class CommandNetworkFacts:
    """How a command could reach the network, as gatewayd set it up.

    ``proxy``: an egress proxy was reachable at :data:`PROXY_URL` (the run's, or the
    command's own); ``domains``: what that proxy allows (empty without one), and
    ``source``: where that list comes from, as a message names it
    (``network.allow_domains`` or ``this command's allowedDomains``). ``fetch_domains``:
    what ``http.fetch`` reaches for the run (its policy's list), for the way that works
    without a proxy; ``narrowed``: the command asked for a narrower network than the run's.
    """

    proxy: bool
    domains: tuple[str, ...]
    source: str
    fetch_domains: tuple[str, ...]
    narrowed: bool = False


@dataclass(frozen=True, slots=True, kw_only=True)
class HintFacts:
    """What gatewayd knows about one command: the limits it applied (``limits``), the
    run's own command timeout (``run_timeout_s``: a call may ask for less, never more),
    how memory was limited, its network, and the paths a command may write
    (visible, in the order a message lists them)."""

    limits: SandboxLimits
    run_timeout_s: float
    memory_limit: LimitMechanism
    network: CommandNetworkFacts
    writable: tuple[str, ...]
    # What the sandbox shows of the file system, as visible paths (each a directory or
    # file bound or made there), and the trees it covers with an empty directory; None:
    # not known (a sandbox on an image shows whatever the image holds).
    visible: tuple[str, ...] | None = None
    covered: tuple[str, ...] = ()


@dataclass(frozen=True, slots=True, kw_only=True)
class CommandEnd:
    """How the command ended, as the launcher read it (an ExecResult's facts)."""

    exit_code: int | None
    signal: int | None
    error: ErrorKind | None
    stderr: bytes
    stdout_truncated: bool
    stderr_truncated: bool
    # The command's pids cgroup's word: a fork refused at its limit (True), none
    # refused (False), or no such cgroup (None: the stderr pattern decides).
    process_limit_hit: bool | None = None

    @property
    def failed(self) -> bool:
        return self.exit_code != 0 or self.signal is not None or self.error is not None


def command_hint(end: CommandEnd, facts: HintFacts) -> str | None:
    """The one-line hint for a command that ended as ``end`` under ``facts``, or None.

    At most one cause is named (the first that holds: a limit gatewayd enforced or
    counted, then the network, a read-only path, the process limit where no cgroup
    counts it, an address-space limit); output cut at the limit is added to it, or is
    the hint of a command that succeeded."""
    cause = _limit_hint(end, facts) or (_stderr_hint(end, facts) if end.failed else None)
    cut = _truncation_hint(end, facts)
    if cause and cut:
        return f"{cause} Also: {cut[0].lower()}{cut[1:]}"
    return cause or cut


def _limit_hint(end: CommandEnd, facts: HintFacts) -> str | None:
    limits = facts.limits
    if end.error is ErrorKind.TIMEOUT:
        if limits.timeout_s < facts.run_timeout_s:
            # Shorter than the run's own limit: only the call's timeout_s makes it so.
            return (
                f"The sandbox stopped the command at its time limit of {limits.timeout_s:g} "
                "s, which this call asked for (timeout_s; the run's limit is the policy's "
                f"sandbox.timeout_s; a call may ask for up to {facts.run_timeout_s:g} s); "
                "ask for more time, or split the work into shorter commands."
            )
        return (
            f"The sandbox stopped the command at its time limit of {limits.timeout_s:g} s "
            "(the policy's sandbox.timeout_s); split the work into shorter commands or make "
            "it faster."
        )
    if end.error is ErrorKind.OOM_KILLED:
        return (
            f"The sandbox killed the command at its memory limit of "
            f"{limits.memory_bytes // _MIB} MiB (the run's limits.maxMemoryMb, all its "
            "processes together); use less memory: fewer parallel jobs, smaller inputs."
        )
    if end.error is ErrorKind.LIMIT_EXCEEDED and end.signal == signal.SIGXCPU:
        return (
            f"The sandbox stopped the command at its CPU time limit of {limits.cpu_s} s "
            "(the policy's sandbox.cpu_s); do less work per command."
        )
    if end.error is ErrorKind.LIMIT_EXCEEDED and end.signal == signal.SIGXFSZ:
        return (
            f"The sandbox stopped the command when a file it wrote reached the file size "
            f"limit of {limits.max_file_bytes // _MIB} MiB (the policy's "
            "sandbox.max_file_mb); write smaller files."
        )
    if end.failed and end.process_limit_hit:
        return _process_limit_hint(facts)
    return None


def _hidden_path(tail: bytes, facts: HintFacts) -> str | None:
    """The hint for a missing path the sandbox does not show at all (outside everything
    it binds, or in a tree it covers), whatever the host has there: the sandbox is why
    it is missing either way. A path beneath what it shows is missing for real: no hint."""
    if facts.visible is None:
        return None
    for match in _MISSING_PATH.finditer(tail):
        raw = match.group(1) or match.group(2)
        path = posixpath.normpath(raw.decode("utf-8", "replace"))
        if any(_within(path, tree) for tree in facts.covered):
            return (
                f"'{shown(path)}' is hidden from every command of every run (the "
                "workspace's apps folder); nothing there can be read or written."
            )
        if any(_within(path, root) or _within(root, path) for root in facts.visible):
            continue
        return (
            f"'{shown(path)}' is outside what this sandbox shows: commands see the "
            f"workspace, the policy paths, the system directories (/usr, part of /etc) and "
            f"/tmp, nothing else of the host; writable: {', '.join(facts.writable)}. A "
            "file elsewhere needs a policy path from the operator."
        )
    return None


def _within(path: str, root: str) -> bool:
    return root in ("/", path) or path.startswith(root + "/")


def _process_limit_hint(facts: HintFacts) -> str:
    return (
        f"The sandbox allows at most {facts.limits.max_processes} processes and threads at "
        "once (the policy's sandbox.max_processes); a new one was refused: run fewer in "
        "parallel."
    )


def _stderr_hint(end: CommandEnd, facts: HintFacts) -> str | None:
    tail = end.stderr[-HINT_SCAN_BYTES:]
    net = facts.network
    if net.proxy and _PROXY_REFUSED.search(tail):
        return (
            f"The sandbox's egress proxy refused a connection: this command may reach "
            f"only {_domains(net.domains)} ({net.source}); the audit log's egress entries "
            "say why each was refused."
        )
    if _NO_NETWORK.search(tail):
        return _network_hint(net)
    if _READ_ONLY.search(tail):
        return (
            "That path is read-only in this sandbox (system directories, read-only policy "
            f"paths and everything outside the writable ones); writable: "
            f"{', '.join(facts.writable) or 'none'}."
        )
    # With a pids cgroup its counter has answered already (_limit_hint); without one,
    # a fork refused with EAGAIN can only be RLIMIT_NPROC, the sandbox's limit.
    if end.process_limit_hit is None and _FORK_REFUSED.search(tail):
        return _process_limit_hint(facts)
    hidden = _hidden_path(tail, facts)
    if hidden is not None:
        return hidden
    if facts.memory_limit is LimitMechanism.RLIMIT and _NO_MEMORY.search(tail):
        return (
            f"The sandbox limits each process to {facts.limits.memory_bytes // _MIB} MiB of "
            "address space (the run's limits.maxMemoryMb); an allocation past it fails."
        )
    return None


def _network_hint(net: CommandNetworkFacts) -> str:
    if net.proxy:
        return (
            "This sandbox has no direct network: programs reach "
            f"{_domains(net.domains)} ({net.source}) only through the egress proxy at "
            f"{PROXY_URL} (HTTP_PROXY and HTTPS_PROXY point there); this program did not "
            "use it."
        )
    # The way without a proxy, only when the run may take it (http.fetch allowed, some
    # domain to reach): a hint pointing at a tool the run may not call would mislead.
    fetch = (
        f'; use `cogni-tool exec http.fetch \'{{"url": "https://..."}}\'` for '
        f"{_domains(net.fetch_domains)} (network.allow_domains)"
        if net.fetch_domains
        else ""
    )
    if net.narrowed:
        return f"Network access is disabled for this command (allowedDomains is empty){fetch}."
    return f"Network access is disabled in this sandbox (it has no egress proxy){fetch}."


def _truncation_hint(end: CommandEnd, facts: HintFacts) -> str | None:
    cut = [
        name
        for name, on in (("stdout", end.stdout_truncated), ("stderr", end.stderr_truncated))
        if on
    ]
    if not cut:
        return None
    return (
        f"Output was cut at {facts.limits.max_output_bytes} bytes ({' and '.join(cut)}; the "
        "policy's sandbox.max_output_bytes); write long output to a file under /workspace "
        "and read it in parts."
    )


def _domains(domains: tuple[str, ...]) -> str:
    if not domains:
        return "no host"
    listed = ", ".join(domains[:HINT_MAX_DOMAINS])
    more = len(domains) - HINT_MAX_DOMAINS
    return f"{listed} and {more} more" if more > 0 else listed
