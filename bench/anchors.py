"""The anchors: ``/bin/true`` through other agent sandboxes on this host, measured side
by side in one process run, for docs/performance.md to set gatewayd's figures beside.

    .venv/bin/python bench/anchors.py [--iterations 100] [--warmup 5]
                                      [--prefix /opt/cogni-anchors] [--no-gatewayd]

Each round runs every anchor once, in a freshly shuffled order (a fixed seed), so drift
and after-effects hit all alike; the wall time of each start to its exit (``subprocess``
with the output discarded, or the control socket's answer) is recorded:

- ``plain``: ``/bin/true`` alone (Python can vfork: the floor of starting a process);
- ``bwrap``: minimal raw bubblewrap, ``bwrap --ro-bind / / --dev /dev --proc /proc
  --unshare-all --die-with-parent /bin/true`` (no seccomp filter, uid change, cgroup or
  rlimits: less than gatewayd's sandbox, see bench/sandbox_launch.py for that baseline);
- ``codex``: ``codex sandbox /bin/true`` from npm ``@openai/codex`` (its Linux sandbox:
  bubblewrap and seccomp, read-only file system, no network; ``codex sandbox linux
  CMD`` of older releases became ``codex sandbox CMD``), with a ``CODEX_HOME`` of its
  own (PREFIX/codex-home) so no user configuration changes it;
- ``srt``: ``srt --settings FILE /bin/true`` from npm ``@anthropic-ai/sandbox-runtime``
  (bubblewrap, seccomp, its proxies; needs socat and ripgrep), FILE denying the network
  (no allowed domain) and every write;
- ``gatewayd``: gatewayd itself, for the table beside them (``--no-gatewayd`` leaves it
  out): a real `gatewayd serve` with the OS sandbox (bench/many_runs.py's daemon: its
  own prefix, uids and state directory) and one live run; ``/bin/true`` through the
  control socket's exec (``POST /v1/runs/RUN/exec`` from this process: what a client
  library pays), and ``gw-cli``: the ``gatewayd exec`` command (a Python start each
  time, as ``codex sandbox`` and ``srt`` pay a Node start).

The npm anchors are looked for under PREFIX (``make bench-anchors-install`` puts them
there; nothing enters the checkout). An anchor that is not installed, or that does not
run ``/bin/true`` to exit 0 here, is skipped with a line saying why and how to install
it. Prints the median and p90 of each in ms and its ratio to raw bwrap and to plain
``/bin/true``; never asserts on time.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import shutil
import subprocess
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from http import HTTPStatus
from pathlib import Path
from typing import Final

sys.path.insert(0, str(Path(__file__).resolve().parent))

from harness import BIN, control, env_info, percentile
from many_runs import SUBPROCESS_ENV, daemon, exit_on_sigterm, make_site, run_request

TRUE: Final = "/bin/true"
BWRAP: Final = "/usr/bin/bwrap"
DEFAULT_PREFIX: Final = Path("/opt/cogni-anchors")
CODEX_PACKAGE: Final = "@openai/codex"
SRT_PACKAGE: Final = "@anthropic-ai/sandbox-runtime"
# A fixed seed: the shuffled orders are the same from run to run.
ORDER_SEED: Final = 5
# One start of an anchor gives up after this long: srt's first start takes about a
# second; a hung one must not hang the bench.
START_TIMEOUT_S: Final = 60.0
CODEX_HOME: Final = "codex-home"  # under the prefix
SRT_SETTINGS_FILE: Final = "srt-settings.json"  # under the prefix
# srt's settings: no network (an empty allow list denies every domain), no writes.
SRT_SETTINGS: Final[dict[str, dict[str, list[str]]]] = {
    "filesystem": {"denyRead": [], "allowWrite": [], "denyWrite": []},
    "network": {"allowedDomains": [], "deniedDomains": []},
}
RAW_BWRAP: Final = (
    BWRAP,
    "--ro-bind",
    "/",
    "/",
    "--dev",
    "/dev",
    "--proc",
    "/proc",
    "--unshare-all",
    "--die-with-parent",
    TRUE,
)


@dataclass(frozen=True, slots=True)
class Anchor:
    """One way to run /bin/true: ``run`` does it once (RuntimeError unless it exited 0);
    ``command`` says how, for the table."""

    name: str
    command: str
    run: Callable[[], None]


def process(
    name: str, argv: Sequence[str], env: dict[str, str] | None = None, *, shown: str = ""
) -> Anchor:
    """An anchor that is one process run to its exit, its output discarded; ``shown``
    (else ``argv``) is how the table writes it."""

    def run() -> None:
        proc = subprocess.run(
            argv,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            env=env,
            timeout=START_TIMEOUT_S,
            check=False,
        )
        if proc.returncode != 0:
            why = proc.stderr.decode(errors="replace").strip().splitlines()[-3:]
            raise RuntimeError(f"exited {proc.returncode}: {' / '.join(why)}")

    return Anchor(name, shown or " ".join(argv), run)


@contextlib.contextmanager
def gatewayd_anchors() -> Iterator[list[Anchor]]:
    """/bin/true in a live run of a real `gatewayd serve` (the OS sandbox on, its own
    prefix and uids: bench/many_runs.py's daemon): through the control socket's exec from
    this process, and through the `gatewayd exec` command (a Python start each time)."""
    site = make_site(1)
    try:
        with daemon(site):
            status, data = control(site.control, "POST", "/v1/runs", run_request(site, 0))
            if status != HTTPStatus.CREATED:
                raise RuntimeError(f"gatewayd refused the run: {status} {data}")
            run_id = data["run"]["runId"]

            def control_exec() -> None:
                target = f"/v1/runs/{run_id}/exec"
                status, data = control(site.control, "POST", target, {"command": [TRUE]})
                if status != HTTPStatus.OK or data["result"].get("exitCode") != 0:
                    raise RuntimeError(f"the exec failed: {status} {data}")

            state = str(site.base / "state")
            yield [
                Anchor("gatewayd", f"POST /v1/runs/RUN/exec {TRUE} (control socket)", control_exec),
                process(
                    "gw-cli",
                    [str(BIN / "gatewayd"), "exec", "--state-dir", state, run_id, "--", TRUE],
                    SUBPROCESS_ENV,
                    shown=f"gatewayd exec --state-dir STATE RUN -- {TRUE}",
                ),
            ]
    finally:
        shutil.rmtree(site.base, ignore_errors=True)


def install_command(prefix: Path, package: str) -> str:
    return f"npm install --prefix {prefix} {package}  (or: make bench-anchors-install)"


def anchors(prefix: Path) -> tuple[list[Anchor], list[str]]:
    """The anchors that run here, and a line for each that is skipped."""
    found = [process("plain", (TRUE,))]
    skipped: list[str] = []
    if os.path.exists(BWRAP):
        found.append(process("bwrap", RAW_BWRAP))
    else:
        skipped.append(f"bwrap: {BWRAP} not found (apt-get install bubblewrap)")
    codex = prefix / "node_modules" / ".bin" / "codex"
    if codex.exists():
        # Not under /tmp: codex refuses to put its helper links in a temporary directory
        # (and then cannot find its sandbox helper); a CODEX_HOME of its own, kept
        # beside the install as ~/.codex would be, never the user's configuration.
        home = prefix / CODEX_HOME
        home.mkdir(exist_ok=True)
        env = {**os.environ, "CODEX_HOME": str(home)}
        found.append(process("codex", (str(codex), "sandbox", TRUE), env))
    else:
        skipped.append(f"codex: not installed: {install_command(prefix, CODEX_PACKAGE)}")
    srt = prefix / "node_modules" / ".bin" / "srt"
    missing = [tool for tool in ("socat", "rg") if shutil.which(tool) is None]
    if not srt.exists():
        skipped.append(f"srt: not installed: {install_command(prefix, SRT_PACKAGE)}")
    elif missing:
        skipped.append(f"srt: needs {' and '.join(missing)} (apt-get install socat ripgrep)")
    else:
        # Beside the install (rewritten each time), so the printed command is the same
        # from run to run.
        settings = prefix / SRT_SETTINGS_FILE
        settings.write_text(json.dumps(SRT_SETTINGS))
        found.append(process("srt", (str(srt), "--settings", str(settings), TRUE)))
    return found, skipped


def start(anchor: Anchor) -> float:
    """One start to exit; its wall time in seconds."""
    started = time.perf_counter()
    anchor.run()
    return time.perf_counter() - started


def working(found: list[Anchor], skipped: list[str]) -> list[Anchor]:
    """The anchors that run /bin/true to exit 0 once; the others are skipped, saying why."""
    ok: list[Anchor] = []
    for anchor in found:
        try:
            start(anchor)
        except (RuntimeError, OSError, subprocess.TimeoutExpired) as exc:
            skipped.append(f"{anchor.name}: does not run here: {exc}")
        else:
            ok.append(anchor)
    return ok


def rounds(found: list[Anchor], warmup: int, iterations: int) -> dict[str, list[float]]:
    rng = random.Random(ORDER_SEED)
    samples: dict[str, list[float]] = {anchor.name: [] for anchor in found}
    for i in range(warmup + iterations):
        order = list(found)
        rng.shuffle(order)
        for anchor in order:
            elapsed = start(anchor)
            if i >= warmup:
                samples[anchor.name].append(elapsed)
    return samples


def report(samples: dict[str, list[float]], found: list[Anchor], skipped: list[str]) -> None:
    bwrap = samples.get("bwrap")
    plain = samples["plain"]
    print(f"{'anchor':<8}{'median':>9}{'p90':>9}{'x bwrap':>9}{'x plain':>9}  (ms)  command")
    for anchor in found:
        values = samples[anchor.name]
        median = percentile(values, 50)
        ratio = f"{median / percentile(bwrap, 50):9.2f}" if bwrap else f"{'':>9}"
        print(
            f"{anchor.name:<8}{median * 1000:9.2f}{percentile(values, 90) * 1000:9.2f}{ratio}"
            f"{median / percentile(plain, 50):9.1f}  {anchor.command}"
        )
    for line in skipped:
        print(f"skipped {line}")


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    parser.add_argument("--iterations", type=int, default=100, help="timed rounds (100)")
    parser.add_argument("--warmup", type=int, default=5, help="untimed rounds first (5)")
    parser.add_argument(
        "--prefix",
        type=Path,
        default=Path(os.environ.get("COGNI_ANCHORS", DEFAULT_PREFIX)),
        help=f"the npm prefix holding the anchors ($COGNI_ANCHORS, else {DEFAULT_PREFIX})",
    )
    parser.add_argument("--no-gatewayd", action="store_true", help="leave out gatewayd's own rows")
    args = parser.parse_args(argv)
    if args.iterations < 1 or args.warmup < 0:
        parser.error("--iterations must be >= 1 and --warmup >= 0")
    exit_on_sigterm()
    with contextlib.ExitStack() as stack:
        found, skipped = anchors(args.prefix)
        if args.no_gatewayd:
            pass
        elif os.geteuid() != 0:
            skipped.append("gatewayd: its OS sandbox needs root")
        else:
            try:
                found += stack.enter_context(gatewayd_anchors())
            except RuntimeError as exc:  # it did not start, or refused the run
                skipped.append(f"gatewayd: {exc}")
        found = working(found, skipped)
        print(
            f"/bin/true through each anchor, {args.iterations} rounds in shuffled order "
            f"after {args.warmup} warm-up rounds; {env_info()}, "
            f"load average {os.getloadavg()[0]:.1f}"
        )
        samples = rounds(found, args.warmup, args.iterations)
    report(samples, found, skipped)
    return 0


if __name__ == "__main__":
    sys.exit(main())
