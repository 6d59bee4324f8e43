"""What may be lent, decided without touching the host's trees: which paths may be
lendable roots, what a mount table says a mount point shows, how the configuration (and
one made in code) refuses a system tree as a root, and that both judge a root
on its real path (symlinks made under pytest's tmp_path) (gatewayd/sandbox/lendable.py,
gatewayd/config.py, gatewayd/runs/lifecycle.py)."""

from __future__ import annotations

import os
import posixpath
from collections.abc import Callable
from pathlib import Path

import pydantic
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gatewayd.config import ConfigError, GatewaydConfig
from gatewayd.configsources import resolve_settings
from gatewayd.sandbox.lendable import (
    DEFAULT_LENDABLE_ROOTS,
    NEVER_ROOTS,
    SYSTEM_TREES,
    Mount,
    is_within,
    locate,
    mounts_crossed,
    parse_mountinfo,
    real_root_problem,
    root_problem,
    system_tree_shown,
)
from gatewayd.sandbox.plan import HostLayout
from gatewayd.sandbox.session import SandboxSettings
from tests.hypothesis_counts import examples

HINT = "lendable_roots (option --lendable-root, variable GATEWAYD_LENDABLE_ROOTS)"

# --- roots --------------------------------------------------------------------------------


@pytest.mark.parametrize("tree", SYSTEM_TREES)
def test_a_system_tree_and_everything_beneath_it_is_never_a_root(tree: str) -> None:
    assert root_problem(tree) == f"{tree} lies in the system tree {tree}, which is never lent"
    deeper = f"{tree}/local/workspaces"
    assert root_problem(deeper) == f"{deeper} lies in the system tree {tree}, which is never lent"


@pytest.mark.parametrize(
    "tree", sorted({t for t in SYSTEM_TREES if posixpath.dirname(t) != "/"}, key=str)
)
def test_a_directory_holding_a_system_tree_is_never_a_root(tree: str) -> None:
    above = posixpath.dirname(tree)  # /var holds /var/lib, /var/log, ...
    problem = root_problem(above)
    assert problem is not None and problem.startswith(f"{above} holds the system tree /var/")


@pytest.mark.parametrize("root", NEVER_ROOTS)
def test_slash_and_srv_themselves_are_never_roots(root: str) -> None:
    problem = root_problem(root)
    assert problem is not None
    assert "name the directory" in problem  # what to do instead


@pytest.mark.parametrize(
    "root",
    [
        *(str(r) for r in DEFAULT_LENDABLE_ROOTS),
        "/srv/workspaces",
        "/srv/gatewayd/ws",
        "/mnt/data",
        "/media/disk/work",
        "/data/workspaces",
        "/home/alice/projects",
        "/var/tmp/ci",
    ],
)
def test_places_where_workspaces_live_may_be_roots(root: str) -> None:
    assert root_problem(root) is None


@pytest.mark.parametrize("root", ["/tmp/../usr", "/tmp/./x", "//tmp", "/tmp/", "tmp", ""])
def test_a_root_must_be_absolute_and_normalized(root: str) -> None:
    assert root_problem(root) == (
        f"{root!r} must be an absolute, normalized path (no '..', '.', '//')"
    )


def test_a_root_in_gatewayds_own_directories_is_refused() -> None:
    reserved = [("state_dir", Path("/srv/gw")), ("agent_dir", Path("/srv/gw-agent"))]
    assert root_problem("/srv/gw", reserved) == (
        "/srv/gw lies in gatewayd's own state_dir /srv/gw, which is never lent"
    )
    assert root_problem("/srv/gw-agent/x", reserved) == (
        "/srv/gw-agent/x lies in gatewayd's own agent_dir /srv/gw-agent, which is never lent"
    )
    # Above the state directory is the plan's concern (it never binds anything that
    # holds the state directory), and a root there lends its other directories.
    assert root_problem("/srv/workspaces", reserved) is None


# --- the configuration ----------------------------------------------------------------------


def test_the_default_roots_are_where_workspaces_live_on_a_fresh_host() -> None:
    assert GatewaydConfig().lendable_roots == (Path("/home"), Path("/tmp"), Path("/var/tmp"))


@pytest.mark.parametrize(
    ("roots", "says"),
    [
        (["/usr/local"], "/usr/local lies in the system tree /usr"),
        (["/srv/workspaces", "/"], "/ holds the whole system"),
        (["/var"], "/var holds the system tree /var/lib"),
        (["/var/lib/gatewayd-ws"], "lies in the system tree /var/lib"),
        (["/srv"], "/srv itself holds the host's service data"),
        (["/tmp/../etc"], "must be an absolute, normalized path"),
    ],
)
def test_the_file_refuses_a_root_naming_the_setting_and_what_to_do(
    roots: list[str], says: str
) -> None:
    with pytest.raises(pydantic.ValidationError) as caught:
        GatewaydConfig.model_validate({"lendable_roots": roots})
    text = str(caught.value)
    assert "lendable_roots" in text and says in text, text
    assert "e.g. /srv/workspaces" in text and HINT in text, text


def test_a_root_beneath_the_state_or_agent_directory_is_refused_with_both_settings() -> None:
    with pytest.raises(pydantic.ValidationError, match="gatewayd's own state_dir /srv/gw"):
        GatewaydConfig.model_validate({"state_dir": "/srv/gw", "lendable_roots": ["/srv/gw/ws"]})
    with pytest.raises(pydantic.ValidationError, match="gatewayd's own agent_dir /srv/gw-agent"):
        GatewaydConfig.model_validate(
            {"state_dir": "/srv/gw", "lendable_roots": ["/srv/gw-agent/ws"]}
        )


def test_the_variable_and_the_option_are_named_when_they_give_a_system_tree() -> None:
    with pytest.raises(ConfigError) as caught:
        resolve_settings(
            file=None,
            environ={"GATEWAYD_LENDABLE_ROOTS": "/srv/workspaces:/boot/x"},
            options={"lendable_roots": ("--lendable-root", (Path("/opt"),))},
        )
    text = str(caught.value)
    assert "GATEWAYD_LENDABLE_ROOTS: /boot/x lies in the system tree /boot" in text, text
    assert "--lendable-root: /opt lies in the system tree /opt" in text, text


def test_configured_roots_replace_the_defaults_and_say_where_they_came_from() -> None:
    settings = resolve_settings(
        file=None, environ={"GATEWAYD_LENDABLE_ROOTS": "/srv/workspaces::/home/ci"}
    )
    assert settings.config.lendable_roots == (Path("/srv/workspaces"), Path("/home/ci"))
    assert settings.sources["lendable_roots"] == "env GATEWAYD_LENDABLE_ROOTS"


# --- what a mount shows -------------------------------------------------------------------

ROOT_FS = "22 1 8:1 / / rw,relatime shared:1 - ext4 /dev/sda1 rw"


def _mounts(*lines: str) -> tuple[Mount, ...]:
    return parse_mountinfo("\n".join((ROOT_FS, *lines)))


def _line(mount_id: int, device: str, root: str, point: str) -> str:
    return f"{mount_id} 22 {device} {root} {point} rw,relatime - ext4 /dev/x rw"


@pytest.mark.parametrize(
    ("extra", "tree", "shows"),
    [
        ((), "/tmp/ws", None),
        ((_line(30, "8:1", "/usr", "/tmp/x"),), "/tmp/x/local/lib/probe", "/usr"),
        ((_line(30, "8:1", "/usr/local/lib", "/tmp/x"),), "/tmp/x/probe", "/usr"),
        ((_line(30, "8:1", "/", "/tmp/x"),), "/tmp/x/usr/local", "/"),
        ((_line(30, "8:1", "/", "/tmp/x"),), "/tmp/x", "/"),
        ((_line(30, "8:1", "/var", "/tmp/x"),), "/tmp/x/www", "/var/lib"),  # holds /var/lib
        ((_line(30, "8:1", "/etc/ssl", "/tmp/x"),), "/tmp/x/certs", "/etc"),
        ((_line(30, "8:1", "/home/me/data", "/tmp/x"),), "/tmp/x/ws", None),
        ((_line(30, "0:50", "/", "/tmp/x"),), "/tmp/x/ws", None),  # a tmpfs of its own
        # /boot is a partition of its own: a bind of it shows /boot however it is named.
        (
            (_line(25, "8:2", "/", "/boot"), _line(30, "8:2", "/grub", "/tmp/x")),
            "/tmp/x/ws",
            "/boot",
        ),
        # The same file system mounted again shows what the path within it says.
        (
            (_line(25, "8:2", "/", "/boot"), _line(30, "8:1", "/opt/app", "/tmp/x")),
            "/tmp/x",
            "/opt",
        ),
        # Mounts stack: the last one at a point is what the point shows.
        ((_line(30, "8:1", "/usr", "/tmp/x"), _line(31, "0:51", "/", "/tmp/x")), "/tmp/x", None),
    ],
)
def test_a_mount_between_the_root_and_the_tree_is_judged_by_what_it_shows(
    extra: tuple[str, ...], tree: str, shows: str | None
) -> None:
    mounts = _mounts(*extra)
    crossed = mounts_crossed(mounts, "/tmp", tree)
    found = [s for s in (system_tree_shown(mounts, p) for p in crossed) if s is not None]
    assert found == ([shows] if shows else [])


def test_subvolumes_of_one_file_system_are_told_apart_by_their_path_within_it() -> None:
    mounts = parse_mountinfo(
        "\n".join(
            (
                "22 1 0:31 /@ / rw - btrfs /dev/sda2 rw,subvol=/@",
                "23 22 0:31 /@home /home rw - btrfs /dev/sda2 rw,subvol=/@home",
                "30 23 0:31 /@/usr /home/me/x rw - btrfs /dev/sda2 rw,subvol=/@",
            )
        )
    )
    assert system_tree_shown(mounts, "/home") is None
    assert system_tree_shown(mounts, "/home/me/ws") is None
    assert system_tree_shown(mounts, "/home/me/x") == "/usr"


def test_a_roots_verdict_is_kept_for_one_mount_table_and_made_again_for_another() -> None:
    from gatewayd.sandbox import lendable

    plain = _mounts()
    private = (("state_dir", Path("/var/lib/gatewayd")),)
    assert lendable._root_verdict(plain, "/tmp", private) is None
    assert lendable._root_verdict(plain, "/tmp", private) is None  # kept
    # A bind mount of /usr onto the root: a new table, so the verdict is made again.
    bound = _mounts(_line(30, "8:1", "/usr", "/tmp"))
    assert lendable._root_verdict(bound, "/tmp", private) == (
        "it shows the system tree /usr (a mount)"
    )
    # And the old table's verdict, asked again, is the old table's.
    assert lendable._root_verdict(plain, "/tmp", private) is None
    # Each root and each set of private directories has a verdict of its own.
    assert lendable._root_verdict(plain, "/usr/x", private) == root_problem("/usr/x")
    assert lendable._root_verdict(plain, "/var/lib/gatewayd/x", private) == (
        "/var/lib/gatewayd/x lies in the system tree /var/lib, which is never lent"
    )
    near = (("agent_dir", Path("/tmp/agents")),)
    assert lendable._root_verdict(plain, "/tmp/agents/w", near) == (
        "/tmp/agents/w lies in gatewayd's own agent_dir /tmp/agents, which is never lent"
    )
    assert lendable._root_verdict(plain, "/tmp/agents/w", private) is None


def test_the_verdicts_of_one_table_start_afresh_past_their_bound() -> None:
    from gatewayd.sandbox import lendable

    mounts = _mounts()
    for n in range(lendable._MAX_VERDICTS + 5):
        assert lendable._root_verdict(mounts, f"/tmp/r{n}", ()) is None
    memo = lendable._MEMO.verdicts
    assert memo is not None and len(memo) <= lendable._MAX_VERDICTS


def test_a_mount_elsewhere_keeps_the_verdicts_and_the_system_trees_places(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # A run's own mounts (its namespace's pin, its session's view) change the table
    # between two judgements of one start without moving a root or a system tree: the
    # second judgement locates nothing again. A mount at or above the root does.
    from gatewayd.sandbox import lendable

    private = (("state_dir", Path("/var/lib/gatewayd")),)
    before = _mounts()
    assert lendable._root_verdict(before, "/tmp", private) is None
    located: list[str] = []
    real_locate = lendable.locate

    def counting(mounts: tuple[Mount, ...], path: str) -> tuple[str, str]:
        located.append(path)
        return real_locate(mounts, path)

    monkeypatch.setattr(lendable, "locate", counting)
    elsewhere = _mounts(
        _line(30, "0:4", "net:[4026532400]", "/run/netns/cg-x"),
        _line(31, "0:60", "/", "/var/lib/gatewayd/agents/ws/view"),
    )
    assert lendable._root_verdict(elsewhere, "/tmp", private) is None
    assert system_tree_shown(elsewhere, "/tmp/ws") is None
    assert located == ["/tmp/ws"]  # the path asked about, no system tree again
    bound = _mounts(
        _line(30, "0:4", "net:[4026532400]", "/run/netns/cg-x"), _line(32, "8:1", "/usr", "/tmp")
    )
    assert lendable._root_verdict(bound, "/tmp", private) == (
        "it shows the system tree /usr (a mount)"
    )
    # A mount over a system tree moves its place: found again, not kept.
    moved = _mounts(_line(33, "8:1", "/home/me/usr", "/usr"), _line(34, "8:1", "/usr", "/tmp/x"))
    assert system_tree_shown(moved, "/tmp/x") is None
    assert system_tree_shown(moved, "/usr") == "/usr"


def _verdict_by_scan(mounts: tuple[Mount, ...], real: str) -> str | None:
    """A root's verdict as the module's doc defines it, every place found by a
    comparison with every mount (nothing kept)."""
    problem = root_problem(real, ())
    if problem is not None:
        return problem
    device, where = _locate_by_scan(mounts, real)
    if (device, where) == _locate_by_scan(mounts, "/"):
        return "it shows the system tree / (a mount)"
    for tree in SYSTEM_TREES:
        tree_device, tree_where = _locate_by_scan(mounts, tree)
        if device == tree_device and (is_within(where, tree_where) or is_within(tree_where, where)):
            return f"it shows the system tree {tree} (a mount)"
    return None


_TABLE_POINTS = st.sampled_from(
    ["/tmp", "/tmp/x", "/tmp/x/y", "/run/netns/a", "/usr", "/var", "/var/lib", "/srv/w", "/"]
)
_TABLE_ROOTS = st.sampled_from(["/", "/usr", "/usr/local", "/var", "/var/lib", "/home/me", "/x"])


@settings(max_examples=examples(100), deadline=None)
@given(
    tables=st.lists(
        st.lists(
            st.tuples(_TABLE_POINTS, st.sampled_from(["8:1", "0:5"]), _TABLE_ROOTS), max_size=4
        ),
        min_size=1,
        max_size=6,
    ),
    real=st.sampled_from(["/tmp", "/tmp/x", "/tmp/x/y/z", "/srv/w/a", "/home/u"]),
)
def test_a_kept_verdict_is_the_one_a_fresh_look_at_each_table_gives(
    tables: list[list[tuple[str, str, str]]], real: str
) -> None:
    # Tables one after the other, as a daemon reads them between runs: each verdict
    # (kept or made again) is what comparing every mount of that table says.
    from gatewayd.sandbox import lendable

    for extra in tables:
        mounts = _mounts(*(_line(30 + n, *row[1:], row[0]) for n, row in enumerate(extra)))
        assert lendable._root_verdict(mounts, real, ()) == _verdict_by_scan(mounts, real)


def _locate_by_scan(mounts: tuple[Mount, ...], path: str) -> tuple[str, str]:
    """locate as its doc defines it: every mount compared, the deepest point at or above
    ``path`` wins, the last mounted at a point."""
    best = None
    for mount in mounts:
        if is_within(path, mount.point) and (best is None or len(mount.point) >= len(best.point)):
            best = mount
    if best is None:
        return ("", path)
    rest = posixpath.relpath(path, best.point)
    return (best.device, posixpath.normpath(posixpath.join(best.root, rest)))


_PARTS = st.sampled_from(["tmp", "x", "usr", "a b", "lib", "ws", "..", "."])
_PATHS = st.lists(_PARTS, max_size=4).map(lambda parts: "/" + "/".join(parts))
_POINTS = st.one_of(_PATHS, st.sampled_from(["", "/tmp/", "//tmp", "/tmp//x", "tmp"]))


@settings(max_examples=examples(300), deadline=None)
@given(
    points=st.lists(st.tuples(_POINTS, st.sampled_from(["8:1", "0:5"]), _PATHS), max_size=8),
    path=st.one_of(_PATHS, _POINTS),
)
def test_locate_finds_what_a_comparison_with_every_mount_finds(
    points: list[tuple[str, str, str]], path: str
) -> None:
    # Clean or not (a malformed point or path takes the comparison with every mount);
    # the same answer, or the same error (an empty path has no relative path).
    mounts = tuple(Mount(device=dev, root=root, point=point) for point, dev, root in points)

    def outcome(find: Callable[[tuple[Mount, ...], str], tuple[str, str]]) -> object:
        try:
            return find(mounts, path)
        except ValueError as exc:
            return ("raised", str(exc))

    assert outcome(locate) == outcome(_locate_by_scan)
    mounts = (*mounts,)  # a fresh table: its own index
    assert outcome(locate) == outcome(_locate_by_scan)


def test_only_mounts_strictly_beneath_the_root_and_at_or_above_the_tree_are_crossed() -> None:
    mounts = _mounts(
        _line(30, "0:50", "/", "/tmp"),
        _line(31, "0:51", "/", "/tmp/a"),
        _line(32, "0:52", "/", "/tmp/a/b"),
        _line(33, "0:53", "/", "/tmp/other"),
        _line(34, "0:54", "/", "/tmp/a/b/c/d"),
    )
    assert mounts_crossed(mounts, "/tmp", "/tmp/a/b/c") == ["/tmp/a", "/tmp/a/b"]


def test_mountinfo_escapes_are_read_back() -> None:
    (mount,) = parse_mountinfo(r"30 22 8:1 /usr/my\040dir /tmp/a\134b\011c rw - ext4 /dev/x rw")
    assert (mount.device, mount.root, mount.point) == ("8:1", "/usr/my dir", "/tmp/a\\b\tc")


# --- judged on real paths -------------------------------------------------------------------


def test_a_root_that_is_really_a_system_tree_is_refused_naming_where_it_leads(
    tmp_path: Path,
) -> None:
    (tmp_path / "run").symlink_to("/run")
    root = tmp_path / "run" / "x"
    assert real_root_problem(root) == (
        f"{root} is really /run/x, and /run/x lies in the system tree /run, which is never lent"
    )
    assert real_root_problem(tmp_path / "workspaces") is None


@pytest.mark.skipif(not os.path.islink("/var/run"), reason="this host's /var/run is no symlink")
def test_the_variable_giving_var_run_is_refused_as_the_run_it_really_is() -> None:
    real = os.path.realpath("/var/run/x")
    with pytest.raises(ConfigError) as caught:
        resolve_settings(file=None, environ={"GATEWAYD_LENDABLE_ROOTS": "/srv/ws:/var/run/x"})
    text = str(caught.value)
    assert f"GATEWAYD_LENDABLE_ROOTS: /var/run/x is really {real}, and {real} lies in " in text
    assert HINT in text, text


def test_a_root_leading_into_the_state_directory_is_refused_however_either_is_written(
    tmp_path: Path,
) -> None:
    real = tmp_path / "real"
    (real / "state" / "ws").mkdir(parents=True)
    (tmp_path / "lnk").symlink_to(real)
    (tmp_path / "srv-ws").symlink_to(real / "state" / "ws")
    # The root through a symlink, the state directory as it is.
    with pytest.raises(pydantic.ValidationError) as caught:
        GatewaydConfig.model_validate(
            {"state_dir": str(real / "state"), "lendable_roots": [str(tmp_path / "srv-ws")]}
        )
    assert (
        f"{tmp_path}/srv-ws is really {real}/state/ws, and {real}/state/ws lies in gatewayd's "
        f"own state_dir {real}/state, which is never lent"
    ) in str(caught.value)
    # The root as it is, the state directory through a symlink.
    with pytest.raises(pydantic.ValidationError) as caught:
        GatewaydConfig.model_validate(
            {"state_dir": str(tmp_path / "lnk" / "state"), "lendable_roots": [str(real / "state")]}
        )
    assert f"{real}/state lies in gatewayd's own state_dir {real}/state" in str(caught.value)


@pytest.mark.parametrize(
    ("root", "says"),
    [
        ("/usr/local", "/usr/local lies in the system tree /usr, which is never lent"),
        ("TMP/run/x", "TMP/run/x is really /run/x, and /run/x lies in the system tree /run"),
        ("TMP/state/ws", "TMP/state/ws lies in gatewayd's own state_dir TMP/state"),
        ("TMP/state-agent", "TMP/state-agent lies in gatewayd's own agent_dir TMP/state-agent"),
    ],
)
def test_a_configuration_made_in_code_refuses_a_root_as_the_file_does(
    tmp_path: Path, root: str, says: str
) -> None:
    (tmp_path / "run").symlink_to("/run")
    with pytest.raises(pydantic.ValidationError) as caught:
        GatewaydConfig(
            state_dir=tmp_path / "state",
            lendable_roots=(Path("/srv/ws"), Path(root.replace("TMP", str(tmp_path)))),
        )
    [error] = caught.value.errors()
    where = ".".join(str(part) for part in error["loc"])  # the setting, or the whole
    message = f"{where}: {error['ctx']['error']}" if where else str(error["ctx"]["error"])
    assert message.startswith(f"lendable_roots: {says.replace('TMP', str(tmp_path))}"), message
    assert message.endswith(f"; change {HINT}"), message


def test_the_daemons_own_directories_are_made_real_once_keeping_what_derives_from_them(
    tmp_path: Path,
) -> None:
    real = tmp_path / "real"
    (real / "logs").mkdir(parents=True)
    (tmp_path / "lnk").symlink_to(real)
    link = tmp_path / "lnk"
    config = GatewaydConfig(
        state_dir=link / "state",
        audit_path=link / "logs" / "audit.jsonl",
        control_socket=link / "control.sock",
    )
    made = config.with_real_dirs()
    assert made.state_dir == real / "state"
    assert made.audit_path == real / "logs" / "audit.jsonl"
    assert made.resolved_agent_dir == real / "state-agent"
    assert made.control_socket == real / "control.sock"
    # Named after the state directory as configured, before and after.
    assert made.resolved_netns_prefix == config.resolved_netns_prefix
    assert made.resolved_sandbox_uids == config.resolved_sandbox_uids
    assert made.with_real_dirs() == made
    served = made.own_directories(control_socket=made.control_socket)
    assert [(d.setting, d.path, d.private) for d in served] == [
        ("state_dir", real / "state", True),
        ("agent_dir", real / "state-agent", True),
        ("audit_path's directory", real / "logs", False),
        ("control_socket's directory", real, False),
    ]
    # A daemon serving no control socket (`gatewayd run`) keeps no directory for one.
    assert made.own_directories(control_socket=None) == served[:3]


def test_the_sandbox_settings_take_the_state_directory_only_as_its_real_path(
    tmp_path: Path,
) -> None:
    (tmp_path / "real" / "state").mkdir(parents=True)
    (tmp_path / "lnk").symlink_to(tmp_path / "real")
    layout = HostLayout(system_links=(), system_dirs=("usr",), etc_entries=())
    with pytest.raises(ValueError) as caught:
        SandboxSettings(
            bwrap="/usr/bin/bwrap",
            netns_prefix="cgt-",
            state_dir=tmp_path / "lnk" / "state",
            cogni_tool_dir=tmp_path / "lnk" / "state" / "cogni-tool",
            layout=layout,
        )
    assert str(caught.value) == (
        f"the state directory must be given as its real path ({tmp_path}/real/state), not "
        f"{tmp_path}/lnk/state: the sandbox plan compares real paths with it"
    )


_MOUNT_LINES = st.sampled_from(
    [
        ROOT_FS,
        _line(30, "8:1", "/usr", "/tmp/x"),
        _line(31, "0:4", "net:[4026532400]", "/run/netns/cg-x"),
        _line(32, "0:60", "/", "/tmp/a\\040b"),
        "too short",
        "",
    ]
)


@settings(max_examples=examples(100), deadline=None)
@given(texts=st.lists(st.lists(_MOUNT_LINES, max_size=6).map("\n".join), min_size=1, max_size=5))
def test_a_table_read_again_is_parsed_as_a_fresh_parse_would(texts: list[str]) -> None:
    # Tables one after the other (each run's mounts change a line or two): the lines
    # kept from the last one give the parse a fresh parse gives, in order, duplicates and
    # all, a line too short skipped.
    from gatewayd.sandbox.lendable import mounts_of

    for text in texts:
        assert mounts_of(text) == parse_mountinfo(text)
