"""A run's workspace mode and fate: request > policy > configuration > overlay, and the
refusals when a request asks for more than its policy lets it (a mode outside
``request_modes``, a longer keep time, a larger delta)."""

from __future__ import annotations

import argparse
import contextlib
import json
from pathlib import Path

import pydantic
import pytest

from gatewayd.errors import PolicyViolation
from gatewayd.hostpaths.binding import bind_paths
from gatewayd.policy import PolicyError, load_policy_text
from gatewayd.policy.workspace_section import DEFAULT_KEEP_FOR_S, MAX_KEEP_FOR_S
from gatewayd.protocol import ErrorCode
from gatewayd.runs.model import RunRequest, WorkspaceRequest
from gatewayd.runs.workspaces import (
    choose_workspace,
    plan_base_loan,
    refuse_host_paths_into_base,
    require_base_free,
)
from gatewayd.sandbox.session import WorkspaceInUse


def policy(workspace: str = "") -> object:
    text = "version: 1\nname: p\n" + (f"workspace:\n{workspace}" if workspace else "")
    return load_policy_text(text, "p.yaml")


def test_with_nothing_said_a_run_gets_the_configured_mode_kept_for_a_week() -> None:
    plan = choose_workspace(None, policy(), "host")
    assert (plan.mode, plan.mode_from) == ("host", "configuration")
    assert (plan.on_end, plan.keep_for_s, plan.max_delta_bytes) == (
        "keep",
        DEFAULT_KEEP_FOR_S,
        None,
    )
    assert choose_workspace(None, policy(), None).mode == "overlay"
    assert choose_workspace(None, policy(), None).mode_from == "default"


def test_the_policy_wins_over_the_configuration_and_the_request_over_both() -> None:
    pol = policy("  mode: agentfs\n  on_end: discard\n")
    assert choose_workspace(None, pol, "host").mode == "agentfs"
    plan = choose_workspace(WorkspaceRequest(mode="overlay", onEnd="commit"), pol, "host")
    assert (plan.mode, plan.mode_from, plan.on_end) == ("overlay", "request", "commit")
    # A request that names no mode keeps the policy's, and may still set its fate.
    plan = choose_workspace(WorkspaceRequest(onEnd="keep"), pol, "host")
    assert (plan.mode, plan.on_end) == ("agentfs", "keep")


def test_a_mode_outside_request_modes_is_refused_naming_the_allowed_ones() -> None:
    pol = policy("  request_modes: [overlay, agentfs]\n")
    with pytest.raises(PolicyViolation) as caught:
        choose_workspace(WorkspaceRequest(mode="host"), pol, None)
    message = str(caught.value)
    assert caught.value.code is ErrorCode.POLICY_DENIED
    assert "'host'" in message and "overlay, agentfs" in message
    assert "workspace.request_modes" in message
    # Empty: no request may choose; the policy's (or configured) mode still applies.
    none = policy("  request_modes: []\n  mode: overlay\n")
    with pytest.raises(PolicyViolation, match="choose only: none"):
        choose_workspace(WorkspaceRequest(mode="overlay"), none, None)
    assert choose_workspace(None, none, "host").mode == "overlay"


def test_a_request_may_shorten_the_keep_time_and_lower_the_delta_but_not_raise_them() -> None:
    pol = policy("  keep_for_s: 3600\n  max_delta_mb: 64\n")
    plan = choose_workspace(WorkspaceRequest(keepForSec=60, maxDeltaMb=8), pol, None)
    assert (plan.keep_for_s, plan.max_delta_bytes) == (60, 8 << 20)
    with pytest.raises(PolicyViolation, match=r"3601 s.*3600 s.*workspace.keep_for_s"):
        choose_workspace(WorkspaceRequest(keepForSec=3601), pol, None)
    with pytest.raises(PolicyViolation, match=r"65 MiB.*64 MiB.*workspace.max_delta_mb"):
        choose_workspace(WorkspaceRequest(maxDeltaMb=65), pol, None)
    # Without a policy limit, a request sets its own.
    assert choose_workspace(WorkspaceRequest(maxDeltaMb=5), policy(), None).max_delta_bytes == (
        5 << 20
    )


@pytest.mark.parametrize(
    ("section", "problem"),
    [
        ("  mode: overlayfs\n", "workspace.mode"),
        ("  request_modes: [host, host]\n", "request_modes"),
        ("  on_end: apply\n", "workspace.on_end"),
        ("  keep_for_s: 0\n", "workspace.keep_for_s"),
        (f"  keep_for_s: {MAX_KEEP_FOR_S + 1}\n", "workspace.keep_for_s"),
        ("  keep_for_s: '60'\n", "workspace.keep_for_s"),
        ("  max_delta_mb: 0\n", "workspace.max_delta_mb"),
        ("  unknown: 1\n", "workspace.unknown"),
    ],
)
def test_a_bad_workspace_section_is_a_policy_error_naming_the_field(
    section: str, problem: str
) -> None:
    with pytest.raises(PolicyError, match=problem.replace(".", r"\.")):
        policy(section)


@pytest.mark.parametrize(
    "workspace",
    [
        {"mode": "nfs"},
        {"onEnd": "apply"},
        {"keepForSec": 0},
        {"keepForSec": "60"},
        {"maxDeltaMb": 0},
        {"maxDeltaMb": True},
        {"mode": "overlay", "extra": 1},
    ],
)
def test_a_bad_workspace_request_is_refused_by_the_request_model(
    workspace: dict[str, object],
) -> None:
    with pytest.raises(pydantic.ValidationError, match="workspace"):
        RunRequest.model_validate(
            {
                "workspacePath": "/w",
                "policy": "p",
                "actorId": "a",
                "tenantId": "t",
                "workspace": workspace,
            }
        )


def test_a_writable_absolute_path_inside_the_base_is_refused_with_the_fix(
    tmp_path: Path,
) -> None:
    for name in ("out", "ref", "rel"):
        (tmp_path / name).mkdir()
    outside = tmp_path.parent / f"{tmp_path.name}-cache"
    outside.mkdir()
    try:
        text = (
            "version: 1\nname: p\nfilesystem:\n  paths:\n"
            "    workspace: {root: ., mode: rw}\n"
            "    rel: {root: rel, mode: rw}\n"
            f"    ref: {{root: {tmp_path}/ref, mode: ro, mount: /srv/ref}}\n"
            f"    cache: {{root: {outside}, mode: rw, mount: /srv/cache}}\n"
        )
        pol = load_policy_text(text, "p.yaml")
        refuse_host_paths_into_base(pol, bind_paths(pol, tmp_path), tmp_path)
        out = f"    out: {{root: {tmp_path}/out, mode: rw, mount: /srv/out}}\n"
        bad = load_policy_text(text + out, "p.yaml")
        with pytest.raises(PolicyViolation, match=r"'out'.*relative to the workspace"):
            refuse_host_paths_into_base(bad, bind_paths(bad, tmp_path), tmp_path)
    finally:
        outside.rmdir()


def test_a_writable_path_holding_the_base_is_refused_and_a_read_only_one_is_not(
    tmp_path: Path,
) -> None:
    base = tmp_path / "repo"
    base.mkdir()
    text = "version: 1\nname: p\nfilesystem:\n  paths:\n    workspace: {root: ., mode: rw}\n"
    for mode in ("ro", "rw"):
        holder = f"    home: {{root: {tmp_path}, mode: {mode}, mount: /srv/home}}\n"
        pol = load_policy_text(text + holder, "p.yaml")
        if mode == "ro":
            refuse_host_paths_into_base(pol, bind_paths(pol, base), base)
            continue
        with pytest.raises(PolicyViolation, match=r"'home'.*holds the workspace.*read-only"):
            refuse_host_paths_into_base(pol, bind_paths(pol, base), base)


@pytest.mark.parametrize(
    ("base", "held"),
    [("/srv/ws", "/srv/ws"), ("/srv/ws", "/srv"), ("/srv/ws", "/srv/ws/out")],
)
def test_a_base_overlapping_a_held_tree_is_in_use(base: str, held: str) -> None:
    with pytest.raises(WorkspaceInUse, match="one run at a time"):
        require_base_free(Path(base), [Path("/elsewhere"), Path(held)])
    require_base_free(Path("/srv/ws2"), [Path("/srv/ws")])


def test_the_loan_is_the_whole_base_fenced_by_read_only_paths_and_an_apps_folder(
    tmp_path: Path,
) -> None:
    for name in ("ref", "out", "apps"):
        (tmp_path / name).mkdir()
    pol = load_policy_text(
        "version: 1\nname: p\nfilesystem:\n  paths:\n"
        "    workspace: {root: ., mode: rw}\n"
        "    ref: {root: ref, mode: ro}\n"
        "    out: {root: out, mode: rw}\n",
        "p.yaml",
    )
    loan = plan_base_loan(pol, tmp_path)
    assert (loan.trees, loan.whole) == ((tmp_path,), True)
    ids = {(st.st_dev, st.st_ino) for st in (tmp_path.joinpath(n).stat() for n in ("ref", "apps"))}
    assert loan.keep == ids


def test_a_read_only_workspace_lends_only_its_writable_paths(tmp_path: Path) -> None:
    (tmp_path / "out").mkdir()
    pol = load_policy_text(
        "version: 1\nname: p\nfilesystem:\n  paths:\n"
        "    workspace: {root: ., mode: ro}\n"
        "    out: {root: out, mode: rw}\n",
        "p.yaml",
    )
    loan = plan_base_loan(pol, tmp_path)
    assert (loan.trees, loan.whole) == ((tmp_path / "out",), False)
    assert loan.keep == frozenset()


def _cli_args(tmp_path: Path, *argv: str) -> argparse.Namespace:
    from gatewayd.cli import build_parser

    return build_parser().parse_args(
        ["run", "--policy", "p", "--workspace", str(tmp_path), *argv, "--", "true"]
    )


def test_gatewayd_run_flags_lay_the_mode_and_fate_over_the_request(tmp_path: Path) -> None:
    from gatewayd.cli.run import _run_request

    plain = _run_request(_cli_args(tmp_path))
    assert plain.workspace is None  # the policy's, then the configuration's
    asked = _run_request(_cli_args(tmp_path, "--workspace-mode", "host", "--on-end", "discard"))
    assert asked.workspace == WorkspaceRequest(mode="host", onEnd="discard")
    # Over a spec file's own workspace, the flags win and the rest of it stays.
    spec = tmp_path / "spec.json"
    spec.write_text(
        json.dumps(
            {
                "workspacePath": str(tmp_path),
                "policy": "p",
                "actorId": "a",
                "tenantId": "t",
                "grant": {"allowSandbox": True},
                "workspace": {"mode": "agentfs", "keepForSec": 60},
            }
        )
    )
    args = build_run_args(spec, "--on-end", "commit")
    assert _run_request(args).workspace == WorkspaceRequest(
        mode="agentfs", onEnd="commit", keepForSec=60
    )


def build_run_args(spec: Path, *argv: str) -> argparse.Namespace:
    from gatewayd.cli import build_parser

    return build_parser().parse_args(["run", "--spec", str(spec), *argv, "--", "true"])


@pytest.mark.parametrize("flag", [["--workspace-mode", "nfs"], ["--on-end", "apply"]])
def test_gatewayd_run_refuses_a_mode_or_fate_it_does_not_know(
    tmp_path: Path, flag: list[str], capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as caught:
        _cli_args(tmp_path, *flag)
    assert caught.value.code == 2
    assert "invalid choice" in capsys.readouterr().err


def test_an_empty_image_option_is_the_current_directory_never_no_image(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # `--image "$IMAGE"` with $IMAGE unset names the current directory, as a path
    # option always has: refused there as no image, never a run on the host's trees.
    from gatewayd.cli.run import _attach_request, _run_request

    monkeypatch.chdir(tmp_path)
    args = _cli_args(tmp_path, "--image", "")
    assert _attach_request(args)["sandboxImage"] == str(tmp_path)
    assert _run_request(args).sandboxImage == str(tmp_path)
    assert _attach_request(_cli_args(tmp_path))["sandboxImage"] is None


def test_an_empty_own_daemon_option_keeps_the_run_in_this_process(tmp_path: Path) -> None:
    # `--audit ""` is given (the current directory, as a path option always was): only
    # a daemon of this process can take it, so no serving daemon is asked.
    import socket
    import threading

    from gatewayd.cli.run import _run_attached

    state = tmp_path / "s"
    state.mkdir()
    asked: list[bool] = []
    returned = threading.Event()
    with socket.socket(socket.AF_UNIX) as listener:
        listener.bind(str(state / "control.sock"))
        listener.listen()

        def answer_none() -> None:  # a serving daemon that hangs up at once
            listener.settimeout(0.05)
            while not returned.is_set():
                try:
                    conn, _ = listener.accept()
                except TimeoutError:
                    continue
                asked.append(True)
                conn.close()

        watcher = threading.Thread(target=answer_none)
        watcher.start()
        args = _cli_args(tmp_path, "--state-dir", str(state), "--audit", "")
        try:
            assert _run_attached(args, ["true"]) is None
        finally:
            returned.set()
            watcher.join()
        # A connection made while the watcher stopped waits in the backlog.
        listener.setblocking(False)
        with contextlib.suppress(BlockingIOError):
            listener.accept()[0].close()
            asked.append(True)
    assert asked == []
