"""`make demo`: a sandboxed agent script calling cogni-tool through `gatewayd run`,
with allowed and denied calls, one of them prompting an app (the note taker, installed
into the workspace first) whose own calls are reviewed against its rules, then the audit
trail and its verification. The run works on an overlay of the workspace (the default
mode): its changes are shown (`gatewayd workspace diff`), then committed to the workspace
(`gatewayd workspace commit`).

The agent runs inside the run's OS sandbox (bubblewrap, a loopback-only network
namespace, its own uid, seccomp), with the system python3, from a copy in its workspace.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
BIN = Path(sys.executable).parent
sys.path.insert(0, str(ROOT / "demo"))

import scripted_model  # noqa: E402  (beside this script, not a package)

MODEL_KEY_ENV = "COGNI_DEMO_MODEL_KEY"
# How `gatewayd run` names its run on stderr when it starts.
RUN_STARTED = re.compile(r"run ([0-9a-f]{32}) started")


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
    tools = ["time.now", "fs.read", "fs.write", "fs.edit", "fs.list", "app_note_taker"]
    # No real model is reachable here: a scripted one on loopback plays the app's model
    # and its reviewer (demo/scripted_model.py).
    server, api_base = scripted_model.start()
    config = base / "gatewayd.yaml"
    config.write_text(
        "models:\n"
        + "".join(
            f"  {alias}:\n    provider: openai\n    model: demo\n"
            f"    api_base: {api_base}\n    api_key_env: {MODEL_KEY_ENV}\n"
            for alias in ("demo-model", "reviewer")
        )
    )
    os.environ[MODEL_KEY_ENV] = "sk-demo-not-a-real-key"

    step("gatewayd apps install: the note taker app, into the workspace's apps/ folder")
    subprocess.run(
        [
            gatewayd,
            "apps",
            "install",
            str(ROOT / "apps" / "examples" / "note-taker"),
            "--workspace",
            str(workspace),
            "--state-dir",
            str(state),
        ],
        check=True,
    )

    step("gatewayd run: the agent, in its sandbox, has one way out: cogni-tool")
    cmd = [
        gatewayd,
        "run",
        "--state-dir",
        str(state),
        "--config",
        str(config),
        "--workspace",
        str(workspace),
        "--policy",
        str(ROOT / "policies" / "examples" / "demo-apps.yaml"),
    ]
    for t in tools:  # the run spec narrows the policy: fs.stat is allowed by it, not by the run
        cmd += ["--tool", t]
    cmd += ["--", "python3", "agent.py"]
    # gatewayd's own lines are shown as they come; the run id is read from them.
    run = subprocess.Popen(cmd, stderr=subprocess.PIPE, text=True)
    run_id = None
    assert run.stderr is not None
    for line in run.stderr:
        sys.stderr.write(line)
        found = RUN_STARTED.search(line)
        run_id = run_id or (found.group(1) if found else None)
    rc = run.wait()
    server.shutdown()
    if rc != 0 or run_id is None:
        print(f"demo: the agent run failed with exit {rc}", file=sys.stderr)
        return 1

    step("the audit trail (gatewayd audit show)")
    subprocess.run([gatewayd, "audit", "show", str(audit)], check=True)
    step("the app's invocation alone (gatewayd audit show --app note-taker)")
    subprocess.run([gatewayd, "audit", "show", "--app", "note-taker", str(audit)], check=False)
    step("denied calls only (gatewayd audit show --denied)")
    subprocess.run([gatewayd, "audit", "show", "--denied", str(audit)], check=True)
    step("hash chain (gatewayd audit verify)")
    verify = subprocess.run([gatewayd, "audit", "verify", str(audit)], check=False)
    store = ["--state-dir", str(state), "--config", str(config)]
    step("the run's changes, kept apart from the workspace (gatewayd workspace diff)")
    subprocess.run([gatewayd, "workspace", "diff", *store, run_id], check=True)
    step("applied to the workspace (gatewayd workspace commit)")
    subprocess.run([gatewayd, "workspace", "commit", *store, run_id], check=True)
    step("what the agent wrote, on the host")
    print((workspace / "out" / "summary.md").read_text())
    step("what the app kept in its data folder, on the host (no run can read it)")
    for note in sorted((workspace / "apps" / "note-taker" / "data").iterdir()):
        print(f"{note.name}: {note.read_text()}", end="")
    print(f"demo files are in {base} (removed now)")
    shutil.rmtree(base, ignore_errors=True)
    return verify.returncode


if __name__ == "__main__":
    sys.exit(main())
