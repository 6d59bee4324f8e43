"""The bubblewrap plan, checked without starting a process: the view it builds, every
refusal of validate(), the environment allowlist and the order of the rendered argv."""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gatewayd.policy.paths import PathMode
from gatewayd.sandbox import plan as plan_module
from gatewayd.sandbox.plan import (
    COGNI_TOOL_VISIBLE_DIR,
    DENIED_HOST_TREES,
    ETC_ALLOWLIST,
    ISOLATION_OPTIONS,
    SANDBOX_API_KEY,
    SANDBOX_EGRESS_SOCKET,
    SANDBOX_PATH,
    SANDBOX_SOCKET,
    SERVICE_ENV_NAMES,
    Bind,
    CheckedPlans,
    Dev,
    HostLayout,
    PlanError,
    PolicyMount,
    Proc,
    RemountRo,
    RoBind,
    RoBindData,
    SandboxPlan,
    Services,
    Step,
    Symlink,
    Tmpfs,
    build_plan,
    probe_host_layout,
    render_argv,
    validate,
)
from tests.hypothesis_counts import examples

RUN_ID = "run-0123abcd"
STATE = "/var/lib/cogni"
SOCKET = f"{STATE}/runs/{RUN_ID}/gateway.sock"
DEBIAN_LAYOUT = HostLayout(
    system_links=(
        ("bin", "usr/bin"),
        ("sbin", "usr/sbin"),
        ("lib", "usr/lib"),
        ("lib64", "usr/lib64"),
    ),
    system_dirs=(),
    etc_entries=ETC_ALLOWLIST,
)
FORBIDDEN_SOURCES = (
    "/root",
    "/home",
    "/var",
    "/run",
    "/etc/shadow",
    "/etc/gshadow",
    "/etc/sudoers",
    "/etc/ssh",
    "/etc/machine-id",
    "/etc/resolv.conf",
    "/etc/pip.conf",
    "/etc/ssl/private",
    STATE,
)


def make_plan(**overrides: Any) -> SandboxPlan:
    kwargs: dict[str, Any] = {
        "run_id": RUN_ID,
        "workspace_host": "/srv/work/project",
        "policy_paths": [
            PolicyMount(host="/srv/docs", visible="/workspace/docs", mode=PathMode.RO),
            PolicyMount(host="/srv/out", visible="/mnt/out", mode=PathMode.RW),
        ],
        "gateway_socket_host": SOCKET,
        "cogni_tool_host_dir": "/opt/cogni/bin",
        "command": ["/usr/bin/python3", "-c", "pass"],
        "extra_env_names": [],
        "env_values": {},
        "state_dir": STATE,
        "netns_path": f"/run/netns/cogni-{RUN_ID}",
        "layout": DEBIAN_LAYOUT,
    }
    kwargs.update(overrides)
    return build_plan(**kwargs)


def sources(argv: list[str]) -> list[tuple[str, str]]:
    """(source, destination) of every bind in a rendered argv."""
    return [
        (argv[i + 1], argv[i + 2])
        for i, arg in enumerate(argv)
        if arg in {"--bind", "--ro-bind", "--dev-bind", "--bind-try", "--ro-bind-try"}
    ]


def fds_for(plan: SandboxPlan) -> dict[str, int]:
    return {step.dest: 10 + i for i, step in enumerate(plan.data_steps)}


def within(path: str, root: str) -> bool:
    return root == "/" or path == root or path.startswith(root + "/")


# --- the view ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    "step",
    [
        RoBind(src="/usr", dest="/usr"),
        Symlink(target="usr/bin", dest="/bin"),
        Symlink(target="usr/sbin", dest="/sbin"),
        Symlink(target="usr/lib", dest="/lib"),
        Symlink(target="usr/lib64", dest="/lib64"),
        RoBind(src="/etc/nsswitch.conf", dest="/etc/nsswitch.conf"),
        RoBind(src="/etc/ld.so.cache", dest="/etc/ld.so.cache"),
        RoBind(src="/etc/ssl/certs", dest="/etc/ssl/certs"),
        RoBind(src="/etc/alternatives", dest="/etc/alternatives"),
        Proc(dest="/proc"),
        Dev(dest="/dev"),
        Tmpfs(dest="/tmp"),
        Bind(src="/srv/work/project", dest="/workspace"),
        RoBind(src="/srv/docs", dest="/workspace/docs"),
        Bind(src="/srv/out", dest="/mnt/out"),
        RoBind(src="/opt/cogni/bin", dest=COGNI_TOOL_VISIBLE_DIR),
        RoBind(src=SOCKET, dest=SANDBOX_SOCKET),
        RemountRo(dest="/"),
    ],
    ids=lambda s: f"{type(s).__name__}:{s.dest}",
)
def test_plan_mounts_every_required_path_with_its_mode(step: Step) -> None:
    assert step in make_plan().steps


@pytest.mark.parametrize("dest", ["/etc/passwd", "/etc/group", "/etc/hosts"])
def test_user_and_host_files_are_generated_not_bound_from_the_host(dest: str) -> None:
    plan = make_plan()
    data = [s for s in plan.data_steps if s.dest == dest]
    assert len(data) == 1
    assert all(not (isinstance(s, RoBind | Bind) and s.dest == dest) for s in plan.steps)


def test_generated_passwd_names_the_sandbox_user_and_no_host_user() -> None:
    (passwd,) = [s for s in make_plan().data_steps if s.dest == "/etc/passwd"]
    names = [line.split(":")[0] for line in passwd.data.decode().splitlines()]
    assert names == ["root", "sandbox", "nobody"]
    assert ":1000:1000:" in passwd.data.decode()


@pytest.mark.parametrize("forbidden", FORBIDDEN_SOURCES)
def test_no_forbidden_host_path_is_bound_except_the_runs_own_socket(forbidden: str) -> None:
    plan = make_plan()
    for src, dest in sources(render_argv(plan, data_fds=fds_for(plan))):
        if dest == SANDBOX_SOCKET:
            continue
        assert not within(src, forbidden), (src, dest)
        assert not within(forbidden, src), (src, dest)


def test_plan_does_not_unshare_the_network_and_records_the_netns_to_join() -> None:
    plan = make_plan()
    argv = render_argv(plan, data_fds=fds_for(plan))
    assert "--unshare-net" not in argv
    assert "--share-net" not in argv
    assert plan.netns_path == f"/run/netns/cogni-{RUN_ID}"


def test_sandbox_runs_as_a_non_root_uid_with_a_neutral_hostname() -> None:
    plan = make_plan()
    assert (plan.uid, plan.gid) == (1000, 1000)
    assert plan.hostname == "cogni-sandbox"
    assert plan.cwd == "/workspace"


def test_non_merged_usr_layout_binds_real_system_directories_read_only() -> None:
    layout = HostLayout(system_dirs=("bin", "lib64"), etc_entries=())
    plan = make_plan(layout=layout)
    assert RoBind(src="/bin", dest="/bin") in plan.steps
    assert RoBind(src="/lib64", dest="/lib64") in plan.steps
    validate(plan)


def test_system_symlink_pointing_outside_usr_is_refused() -> None:
    layout = HostLayout(system_links=(("bin", "/opt/evil/bin"),))
    with pytest.raises(PlanError, match=r"/bin is a symlink to '/opt/evil/bin'.*into /usr"):
        make_plan(layout=layout)


def test_image_root_replaces_host_system_directories() -> None:
    plan = make_plan(image_dir="/srv/images/debian")
    assert plan.steps[0] == RoBind(src="/srv/images/debian", dest="/")
    assert RoBind(src="/usr", dest="/usr") not in plan.steps
    assert all(not s.dest.startswith("/etc/") or isinstance(s, RoBindData) for s in plan.steps)
    validate(plan)


def test_policy_paths_are_mounted_parents_first_whatever_the_input_order() -> None:
    plan = make_plan(
        policy_paths=[
            PolicyMount(host="/srv/a/b", visible="/mnt/a/b", mode=PathMode.RO),
            PolicyMount(host="/srv/a", visible="/mnt/a", mode=PathMode.RW),
        ]
    )
    dests = [s.dest for s in plan.steps]
    assert dests.index("/workspace") < dests.index("/mnt/a") < dests.index("/mnt/a/b")
    validate(plan)


def test_probe_host_layout_reads_symlinks_directories_and_etc_entries(tmp_path: Path) -> None:
    (tmp_path / "usr" / "bin").mkdir(parents=True)
    (tmp_path / "bin").symlink_to("usr/bin")
    (tmp_path / "lib64").mkdir()
    (tmp_path / "etc" / "ssl" / "certs").mkdir(parents=True)
    (tmp_path / "etc" / "nsswitch.conf").write_text("passwd: files\n")
    (tmp_path / "etc" / "shadow").write_text("root:*:1::::::\n")
    layout = probe_host_layout(tmp_path)
    assert layout.system_links == (("bin", "usr/bin"),)
    assert layout.system_dirs == ("lib64",)
    assert layout.etc_entries == ("nsswitch.conf", "ssl/certs")


def test_probe_of_this_debian_host_gives_a_valid_plan() -> None:
    plan = make_plan(layout=probe_host_layout())
    validate(plan)
    if os.path.islink("/bin"):
        assert any(isinstance(s, Symlink) and s.dest == "/bin" for s in plan.steps)


# --- validate() refusals ----------------------------------------------------------------


def with_extra_step(step: Step) -> tuple[SandboxPlan, int]:
    """The default plan with ``step`` inserted just before the final remount."""
    plan = make_plan()
    steps = list(plan.steps)
    steps.insert(len(steps) - 1, step)
    return dataclasses.replace(plan, steps=tuple(steps)), len(steps) - 2


@pytest.mark.parametrize(
    ("step", "message"),
    [
        (RoBind(src="/srv/x", dest="/workspace/../etc"), r"must be absolute and normalized"),
        (RoBind(src="/srv/x", dest="/mnt/x/"), r"must be absolute and normalized"),
        (RoBind(src="/srv/x", dest="mnt/x"), r"must be absolute and normalized"),
        (RoBind(src="/srv/x", dest="//mnt/x"), r"must be absolute and normalized"),
        (RoBind(src="/srv/../etc", dest="/mnt/x"), r"source '/srv/../etc' must be absolute"),
        (RoBind(src="/srv/x", dest="/tmp"), r"mounts /tmp again \(already step \d+\)"),
        (Tmpfs(dest="/mnt"), r"mounts /mnt over step \d+'s /mnt/out, hiding it; mount parents"),
        (RoBind(src="/srv/x", dest="/"), r"mounts the root; only the first step may"),
        (Bind(src="/srv/x", dest="/usr/local"), r"binds a system path writable; .*/usr"),
        (Bind(src="/srv/x", dest="/etc/x"), r"binds a system path writable; .*/etc"),
        (Bind(src="/srv/x", dest=COGNI_TOOL_VISIBLE_DIR + "/x"), r"system path writable"),
        (RoBind(src="/root/.ssh", dest="/mnt/k"), r"exposes /root, which the sandbox never"),
        (RoBind(src="/", dest="/mnt/k"), r"exposes /root, which the sandbox never sees"),
        (RoBind(src="/etc", dest="/mnt/k"), r"exposes /etc/shadow"),
        (RoBind(src="/etc/ssh", dest="/mnt/k"), r"exposes /etc/ssh"),
        (RoBind(src="/etc/sudoers.d", dest="/mnt/k"), r"exposes /etc/sudoers.d"),
        (RoBind(src="/run/docker.sock", dest="/mnt/d"), r"exposes /run, "),
        (RoBind(src="/proc/1", dest="/mnt/p"), r"exposes /proc, "),
        (RoBind(src=STATE + "/runs/other/gateway.sock", dest="/mnt/s"), rf"exposes {STATE}"),
        (RoBind(src="/var/lib", dest="/mnt/v"), rf"exposes {STATE}"),
        (RoBind(src="/home", dest="/mnt/h"), r"exposes all of /home; bind the one directory"),
        (RoBind(src="/var", dest="/mnt/v"), r"exposes /var/lib/cogni|exposes all of /var"),
        (Tmpfs(dest="/run/user"), r"mounts under /run; the only thing there is the run's"),
        (RoBind(src="/srv/x", dest="/run/cogni/other.sock"), r"mounts under /run"),
    ],
)
def test_validate_refuses_an_unsafe_step_and_names_it(step: Step, message: str) -> None:
    plan, index = with_extra_step(step)
    with pytest.raises(PlanError, match=message) as caught:
        validate(plan)
    assert f"step {index} (" in str(caught.value)
    assert step.dest in str(caught.value)


def test_a_bind_under_home_is_allowed_but_not_home_itself() -> None:
    plan, _ = with_extra_step(RoBind(src="/home/alice/project", dest="/mnt/p"))
    validate(plan)


def test_validate_refuses_another_runs_socket() -> None:
    other = f"{STATE}/runs/run-other/gateway.sock"
    plan = make_plan(gateway_socket_host=other)
    with pytest.raises(PlanError, match=rf"binds {other} as the run's socket; only this run's"):
        validate(plan)


def test_validate_refuses_a_plan_without_the_socket() -> None:
    plan = make_plan()
    steps = tuple(s for s in plan.steps if s.dest != SANDBOX_SOCKET)
    with pytest.raises(PlanError, match=r"socket 0 times; it must mount it once, at /run/cogni"):
        validate(dataclasses.replace(plan, steps=steps))


def test_validate_refuses_a_tmpfs_in_place_of_the_socket() -> None:
    plan = make_plan()
    steps = tuple(Tmpfs(dest=s.dest) if s.dest == SANDBOX_SOCKET else s for s in plan.steps)
    with pytest.raises(PlanError, match=r"other than a bind of the run's socket"):
        validate(dataclasses.replace(plan, steps=steps))


def test_validate_refuses_a_child_mounted_before_its_parent() -> None:
    plan = make_plan()
    steps = list(plan.steps)
    workspace = next(i for i, s in enumerate(steps) if s.dest == "/workspace")
    docs = next(i for i, s in enumerate(steps) if s.dest == "/workspace/docs")
    steps[workspace], steps[docs] = steps[docs], steps[workspace]
    with pytest.raises(PlanError, match=r"step \d+ \(--bind /srv/work/project /workspace\) mounts"):
        validate(dataclasses.replace(plan, steps=tuple(steps)))


@pytest.mark.parametrize(
    ("env", "message"),
    [
        ({"AWS_SECRET_ACCESS_KEY": "x"}, r"AWS_SECRET_ACCESS_KEY is not on the allowlist; allowed"),
        ({"PATH": "/root/bin"}, r"PATH must be '/opt/cogni-tool:"),
        ({"COGNI_RUN_ID": "run-other"}, rf"COGNI_RUN_ID must be '{RUN_ID}'"),
        ({"COGNI_GATEWAY_SOCK": "/tmp/x"}, r"COGNI_GATEWAY_SOCK must be '/run/cogni/gateway.sock'"),
    ],
)
def test_validate_refuses_an_environment_off_the_allowlist(
    env: dict[str, str], message: str
) -> None:
    plan = make_plan()
    merged = dict(plan.env) | env
    with pytest.raises(PlanError, match=message):
        validate(dataclasses.replace(plan, env=tuple(merged.items())))


@pytest.mark.parametrize(
    ("field", "value", "message"),
    [
        ("run_id", "../x", r"run id '../x' is not 1-64 characters"),
        ("state_dir", "var/lib", r"state directory 'var/lib' must be an absolute"),
        ("netns_path", "/run/netns/../x", r"netns path '/run/netns/../x' must be"),
        ("cwd", "/workspace/", r"working directory '/workspace/' must be"),
    ],
)
def test_validate_refuses_malformed_plan_fields(field: str, value: str, message: str) -> None:
    changes: dict[str, Any] = {field: value}
    plan = dataclasses.replace(make_plan(), **changes)
    with pytest.raises(PlanError, match=message):
        validate(plan)


# --- build_plan() refusals and the environment ------------------------------------------


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"run_id": "a/b"}, r"run id 'a/b' is not 1-64 characters of \[A-Za-z0-9_-\]"),
        ({"command": []}, r"command is empty"),
        ({"extra_env_names": ["PATH"]}, r"'PATH' is set by gatewayd.*reserved: PATH, HOME"),
        ({"extra_env_names": ["COGNI_RUN_ID"]}, r"'COGNI_RUN_ID' is set by gatewayd"),
        ({"extra_env_names": ["A=B"]}, r"'A=B' is not a valid name; allowed"),
        (
            {"extra_env_names": ["FOO"], "env_values": {"FOO": "a\0b"}},
            r"FOO holds a NUL byte",
        ),
    ],
)
def test_build_plan_refuses_bad_input_and_says_what_is_allowed(
    overrides: dict[str, Any], message: str
) -> None:
    with pytest.raises(PlanError, match=message):
        make_plan(**overrides)


def test_env_passes_only_allowlisted_and_named_variables_never_host_path_or_home() -> None:
    values = {
        "LANG": "C.UTF-8",
        "TERM": "xterm",
        "PATH": "/root/.pyenv/shims:/usr/bin",
        "HOME": "/root",
        "AWS_SECRET_ACCESS_KEY": "hunter2",
        "OPENAI_API_KEY": "sk-xxx",
        "PROJECT_MODE": "ci",
    }
    plan = make_plan(env_values=values, extra_env_names=["PROJECT_MODE", "NOT_SET"])
    assert dict(plan.env) == {
        "PATH": SANDBOX_PATH,
        "HOME": "/tmp",
        "COGNI_GATEWAY_SOCK": "/run/cogni/gateway.sock",
        "COGNI_RUN_ID": RUN_ID,
        "LANG": "C.UTF-8",
        "TERM": "xterm",
        "PROJECT_MODE": "ci",
    }
    argv = render_argv(plan, data_fds=fds_for(plan))
    assert "hunter2" not in argv
    assert "sk-xxx" not in argv


def test_a_secret_variable_is_passed_only_when_named() -> None:
    values = {"API_TOKEN": "t0k3n"}
    assert "API_TOKEN" not in dict(make_plan(env_values=values).env)
    assert dict(make_plan(env_values=values, extra_env_names=["API_TOKEN"]).env)["API_TOKEN"] == (
        "t0k3n"
    )


def test_cogni_tool_directory_comes_first_on_path() -> None:
    assert SANDBOX_PATH.split(":")[0] == COGNI_TOOL_VISIBLE_DIR


# --- render_argv() ----------------------------------------------------------------------


def test_argv_order_options_then_env_then_mounts_then_command() -> None:
    plan = make_plan()
    argv = render_argv(plan, bwrap="/usr/bin/bwrap", data_fds=fds_for(plan))
    assert argv[: 1 + len(ISOLATION_OPTIONS)] == ["/usr/bin/bwrap", *ISOLATION_OPTIONS]
    assert argv[argv.index("--cap-drop") + 1] == "ALL"
    setenvs = [i for i, a in enumerate(argv) if a == "--setenv"]
    clearenv = argv.index("--clearenv")
    first_mount = argv.index("--ro-bind")
    assert clearenv < min(setenvs) and max(setenvs) < first_mount
    assert argv.index("/workspace") < argv.index("/workspace/docs")
    remount = argv.index("--remount-ro")
    # /dev (the tmpfs --dev makes; /dev/shm, its own tmpfs, stays writable), then /.
    assert argv[remount : remount + 4] == ["--remount-ro", "/dev", "--remount-ro", "/"]
    assert argv[remount + 4 :] == ["--chdir", "/workspace", "--", *plan.command]
    assert argv.index("/dev/shm") < remount
    for option in ("--ro-bind", "--bind", "--tmpfs", "--proc", "--dev", "--symlink"):
        assert max(i for i, a in enumerate(argv) if a == option) < remount


def test_argv_hands_generated_files_over_on_the_given_descriptors() -> None:
    plan = make_plan()
    argv = render_argv(plan, data_fds={"/etc/passwd": 7, "/etc/group": 8, "/etc/hosts": 9})
    i = argv.index("/etc/passwd")
    assert argv[i - 2 : i] == ["--ro-bind-data", "7"]
    assert argv[argv.index("/etc/hosts") - 1] == "9"


def test_argv_without_a_descriptor_for_a_generated_file_is_refused() -> None:
    plan = make_plan()
    with pytest.raises(PlanError, match=r"no file descriptor; pass data_fds for: /etc/passwd"):
        render_argv(plan, data_fds={"/etc/group": 8})


def test_render_validates_first() -> None:
    plan, _ = with_extra_step(RoBind(src="/root", dest="/mnt/r"))
    with pytest.raises(PlanError, match=r"exposes /root"):
        render_argv(plan, data_fds=fds_for(plan))


# --- CheckedPlans: a run's plans validated once each, whatever their command -----------


@pytest.fixture
def validations(monkeypatch: pytest.MonkeyPatch) -> list[SandboxPlan]:
    """Every plan the module's validate() is run on, in order."""
    seen: list[SandboxPlan] = []
    real = plan_module.validate

    def counted(plan: SandboxPlan) -> None:
        seen.append(plan)
        real(plan)

    monkeypatch.setattr(plan_module, "validate", counted)
    return seen


@pytest.mark.parametrize("command", [(), ("\0",), ("--", "--bind", "/", "/"), ("x" * 10_000,)])
def test_validate_never_reads_the_command(command: tuple[str, ...]) -> None:
    # What CheckedPlans rests on: a plan is valid or not whatever its command.
    validate(dataclasses.replace(make_plan(), command=command))


def test_a_plan_equal_but_for_its_command_to_one_checked_is_not_validated_again(
    validations: list[SandboxPlan],
) -> None:
    checks = CheckedPlans()
    plan = make_plan()
    checks.validate(plan)
    assert validations == [plan]
    following = dataclasses.replace(plan, command=("/bin/echo", "next"))
    argv = render_argv(following, data_fds=fds_for(following), checks=checks)
    assert argv[-3:] == ["--", "/bin/echo", "next"]
    checks.validate(dataclasses.replace(plan, command=("/bin/true",)))
    assert validations == [plan]  # checked once
    # Without CheckedPlans, every render validates.
    render_argv(following, data_fds=fds_for(following))
    assert validations == [plan, following]


def test_a_plan_that_differs_in_anything_but_its_command_is_validated(
    validations: list[SandboxPlan],
) -> None:
    checks = CheckedPlans()
    plan = make_plan()
    checks.validate(plan)
    unsafe, _ = with_extra_step(RoBind(src="/etc", dest="/mnt/k"))
    for bad in (
        dataclasses.replace(unsafe, command=plan.command),
        dataclasses.replace(plan, cwd="/workspace/", command=("/bin/true",)),
        dataclasses.replace(plan, env=(*plan.env, ("AWS_SECRET_ACCESS_KEY", "x"))),
    ):
        with pytest.raises(PlanError):
            checks.validate(bad)
        with pytest.raises(PlanError):
            render_argv(bad, data_fds=fds_for(bad), checks=checks)
    # A refused plan is not remembered: the last one passed still is.
    checks.validate(dataclasses.replace(plan, command=("/bin/true",)))
    assert len(validations) == 1 + 6
    # Nor is a plan handed over from outside taken for valid: only what it validated.
    other = CheckedPlans()
    with pytest.raises(PlanError):
        other.validate(unsafe)


# --- property: any policy paths either validate or raise PlanError, never leak ----------

# Safe choices repeated so that a good share of the drawn plans validate.
HOST_ROOTS = ["/srv", "/srv/data", "/home/alice", "/opt/x", "/tmp/w"] * 3 + [
    "/home", "/var/lib", "/var", "/", "/etc", "/root", "/run/user", STATE, "/proc", "/usr/share"
]  # fmt: skip
VISIBLE_ROOTS = ["/workspace", "/mnt", "/data"] * 3 + ["/tmp", "/usr", "/run", "/etc", "/"]
COMPONENTS = st.sampled_from(["a", "b", "docs", "c"] * 3 + ["..", ".", "", "x y", "tmp"])


@st.composite
def policy_mounts(draw: st.DrawFn) -> PolicyMount:
    host = draw(st.sampled_from(HOST_ROOTS))
    visible = draw(st.sampled_from(VISIBLE_ROOTS))
    for part in draw(st.lists(COMPONENTS, max_size=2)):
        host = f"{host.rstrip('/')}/{part}"
    for part in draw(st.lists(COMPONENTS, max_size=2)):
        visible = f"{visible.rstrip('/')}/{part}"
    return PolicyMount(host=host, visible=visible, mode=draw(st.sampled_from(list(PathMode))))


@settings(max_examples=examples(300), deadline=None)
@given(st.lists(policy_mounts(), max_size=4))
def test_any_policy_paths_validate_or_raise_plan_error_and_never_leak(
    mounts: list[PolicyMount],
) -> None:
    plan = make_plan(policy_paths=mounts)
    try:
        argv = render_argv(plan, data_fds=fds_for(plan))
    except PlanError:
        return
    for src, dest in sources(argv):
        if dest == SANDBOX_SOCKET:
            assert src == SOCKET
            continue
        for denied in (*DENIED_HOST_TREES, STATE):
            assert not within(src, denied) and not within(denied, src), (src, dest)
        assert src not in {"/", "/home", "/var"}
        assert ".." not in src.split("/") and ".." not in dest.split("/")
    binds = [dest for _, dest in sources(argv)]
    assert len(binds) == len(set(binds))
    for i, option in enumerate(argv):
        if option == "--bind":
            assert not any(within(argv[i + 2], s) for s in ("/usr", "/etc", "/proc", "/dev"))


def test_tmp_and_dev_shm_get_the_size_cap_and_dev_is_made_read_only() -> None:
    plan = make_plan(tmpfs_bytes=8 << 20)
    argv = render_argv(plan, bwrap="/usr/bin/bwrap", data_fds=fds_for(plan))
    tmpfs = [i for i, arg in enumerate(argv) if arg == "--tmpfs"]
    assert sorted(argv[i + 1] for i in tmpfs) == ["/dev/shm", "/tmp"]
    for at in tmpfs:
        assert argv[at - 2 : at] == ["--size", str(8 << 20)], argv[at + 1]
    assert (
        argv.index("--dev")
        < argv.index("/dev/shm")
        < argv.index("/dev", argv.index("--remount-ro"))
    )
    uncapped = render_argv(make_plan(), bwrap="/usr/bin/bwrap", data_fds=fds_for(plan))
    assert "--size" not in uncapped


@pytest.mark.parametrize("size", [0, 1, 4095])
def test_a_tmpfs_under_one_page_is_refused(size: int) -> None:
    with pytest.raises(PlanError, match="under one page"):
        make_plan(tmpfs_bytes=size)


# --- the run's in-sandbox services ------------------------------------------------------

EGRESS = f"{STATE}/runs/{RUN_ID}/egress.sock"
BOTH = Services(model_endpoint=True, egress_proxy=True)


def test_services_add_their_variables_and_the_egress_socket_and_nothing_else() -> None:
    plain = make_plan()
    assert not {name for name, _ in plain.env} & set(SERVICE_ENV_NAMES)
    assert SANDBOX_EGRESS_SOCKET not in {step.dest for step in plain.steps}
    plan = make_plan(services=BOTH)
    validate(plan)
    env = dict(plan.env)
    assert env["OPENAI_BASE_URL"] == "http://127.0.0.1:11411/v1"
    assert env["OPENAI_API_KEY"] == SANDBOX_API_KEY
    assert env["HTTPS_PROXY"] == env["http_proxy"] == "http://127.0.0.1:3128"
    assert "127.0.0.1" in env["NO_PROXY"].split(",")  # the endpoint never via the proxy
    assert (EGRESS, SANDBOX_EGRESS_SOCKET) in sources(render_argv(plan, data_fds=fds_for(plan)))
    model_only = dict(make_plan(services=Services(model_endpoint=True)).env)
    assert "HTTP_PROXY" not in model_only and "OPENAI_BASE_URL" in model_only


@pytest.mark.parametrize("name", SERVICE_ENV_NAMES)
def test_a_policy_cannot_pass_a_service_variable_from_the_host(name: str) -> None:
    with pytest.raises(PlanError, match=rf"{name}' is set by gatewayd and cannot be passed"):
        make_plan(extra_env_names=[name], env_values={name: "http://evil:1"})


def test_validate_refuses_another_runs_egress_socket_and_one_the_run_does_not_have() -> None:
    plan = make_plan(services=BOTH)
    other = f"{STATE}/runs/run-other/egress.sock"
    steps = tuple(
        RoBind(src=other, dest=s.dest) if s.dest == SANDBOX_EGRESS_SOCKET else s for s in plan.steps
    )
    with pytest.raises(PlanError, match=rf"binds {other} as the run's socket; only this run's"):
        validate(dataclasses.replace(plan, steps=steps))
    without = dataclasses.replace(plan, services=Services(model_endpoint=True))
    with pytest.raises(PlanError, match=r"egress socket 1 times; it must mount it never"):
        validate(dataclasses.replace(without, env=make_plan(services=without.services).env))
    no_socket = tuple(s for s in plan.steps if s.dest != SANDBOX_EGRESS_SOCKET)
    with pytest.raises(PlanError, match=r"egress socket 0 times; it must mount it once"):
        validate(dataclasses.replace(plan, steps=no_socket))


def test_validate_refuses_service_variables_changed_or_without_the_service() -> None:
    plan = make_plan(services=BOTH)
    for name, value in (("OPENAI_BASE_URL", "http://evil/v1"), ("HTTPS_PROXY", "http://x:1")):
        merged = dict(plan.env) | {name: value}
        with pytest.raises(PlanError, match=rf"{name} must be '"):
            validate(dataclasses.replace(plan, env=tuple(merged.items())))
    bare = make_plan()
    merged = dict(bare.env) | {"HTTPS_PROXY": "http://127.0.0.1:3128"}
    with pytest.raises(PlanError, match=r"HTTPS_PROXY is not on the allowlist"):
        validate(dataclasses.replace(bare, env=tuple(merged.items())))


# --- a command with a network namespace of its own (a process tool's call) -------------


def test_a_plan_without_the_runs_network_unshares_it_and_the_default_shares_it() -> None:
    shared = make_plan()
    argv = render_argv(shared, bwrap="/usr/bin/bwrap", data_fds=fds_for(shared))
    assert "--unshare-net" not in argv
    own = make_plan(run_network=False, gateway_socket=False)
    argv = render_argv(own, bwrap="/usr/bin/bwrap", data_fds=fds_for(own))
    # Among bwrap's options, before the first mount: the command's own namespace.
    assert argv.index("--unshare-net") < argv.index("--clearenv")


def test_a_plan_without_the_runs_network_may_not_name_the_runs_services() -> None:
    with pytest.raises(PlanError, match="cannot be reached"):
        validate(make_plan(run_network=False, services=Services(egress_proxy=True)))


# --- a call's own egress proxy (a process tool's call granted network domains) -----------

CALL_EGRESS = f"{STATE}/runs/{RUN_ID}/egress-7.sock"


def call_plan(**overrides: Any) -> SandboxPlan:
    settings: dict[str, Any] = {
        "run_network": False,
        "gateway_socket": False,
        "services": Services(egress_proxy=True),
        "egress_socket": CALL_EGRESS,
    }
    return make_plan(**(settings | overrides))


def test_a_call_plan_binds_its_own_egress_socket_and_sets_the_proxy_variables() -> None:
    plan = call_plan()
    validate(plan)
    argv = render_argv(plan, bwrap="/usr/bin/bwrap", data_fds=fds_for(plan))
    assert (CALL_EGRESS, SANDBOX_EGRESS_SOCKET) in sources(argv)
    assert f"{STATE}/runs/{RUN_ID}/egress.sock" not in argv  # not the run's
    assert "--unshare-net" in argv
    env = dict(plan.env)
    assert env["HTTPS_PROXY"] == env["http_proxy"] == "http://127.0.0.1:3128"
    assert "OPENAI_BASE_URL" not in env


@pytest.mark.parametrize(
    "socket",
    [
        f"{STATE}/runs/run-other/egress-7.sock",  # another run's call
        f"{STATE}/runs/{RUN_ID}/egress.sock",  # the run's own, in the call's namespace
        f"{STATE}/runs/{RUN_ID}/gateway.sock",
        f"{STATE}/runs/{RUN_ID}/egress-.sock",
        f"{STATE}/runs/{RUN_ID}/egress-7x.sock",
        f"{STATE}/runs/{RUN_ID}/egress-\u0667.sock",  # a digit, but not an ASCII one
        f"{STATE}/runs/{RUN_ID}/mnt/egress-7.sock",
        "/tmp/egress-7.sock",
    ],
)
def test_a_call_plan_binds_no_other_socket_as_its_egress(socket: str) -> None:
    with pytest.raises(PlanError, match=r"as the run's socket; only this run's socket"):
        validate(call_plan(egress_socket=socket))


def test_a_call_plan_binds_exactly_the_socket_it_names() -> None:
    plan = call_plan()
    other = f"{STATE}/runs/{RUN_ID}/egress-8.sock"  # the run's, but another call's
    steps = tuple(
        RoBind(src=other, dest=s.dest) if s.dest == SANDBOX_EGRESS_SOCKET else s for s in plan.steps
    )
    with pytest.raises(PlanError, match=r"binds .*egress-8.sock as the run's socket"):
        validate(dataclasses.replace(plan, steps=steps))


def test_a_calls_own_egress_is_only_for_a_namespace_of_its_own_and_never_the_model() -> None:
    with pytest.raises(PlanError, match="only for a command with a network namespace of its own"):
        validate(call_plan(run_network=True, gateway_socket=True))
    with pytest.raises(PlanError, match="cannot be reached"):
        validate(call_plan(services=Services(egress_proxy=True, model_endpoint=True)))
