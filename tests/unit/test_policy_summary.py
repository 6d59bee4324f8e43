"""The summary `gatewayd policy check` prints."""

from __future__ import annotations

import textwrap

from gatewayd.policy import load_policy_text, summarize


def test_summary_of_an_empty_policy_says_it_denies_everything() -> None:
    policy = load_policy_text("version: 1\nname: nothing\n", "p.yaml")
    assert summarize(policy, "policies/p.yaml") == textwrap.dedent("""\
        policy nothing (version 1) from policies/p.yaml
        tools: none (deny all)
        paths: none (no file is reachable)
        limits:
          call timeout: 30 s
          max output: 1048576 bytes per response value
          rate: 50 calls/s, burst 100
          concurrent calls: 16
        sandbox:
          OS sandbox: required
          host variables passed: none (LANG, TERM only)
          per command: 600 s wall, 300 s CPU, 256 processes, 1024 MiB per file, 1024 open files, 1048576 bytes of output kept, 512 MiB each for /tmp and /dev/shm
        review: off""")


def test_summary_shows_tools_each_path_with_host_and_sandbox_view_and_limits() -> None:
    policy = load_policy_text(
        textwrap.dedent("""\
            version: 1
            name: mixed
            description: |
              Several rules.
            tools: {allow: ["fs.*", time.now]}
            filesystem:
              paths:
                workspace: {root: ., mode: rw, suffixes: [.md, .txt], max_file_bytes: 1000}
                ref: {root: ref, mode: ro}
                docs: {root: /srv/docs, mode: ro, mount: /data/docs}
            limits: {call_timeout_s: 2.5, max_output_bytes: 4096, calls_per_second: 0.5,
                     max_concurrent_calls: 2}
            require_os_sandbox: false
            env: {allow: [TZ, PIP_INDEX_URL]}
            sandbox: {timeout_s: 90, cpu_s: 60, max_processes: 32, max_file_mb: 10,
                      max_open_files: 64, max_output_bytes: 2048, tmp_mb: 8}
            review:
              mode: llm
              model: reviewer
              tools: ["fs.*"]
              rules: {allow: [Reading notes], deny: [No keys, No deletes]}
              structured: [{effect: deny, tool: "fs.*", path: "/workspace/.git/**"}]
        """),
        "mixed.yaml",
    )
    assert summarize(policy, "mixed.yaml") == textwrap.dedent("""\
        policy mixed (version 1) from mixed.yaml
          Several rules.
        tools: fs.*, time.now
        paths (as the sandbox sees them):
          workspace: /workspace (the workspace), read-write
            suffixes: .md, .txt; max file size: 1000 bytes
          ref: /workspace/ref (workspace/ref), read-only
            suffixes: any; max file size: no limit
          docs: /data/docs (host /srv/docs), read-only
            suffixes: any; max file size: no limit
        limits:
          call timeout: 2.5 s
          max output: 4096 bytes per response value
          rate: 0.5 calls/s, burst 1
          concurrent calls: 2
        sandbox:
          OS sandbox: optional (runs degraded without it)
          host variables passed: TZ, PIP_INDEX_URL
          per command: 90 s wall, 60 s CPU, 32 processes, 10 MiB per file, 64 open files, 2048 bytes of output kept, 8 MiB each for /tmp and /dev/shm
        review: llm by model reviewer, 15 s timeout
          reviewed tools: fs.*
          rules: 1 allow, 2 deny, 1 structured""")
