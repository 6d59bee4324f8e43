"""`make demo`: a sandboxed agent script calling cogni-tool through `gatewayd run`,
with allowed and denied calls, then the audit trail and its verification.

The agent runs inside the run's OS sandbox (bubblewrap, a loopback-only network
namespace, its own uid, seccomp), with the system python3, from a copy in its workspace.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
BIN = Path(sys.executable).parent


def step(title: str) -> None:
    print(f"\n=== {title} ===", flush=True)


def main() -> int:
    base = Path(tempfile.mkdtemp(prefix="cogni-demo-"))
    # The sandbox runs as an unprivileged uid of its own: it must pass through to its
    # workspace and socket (o+x), though it may not list what else is here.
    base.chmod(0o711)
    workspace = base / "workspace"
    workspace.mkdir()
    shutil.copy(ROOT / "demo" / "agent.py", workspace / "agent.py")
    (workspace / "notes.md").write_text(
        "# Notes\n\n- the gateway checks every call\n- denials say what is allowed\n"
    )
    (workspace / "data.json").write_text('{"answer": 42}\n')
    state = base / "state"
    audit = state / "audit" / "audit.jsonl"
    gatewayd = str(BIN / "gatewayd")
    tools = ["time.now", "fs.read", "fs.write", "fs.edit", "fs.list"]

    step("gatewayd run: the agent, in its sandbox, has one way out: cogni-tool")
    cmd = [
        gatewayd,
        "run",
        "--state-dir",
        str(state),
        "--workspace",
        str(workspace),
        "--policy",
        str(ROOT / "policies" / "examples" / "demo.yaml"),
    ]
    for t in tools:  # the run spec narrows the policy: fs.stat is allowed by it, not by the run
        cmd += ["--tool", t]
    cmd += ["--", "python3", "agent.py"]
    rc = subprocess.run(cmd, check=False).returncode
    if rc != 0:
        print(f"demo: the agent run failed with exit {rc}", file=sys.stderr)
        return 1

    step("the audit trail (gatewayd audit show)")
    subprocess.run([gatewayd, "audit", "show", str(audit)], check=True)
    step("denied calls only (gatewayd audit show --denied)")
    subprocess.run([gatewayd, "audit", "show", "--denied", str(audit)], check=True)
    step("hash chain (gatewayd audit verify)")
    verify = subprocess.run([gatewayd, "audit", "verify", str(audit)], check=False)
    step("what the agent wrote, on the host")
    print((workspace / "out" / "summary.md").read_text())
    print(f"demo files are in {base} (removed now)")
    shutil.rmtree(base, ignore_errors=True)
    return verify.returncode


if __name__ == "__main__":
    sys.exit(main())
