"""`make demo`: a sandboxed agent script calling cogni-tool through `gatewayd run`,
with allowed and denied calls, then the audit trail and its verification.

(The OS sandbox itself arrives with issue 3; here the agent is a plain child process
whose only interface to the host is the same per-run socket the sandbox will use.)
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
    workspace = base / "workspace"
    workspace.mkdir()
    (workspace / "notes.md").write_text(
        "# Notes\n\n- the gateway checks every call\n- denials say what is allowed\n"
    )
    (workspace / "data.json").write_text('{"answer": 42}\n')
    state = base / "state"
    audit = state / "audit" / "audit.jsonl"
    gatewayd = str(BIN / "gatewayd")
    tools = ["time.now", "fs.read", "fs.write", "fs.edit", "fs.list"]

    step("gatewayd run: the agent's only way out is cogni-tool over its run's socket")
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
    cmd += ["--", sys.executable, str(ROOT / "demo" / "agent.py")]
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
