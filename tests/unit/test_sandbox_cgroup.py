"""The pure half of ``gatewayd.sandbox.cgroup``: reading what the kernel says about cgroups
and deciding what to write, table-tested for v1, v2 and hybrid hosts without a cgroup file
system. Every parse error names the file and the expected shape."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import trio
import trio.testing

from gatewayd.sandbox.cgroup import (
    REMOVE_AFTER_S,
    CgroupEntry,
    CgroupError,
    CgroupMount,
    CgroupSupport,
    CgroupVersion,
    CommandCgroup,
    DeferredRemovals,
    EnterLeaf,
    OwnCgroups,
    command_cgroup_name,
    find_own_cgroups,
    memory_settings,
    oom_counter_file,
    oom_kill_count,
    parse_counters,
    parse_mountinfo,
    parse_proc_cgroup,
    pids_settings,
    swap_limit_file,
    v2_parent,
)

V1 = CgroupVersion.V1
V2 = CgroupVersion.V2
RUN_ID = "0123456789abcdef" * 2

# What this project's build machine shows: cgroup v1 hybrid, memory below the root.
HYBRID_PROC_CGROUP = """\
9:name=systemd:/
8:pids:/
4:memory:/process_api/14b98ec6e52c746444075ea0e66de982
2:cpu,cpuacct:/
0::/
"""
HYBRID_MOUNTINFO = """\
22 1 0:21 / / rw,relatime - overlay overlay rw
31 23 0:28 / /sys/fs/cgroup rw,relatime - tmpfs tmpfs rw,mode=755
32 31 0:29 / /sys/fs/cgroup/cpu,cpuacct rw,relatime - cgroup cgroup rw,cpu,cpuacct
35 31 0:32 / /sys/fs/cgroup/memory rw,relatime - cgroup cgroup rw,memory
39 31 0:36 / /sys/fs/cgroup/pids rw,relatime - cgroup cgroup rw,pids
40 31 0:37 / /sys/fs/cgroup/systemd rw,relatime - cgroup cgroup rw,name=systemd
41 31 0:38 / /sys/fs/cgroup/unified rw,relatime - cgroup2 cgroup2 rw
"""
# Debian 12 under systemd: one unified hierarchy; mountinfo has optional fields.
UNIFIED_PROC_CGROUP = "0::/system.slice/gatewayd.service/supervisor\n"
UNIFIED_MOUNTINFO = (
    "26 1 259:2 / / rw,relatime shared:1 - ext4 /dev/root rw\n"
    "28 23 0:24 / /sys/fs/cgroup rw,nosuid,nodev,noexec,relatime shared:4 - cgroup2 cgroup2 "
    "rw,nsdelegate,memory_recursiveprot\n"
)


# --- /proc/self/cgroup -------------------------------------------------------------------


def test_proc_cgroup_lines_give_hierarchy_controllers_and_path() -> None:
    entries = parse_proc_cgroup(HYBRID_PROC_CGROUP)
    assert entries[2] == CgroupEntry(
        hierarchy_id=4,
        controllers=frozenset({"memory"}),
        path="/process_api/14b98ec6e52c746444075ea0e66de982",
    )
    assert entries[3].controllers == frozenset({"cpu", "cpuacct"})
    assert entries[4] == CgroupEntry(hierarchy_id=0, controllers=frozenset(), path="/")


def test_a_cgroup_path_may_contain_colons() -> None:
    (entry,) = parse_proc_cgroup("0::/a:b/c\n")
    assert entry.path == "/a:b/c"


def test_blank_proc_cgroup_lines_are_skipped() -> None:
    assert parse_proc_cgroup("\n0::/\n\n") == (
        CgroupEntry(hierarchy_id=0, controllers=frozenset(), path="/"),
    )


@pytest.mark.parametrize("line", ["memory:/x", "x:memory:/x", "4:memory:relative"])
def test_a_malformed_proc_cgroup_line_is_an_error_showing_the_expected_shape(line: str) -> None:
    with pytest.raises(CgroupError, match=r"unreadable line .* 'hierarchy-id:controllers:/path'"):
        parse_proc_cgroup(line)


# --- mountinfo ---------------------------------------------------------------------------


def test_mountinfo_keeps_only_cgroup_mounts_with_version_root_and_options() -> None:
    mounts = parse_mountinfo(HYBRID_MOUNTINFO)
    assert [mount.mount_point for mount in mounts] == [
        "/sys/fs/cgroup/cpu,cpuacct",
        "/sys/fs/cgroup/memory",
        "/sys/fs/cgroup/pids",
        "/sys/fs/cgroup/systemd",
        "/sys/fs/cgroup/unified",
    ]
    assert mounts[1] == CgroupMount(
        mount_point="/sys/fs/cgroup/memory",
        root="/",
        version=V1,
        options=frozenset({"rw", "memory"}),
    )
    assert mounts[4].version == V2


def test_mountinfo_optional_fields_and_octal_escapes_are_read() -> None:
    line = r"50 1 0:40 /in\040ner /mnt/cg\040roup rw shared:7 master:2 - cgroup2 none rw" + "\n"
    (mount,) = parse_mountinfo(line)
    assert (mount.mount_point, mount.root, mount.version) == ("/mnt/cg roup", "/in ner", V2)


def test_a_truncated_cgroup_mount_line_is_an_error_showing_the_expected_shape() -> None:
    with pytest.raises(CgroupError, match=r"unreadable cgroup mount .* - fstype source options"):
        parse_mountinfo("35 31 0:32 / /sys/fs/cgroup/memory - cgroup cgroup\n")


# --- which directories are ours --------------------------------------------------------


def test_on_a_hybrid_host_memory_and_pids_are_v1_directories_of_our_cgroups() -> None:
    own = find_own_cgroups(parse_proc_cgroup(HYBRID_PROC_CGROUP), parse_mountinfo(HYBRID_MOUNTINFO))
    assert own == OwnCgroups(
        v1_memory=Path("/sys/fs/cgroup/memory/process_api/14b98ec6e52c746444075ea0e66de982"),
        v1_pids=Path("/sys/fs/cgroup/pids"),
        v2=Path("/sys/fs/cgroup/unified"),
        v2_mount=Path("/sys/fs/cgroup/unified"),
    )


def test_on_a_unified_host_only_the_v2_directory_is_found() -> None:
    own = find_own_cgroups(
        parse_proc_cgroup(UNIFIED_PROC_CGROUP), parse_mountinfo(UNIFIED_MOUNTINFO)
    )
    assert own == OwnCgroups(
        v1_memory=None,
        v1_pids=None,
        v2=Path("/sys/fs/cgroup/system.slice/gatewayd.service/supervisor"),
        v2_mount=Path("/sys/fs/cgroup"),
    )


@pytest.mark.parametrize(
    ("path", "mount_root", "expected"),
    [
        ("/a/b", "/a", Path("/cg/b")),  # a container's bind mount of an inner cgroup
        ("/a", "/a", Path("/cg")),
        ("/other/b", "/a", None),  # outside the mounted root: not reachable from here
        ("/ab", "/a", None),  # a name prefix is not a parent
        ("/../outside", "/", None),  # outside our cgroup namespace
    ],
)
def test_a_cgroup_maps_to_a_directory_only_below_the_mounts_root(
    path: str, mount_root: str, expected: Path | None
) -> None:
    entries = (CgroupEntry(hierarchy_id=4, controllers=frozenset({"memory"}), path=path),)
    mounts = (
        CgroupMount(mount_point="/cg", root=mount_root, version=V1, options=frozenset({"memory"})),
    )
    assert find_own_cgroups(entries, mounts).v1_memory == expected


def test_a_v1_hierarchy_matches_only_a_mount_with_its_controllers() -> None:
    entries = (CgroupEntry(hierarchy_id=4, controllers=frozenset({"memory"}), path="/x"),)
    mounts = (CgroupMount(mount_point="/cg", root="/", version=V1, options=frozenset({"pids"})),)
    assert find_own_cgroups(entries, mounts).v1_memory is None


# --- counters ----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("oom_kill_disable 0\nunder_oom 0\noom_kill 0\n", 0),  # v1 memory.oom_control
        ("oom_kill_disable 0\nunder_oom 1\noom_kill 3\n", 3),
        ("low 0\nhigh 0\nmax 12\noom 2\noom_kill 1\noom_group_kill 0\n", 1),  # v2 events
    ],
)
def test_the_oom_kill_counter_is_read_from_v1_and_v2_files(text: str, expected: int) -> None:
    assert oom_kill_count(text, source="memory.x") == expected


def test_a_kernel_without_the_oom_kill_counter_is_an_error_naming_the_version_needed() -> None:
    with pytest.raises(CgroupError, match=r"memory.oom_control has no 'oom_kill'.*4\.13"):
        oom_kill_count("oom_kill_disable 0\nunder_oom 0\n", source="memory.oom_control")


def test_a_counter_line_that_is_not_name_and_number_is_an_error_naming_the_file() -> None:
    with pytest.raises(CgroupError, match=r"'oom_kill x' in memory.events: expected 'name number'"):
        parse_counters("oom_kill x\n", source="memory.events")


# --- what to write ----------------------------------------------------------------------


@pytest.mark.parametrize(
    ("version", "swap_limited", "expected"),
    [
        (V1, True, (("memory.limit_in_bytes", "1000"), ("memory.memsw.limit_in_bytes", "1000"))),
        (V1, False, (("memory.limit_in_bytes", "1000"), ("memory.swappiness", "0"))),
        (V2, True, (("memory.max", "1000"), ("memory.swap.max", "0"))),
        (V2, False, (("memory.max", "1000"),)),
    ],
)
def test_memory_settings_include_swap_in_the_limit_in_an_order_the_kernel_accepts(
    version: CgroupVersion, swap_limited: bool, expected: tuple[tuple[str, str], ...]
) -> None:
    assert memory_settings(version, 1000, swap_limited=swap_limited) == expected


def test_pids_and_counter_files_per_version() -> None:
    assert pids_settings(24) == (("pids.max", "24"),)
    assert (oom_counter_file(V1), oom_counter_file(V2)) == ("memory.oom_control", "memory.events")
    assert swap_limit_file(V1) == "memory.memsw.limit_in_bytes"
    assert swap_limit_file(V2) == "memory.swap.max"


def test_a_command_cgroup_name_carries_the_run_id_and_a_suffix() -> None:
    assert command_cgroup_name(RUN_ID, "0a1b2c3d") == f"cogni-{RUN_ID}-0a1b2c3d"


@pytest.mark.parametrize(
    ("run_id", "suffix"), [("../" + RUN_ID[3:], "0a1b2c3d"), (RUN_ID.upper(), "0a1b2c3d"),
                           (RUN_ID, "0a1b2c3"), (RUN_ID, "0a1b/c3d")],
)  # fmt: skip
def test_a_command_cgroup_name_refuses_anything_but_hex_ids(run_id: str, suffix: str) -> None:
    with pytest.raises(ValueError, match="run id must be 32 lowercase hex digits and the suffix 8"):
        command_cgroup_name(run_id, suffix)


# --- where v2 command cgroups may go ----------------------------------------------------

OWN = Path("/sys/fs/cgroup/system.slice/gatewayd.service/supervisor")
MEM = frozenset({"memory", "pids"})


def test_v2_uses_our_own_cgroup_when_it_already_hands_memory_down() -> None:
    assert v2_parent(OWN, own_subtree=MEM, parent_subtree=None, parent_delegated=False) == OWN


def test_v2_goes_beside_the_daemon_in_a_delegated_parent_that_enables_memory() -> None:
    parent = v2_parent(OWN, own_subtree=frozenset(), parent_subtree=MEM, parent_delegated=True)
    assert parent == OWN.parent


@pytest.mark.parametrize(
    ("parent_subtree", "delegated", "reason"),
    [
        (MEM, False, r"holds processes.*not delegated.*Delegate=yes, DelegateSubgroup="),
        (frozenset({"cpu"}), True, r"does not enable memory.*echo '\+memory \+pids' > "),
        (None, False, r"top of the cgroup tree.*edits no cgroup it was not given"),
    ],
)
def test_v2_without_a_usable_parent_says_why_and_how_to_delegate(
    parent_subtree: frozenset[str] | None, delegated: bool, reason: str
) -> None:
    answer = v2_parent(
        OWN, own_subtree=frozenset(), parent_subtree=parent_subtree, parent_delegated=delegated
    )
    assert isinstance(answer, str)
    assert re.search(reason, answer), answer


# systemd 252's Delegate=yes (no DelegateSubgroup=): gatewayd is in the delegated cgroup.
SERVICE = OWN.parent


def test_v2_in_its_own_delegated_cgroup_moves_into_a_leaf_handing_controllers_down() -> None:
    answer = v2_parent(
        SERVICE,
        own_subtree=frozenset(),
        parent_subtree=frozenset({"memory", "pids", "cpu"}),
        parent_delegated=False,  # system.slice: systemd's, not gatewayd's
        own_delegated=True,
        own_controllers=frozenset({"cpu", "io", "memory", "pids"}),
    )
    assert answer == EnterLeaf(SERVICE, MEM)


def test_v2_delegated_without_pids_enables_memory_alone() -> None:
    answer = v2_parent(
        SERVICE,
        own_subtree=frozenset(),
        parent_subtree=frozenset({"memory"}),
        parent_delegated=False,
        own_delegated=True,
        own_controllers=frozenset({"memory"}),
    )
    assert answer == EnterLeaf(SERVICE, frozenset({"memory"}))


def test_v2_delegated_without_the_memory_controller_says_where_to_enable_it() -> None:
    answer = v2_parent(
        SERVICE,
        own_subtree=frozenset(),
        parent_subtree=frozenset({"pids"}),
        parent_delegated=False,
        own_delegated=True,
        own_controllers=frozenset({"pids"}),
    )
    assert isinstance(answer, str)
    assert "delegated cgroup" in answer and "no memory controller" in answer
    assert "enable memory in the slice above it" in answer


def test_v2_prefers_a_delegated_parent_that_already_has_the_leaf_layout() -> None:
    # DelegateSubgroup= (systemd 254+) made the leaf: nothing is moved.
    answer = v2_parent(
        OWN,
        own_subtree=frozenset(),
        parent_subtree=MEM,
        parent_delegated=True,
        own_delegated=True,
        own_controllers=MEM,
    )
    assert answer == OWN.parent


# --- the support value ----------------------------------------------------------------------


def test_unavailable_support_keeps_its_reason_and_has_no_parents() -> None:
    support = CgroupSupport.unavailable("no memory controller")
    assert (support.available, support.version, support.pids_parent) == (False, None, None)
    assert support.reason == "no memory controller"


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"version": V1, "memory_parent": None}, "version exactly when it has a memory parent"),
        ({"version": None, "memory_parent": None, "reason": ""}, "says why"),
        ({"version": V2, "memory_parent": Path("/a"), "pids_parent": Path("/b")}, "share one"),
    ],
)
def test_support_refuses_inconsistent_values(kwargs: dict[str, object], message: str) -> None:
    values: dict[str, object] = {
        "version": V1,
        "memory_parent": Path("/a"),
        "pids_parent": None,
        "swap_limited": True,
        "reason": "r",
    }
    values.update(kwargs)
    with pytest.raises(ValueError, match=message):
        CgroupSupport(**values)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("events", "hit"),
    [("max 0\n", False), ("max 3\n", True), ("", None), ("max x\n", None), (None, None)],
)
def test_pids_limit_hit_reads_the_max_counter_and_never_fails(
    tmp_path: Path, events: str | None, hit: bool | None
) -> None:
    if events is not None:
        (tmp_path / "pids.events").write_text(events)
    cgroup = CommandCgroup(version=V1, memory_dir=tmp_path / "memory", pids_dir=tmp_path)
    assert cgroup.pids_limit_hit() is hit
    assert CommandCgroup(version=V1, memory_dir=tmp_path, pids_dir=None).pids_limit_hit() is None


def test_a_forked_child_joins_by_tasks_in_v1_and_by_cgroup_procs_in_v2(tmp_path: Path) -> None:
    # v1: the per-thread file (the child's only thread is the whole process, and the
    # kernel moves it without the global lock a whole thread group's move takes).
    v1 = CommandCgroup(version=V1, memory_dir=tmp_path / "m", pids_dir=tmp_path / "p")
    assert v1.join_files == (
        str(tmp_path / "m" / "tasks").encode(),
        str(tmp_path / "p" / "tasks").encode(),
    )
    assert v1.procs_files == (
        str(tmp_path / "m" / "cgroup.procs").encode(),
        str(tmp_path / "p" / "cgroup.procs").encode(),
    )
    # v2: one directory for both controllers, and cgroup.threads cannot cross domains.
    v2 = CommandCgroup(version=V2, memory_dir=tmp_path / "c", pids_dir=tmp_path / "c")
    assert v2.join_files == (str(tmp_path / "c" / "cgroup.procs").encode(),)
    without_pids = CommandCgroup(version=V1, memory_dir=tmp_path / "m", pids_dir=None)
    assert without_pids.join_files == (str(tmp_path / "m" / "tasks").encode(),)


class Removal:
    """Stands in for a command's cgroup: when its removal began (trio's clock)."""

    def __init__(self) -> None:
        self.memory_dir = Path("/sys/fs/cgroup/memory/cogni-stand-in")
        self.started: float | None = None

    async def remove(self) -> None:
        self.started = trio.current_time()


async def test_a_deferred_removal_starts_after_the_answers_work_unless_its_owner_waits(
    autojump_clock: trio.testing.MockClock,
) -> None:
    removals = DeferredRemovals()
    later, hurried, after = Removal(), Removal(), Removal()
    handed = trio.current_time()
    removals.remove_later(later)  # type: ignore[arg-type]
    await trio.sleep(REMOVE_AFTER_S / 2)
    assert later.started is None  # the answer's work goes first
    await trio.sleep(REMOVE_AFTER_S)
    assert later.started == pytest.approx(handed + REMOVE_AFTER_S)
    # The owner's wait (a run's end) does not wait for the delay: it starts them now.
    removals.remove_later(hurried)  # type: ignore[arg-type]
    waited = trio.current_time()
    assert await removals.wait() == ()
    assert hurried.started == waited
    # ... and every removal handed over afterwards starts at once (the owner is ending).
    removals.remove_later(after)  # type: ignore[arg-type]
    assert await removals.wait() == ()
    assert after.started == waited
