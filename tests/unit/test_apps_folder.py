"""The workspace's apps folder is refused to every fs tool call, however its path is
written and whatever leads there: the policy step on the path as written (every
spelling, table-driven), the binding of a policy's paths, and the fs tools on real
directories (symlinks, hard links, another mount of the folder), with both resolvers.

The same rules from inside a real sandbox: tests/integration/test_apps_folder_sandbox.py.
"""

from __future__ import annotations

import ctypes
import os
import shutil
import stat
import subprocess
from pathlib import Path, PurePosixPath
from typing import Any

import msgspec
import pytest
import trio

from gatewayd.errors import GatewayError
from gatewayd.hostpaths.beneath import Resolver
from gatewayd.hostpaths.binding import bind_paths
from gatewayd.policy import PathGrant, PathMode, PolicyError, resolve_path
from gatewayd.policy.appsfolder import (
    apps_parts_beneath,
    in_apps_folder,
    is_apps_name,
    lies_in_apps_folder,
)
from gatewayd.policy.capabilities import Deny, RunRights, check_call
from gatewayd.policy.model import NetworkSection
from gatewayd.protocol import ErrorCode
from gatewayd.sandbox.appsfolder import (
    APPS_WALK_MAX_DEPTH,
    MADE_FOLDER_MODE,
    MADE_RECORD,
    AppsFolderRefused,
    MadeFolder,
    prepare_apps_folder,
    remove_leftover_folder,
    remove_made_folder,
)
from gatewayd.tools import builtin_tools
from gatewayd.tools.registry import ToolContext
from tests.unit.test_path_binding import policy_with_paths

TOOLS = builtin_tools()
MANIFEST = "APP-MANIFEST-SECRET"
APP_DATA = "APP-DATA-SECRET"
LONG_S = "\u017f"  # LATIN SMALL LETTER LONG S: casefolds to "s"

WS = PathGrant(
    name="workspace",
    host_root=Path("/host/ws"),
    root_id=(1, 10),
    holds_nested=False,
    visible_root=PurePosixPath("/workspace"),
    mode=PathMode.RW,
    apps_parts=("apps",),
)
# A read-only grant holding the whole workspace (at /host/ws), seen at /data/host.
HOLDER = PathGrant(
    name="holder",
    host_root=Path("/host"),
    root_id=(1, 9),
    holds_nested=True,
    visible_root=PurePosixPath("/data/host"),
    mode=PathMode.RO,
    apps_parts=("ws", "apps"),
)
DOCS = PathGrant(
    name="docs",
    host_root=Path("/host/ws/docs"),
    root_id=(1, 11),
    holds_nested=False,
    visible_root=PurePosixPath("/workspace/docs"),
    mode=PathMode.RO,
)
GRANTS = (WS, HOLDER, DOCS)


# --- the name and where the folder lies --------------------------------------------------


@pytest.mark.parametrize(
    ("name", "spells"),
    [
        ("apps", True),
        ("APPS", True),
        ("Apps", True),
        (f"app{LONG_S}", True),
        ("apps ", False),
        ("app", False),
        ("apps2", False),
        ("myapps", False),
        ("apps.md", False),
        (".apps", False),
        ("apps\x00", False),
    ],
)
def test_the_folder_name_is_apps_in_any_case(name: str, spells: bool) -> None:
    assert is_apps_name(name) is spells


def test_in_apps_folder_matches_the_folder_and_beneath_it_only() -> None:
    assert in_apps_folder(("apps",), ("apps",))
    assert in_apps_folder(("APPS", "x", "data"), ("apps",))
    assert in_apps_folder(("ws", "apps", "x"), ("ws", "apps"))
    assert not in_apps_folder(("WS", "apps", "x"), ("ws", "apps"))  # only its own name folds
    assert not in_apps_folder(("docs", "apps"), ("apps",))
    assert not in_apps_folder((), ("apps",))
    assert not in_apps_folder(("ws",), ("ws", "apps"))
    assert not in_apps_folder(("apps",), None)


def test_where_the_folder_lies_beneath_a_root() -> None:
    ws = PurePosixPath("/host/ws")
    assert apps_parts_beneath(ws, ws) == ("apps",)
    assert apps_parts_beneath(PurePosixPath("/host"), ws) == ("ws", "apps")
    assert apps_parts_beneath(PurePosixPath("/host/ws/docs"), ws) is None
    assert apps_parts_beneath(PurePosixPath("/elsewhere"), ws) is None
    assert lies_in_apps_folder(PurePosixPath("/host/ws/apps"), ws)
    assert lies_in_apps_folder(PurePosixPath("/host/ws/APPS/x/data"), ws)
    assert not lies_in_apps_folder(PurePosixPath("/host/ws/docs/apps"), ws)
    assert not lies_in_apps_folder(ws, ws)


# --- the policy step: every spelling of a path into the folder ---------------------------

IN_THE_FOLDER = [
    "apps",
    "apps/",
    "apps/note-taker/APP.md",
    "/workspace/apps",
    "/workspace/apps/",
    "/workspace/apps/note-taker/data/notes.md",
    "./apps/note-taker/APP.md",
    "apps/./note-taker/APP.md",
    "apps/../apps/note-taker/APP.md",
    "docs/../apps/note-taker/APP.md",
    "nope/../../workspace/apps/x",
    "//workspace//apps//note-taker/APP.md",
    "/../workspace/apps/x",
    "/workspace/./apps/x/",
    "APPS/note-taker/APP.md",
    "Apps",
    "/workspace/aPpS/x/data/f",
    f"app{LONG_S}/x",
]
BESIDE_THE_FOLDER = [
    "apps.md",
    "apps2/x",
    "myapps/x",
    "app/x",
    "docs/apps/x",  # an apps directory elsewhere is a directory like any
    "apps /x",
    ".apps/x",
    "/workspace",
    ".",
]


@pytest.mark.parametrize("path", IN_THE_FOLDER)
@pytest.mark.parametrize("access", ["read", "write"])
def test_every_spelling_of_a_path_in_the_folder_is_policy_denied(path: str, access: str) -> None:
    denied = resolve_path(path, "write" if access == "write" else "read", GRANTS)
    assert isinstance(denied, Deny), denied
    assert denied.code is ErrorCode.POLICY_DENIED
    verb = "write to" if access == "write" else "read"
    assert denied.message.startswith(f"Cannot {verb} '{path}': it lies in the apps folder"), (
        denied.message
    )
    assert "it lies in the apps folder '/workspace/apps'" in denied.message
    spelled = next(p for p in path.split("/") if p.casefold() == "apps")
    if spelled != "apps":
        assert f"('{spelled}' is its name in another case, which some file systems" in (
            denied.message
        )
    else:
        assert "another case" not in denied.message
    assert "reached only by calling its tool (app_<id>" in denied.message
    assert "/host" not in denied.message  # visible paths only


@pytest.mark.parametrize("path", BESIDE_THE_FOLDER)
def test_paths_beside_the_folder_are_judged_as_before(path: str) -> None:
    resolved = resolve_path(path, "read", GRANTS)
    assert not isinstance(resolved, Deny), resolved


@pytest.mark.parametrize(
    "path",
    [
        "/data/host/ws/apps",
        "/data/host/ws/apps/x/data/f",
        "/data/host/ws/APPS/x",
        "/data/host/ws/../ws/apps/x",
        "/data/host/ws/docs/../apps",
    ],
)
def test_a_grant_holding_the_workspace_refuses_the_folder_where_it_shows_it(path: str) -> None:
    denied = resolve_path(path, "read", GRANTS)
    assert isinstance(denied, Deny) and denied.code is ErrorCode.POLICY_DENIED, denied
    assert "it lies in the apps folder '/data/host/ws/apps'" in denied.message
    ok = resolve_path("/data/host/ws/docs/apps/x", "read", GRANTS)
    assert not isinstance(ok, Deny), ok


def test_the_refusal_comes_first_whatever_else_the_grant_says() -> None:
    # A write into a read-only grant, a suffix rule: the folder is the reason given.
    denied = resolve_path("/data/host/ws/apps/x", "write", GRANTS)
    assert isinstance(denied, Deny) and "apps folder" in denied.message, denied


def test_the_policy_step_of_a_call_refuses_the_folder_for_every_fs_tool() -> None:
    rights = RunRights(
        grants=GRANTS,
        models=(),
        model_budget=None,
        network=NetworkSection(),
        env=(),
        without_sandbox=None,
    )
    calls: list[tuple[str, dict[str, Any]]] = [
        ("fs.read", {"path": "apps/x/APP.md"}),
        ("fs.write", {"path": "apps/evil/APP.md", "content": "planted"}),
        ("fs.write", {"path": "APPS/evil/APP.md", "content": "planted", "append": True}),
        ("fs.edit", {"path": "apps/x/APP.md", "old": "a", "new": "b"}),
        ("fs.list", {"path": "apps"}),
        ("fs.list", {"path": "/workspace/apps/x", "pattern": "**"}),
        ("fs.stat", {"path": "/workspace/apps"}),
    ]
    for tool, args in calls:
        spec = TOOLS[tool]
        decision = check_call(
            tool, spec.manifest.capabilities, spec.requests(spec.decode(args)), rights
        )
        assert isinstance(decision, Deny), (tool, args)
        assert decision.code is ErrorCode.POLICY_DENIED
        assert "apps folder" in decision.message


# --- binding a policy's paths ------------------------------------------------------------


def test_binding_records_where_each_grant_holds_the_folder(tmp_path: Path) -> None:
    ws = tmp_path / "ws"
    (ws / "docs").mkdir(parents=True)
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    grants = bind_paths(
        policy_with_paths(
            "workspace: {root: ., mode: rw}\n"
            "docs: {root: docs, mode: ro}\n"
            f"again: {{root: {ws}, mode: ro, mount: /data/again}}\n"
            f"holder: {{root: {tmp_path}, mode: ro, mount: /data/holder}}\n"
            f"side: {{root: {elsewhere}, mode: rw, mount: /data/side}}\n"
        ),
        ws,
    )
    assert [g.apps_parts for g in grants] == [
        ("apps",),
        None,
        ("apps",),
        ("ws", "apps"),
        None,
    ]


@pytest.mark.parametrize("root", ["apps", "apps/x/data", "APPS/x", "Apps"])
def test_binding_refuses_a_root_in_the_folder(tmp_path: Path, root: str) -> None:
    ws = tmp_path / "ws"
    (ws / root).mkdir(parents=True)
    with pytest.raises(PolicyError) as caught:
        bind_paths(policy_with_paths(f"inside: {{root: {root}, mode: ro}}\n"), ws)
    message = str(caught.value)
    assert f"filesystem.paths.inside.root: {ws / root} lies in the workspace's apps" in message
    assert "which no run reads or writes" in message


def test_binding_refuses_an_absolute_root_in_the_folder(tmp_path: Path) -> None:
    ws = tmp_path / "ws"
    (ws / "apps" / "x").mkdir(parents=True)
    via = tmp_path / "via"
    via.symlink_to(ws / "apps" / "x")  # the root is judged where it leads
    with pytest.raises(PolicyError, match=r"lies in the workspace's apps folder"):
        bind_paths(policy_with_paths(f"x: {{root: {via}, mode: ro, mount: /data/x}}\n"), ws)


def test_binding_records_the_folder_beneath_a_root_holding_the_whole_workspace(
    tmp_path: Path,
) -> None:
    # Writable or not: the plan refuses a writable one for a sandboxed run (the sandbox
    # could rename the workspace's directory inside it: test_sandbox_plan_covers.py);
    # a run without a sandbox runs no command that could.
    ws = tmp_path / "ws"
    ws.mkdir()
    for mode in ("ro", "rw"):
        (grant,) = bind_paths(
            policy_with_paths(f"up: {{root: {tmp_path}, mode: {mode}, mount: /data/up}}\n"), ws
        )
        assert grant.apps_parts == ("ws", "apps")


# --- the fs tools on real directories ----------------------------------------------------


@pytest.fixture
def ws(tmp_path: Path) -> Path:
    ws = tmp_path / "ws"
    (ws / "docs" / "apps").mkdir(parents=True)
    (ws / "notes.md").write_text("workspace notes\n")
    (ws / "docs" / "guide.md").write_text("# guide\n")
    (ws / "docs" / "apps" / "list.md").write_text("not the apps folder\n")
    app = ws / "apps" / "note-taker"
    (app / "data").mkdir(parents=True)
    (app / "APP.md").write_text(f"{MANIFEST}\n")
    (app / "data" / "notes.md").write_text(f"{APP_DATA}\n")
    # Symlinks planted in the workspace, each leading into the folder another way.
    (ws / "link-file").symlink_to("apps/note-taker/data/notes.md")
    (ws / "link-dir").symlink_to("apps")
    (ws / "link-app").symlink_to("apps/note-taker")
    (ws / "docs" / "up").symlink_to("../apps/note-taker")
    (ws / "link-abs").symlink_to("/workspace/apps/note-taker/APP.md")
    (ws / "link-self").symlink_to(".")
    return ws


def grant_for(ws: Path) -> PathGrant:
    (grant,) = bind_paths(policy_with_paths("workspace: {root: ., mode: rw}\n"), ws)
    return grant


async def call(tool: str, args: dict[str, Any], grants: tuple[PathGrant, ...]) -> dict[str, Any]:
    """As dispatch does: decode, the policy step, then the runner."""
    spec = TOOLS[tool]
    typed = spec.decode(args)
    rights = RunRights(
        grants=grants,
        models=(),
        model_budget=None,
        network=NetworkSection(),
        env=(),
        without_sandbox=None,
    )
    decision = check_call(tool, spec.manifest.capabilities, spec.requests(typed), rights)
    if isinstance(decision, Deny):
        raise decision.as_error()
    ctx = ToolContext(
        run_id="run-1", grants=grants, max_output_bytes=1 << 20, resolved=decision.resolved
    )
    with trio.fail_after(10):
        result: dict[str, Any] = await spec.runner.run(typed, ctx)
    msgspec.json.encode(result)
    return result


async def refused(tool: str, args: dict[str, Any], grants: tuple[PathGrant, ...]) -> str:
    with pytest.raises(GatewayError) as caught:
        await call(tool, args, grants)
    error = caught.value
    assert error.code is ErrorCode.POLICY_DENIED, (tool, args, error)
    message = str(error)
    for secret in (MANIFEST, APP_DATA, "note-taker/APP.md is", "/tmp/"):
        assert secret not in message, message
    return message


SYMLINK_PATHS = [
    ("fs.read", {"path": "link-file"}),
    ("fs.read", {"path": "link-dir/note-taker/APP.md"}),
    ("fs.read", {"path": "link-app/data/notes.md"}),
    ("fs.read", {"path": "docs/up/APP.md"}),
    ("fs.read", {"path": "link-self/apps/note-taker/APP.md"}),
    ("fs.read", {"path": "link-self/link-file"}),
    ("fs.read", {"path": "link-abs"}),
    ("fs.list", {"path": "link-dir"}),
    ("fs.list", {"path": "link-app", "pattern": "**"}),
    ("fs.list", {"path": "link-self"}),
    ("fs.stat", {"path": "link-dir/note-taker"}),
    ("fs.stat", {"path": "docs/up/data"}),
    ("fs.write", {"path": "link-dir/evil/APP.md", "content": "planted"}),
    ("fs.write", {"path": "link-app/data/notes.md", "content": "x", "append": True}),
    ("fs.edit", {"path": "link-file", "old": "APP", "new": "X"}),
]


@pytest.mark.parametrize(("tool", "args"), SYMLINK_PATHS, ids=str)
async def test_no_symlink_in_the_workspace_leads_a_tool_into_the_folder(
    resolver: Resolver, ws: Path, tool: str, args: dict[str, Any]
) -> None:
    message = await refused(tool, args, (grant_for(ws),))
    assert "symlink" in message, message
    assert (ws / "apps" / "note-taker" / "data" / "notes.md").read_text() == f"{APP_DATA}\n"
    assert not (ws / "apps" / "evil").exists()


async def test_the_symlink_refusal_says_why_and_what_to_do(resolver: Resolver, ws: Path) -> None:
    message = await refused("fs.read", {"path": "link-dir/note-taker/APP.md"}, (grant_for(ws),))
    assert message == (
        "'/workspace/link-dir/note-taker/APP.md' goes through the symlink '/workspace/link-dir'; "
        "'/workspace' holds the apps folder, which no run may read and a symlink could lead "
        "into, so no symlink is followed there: use the real path"
    )


async def test_without_an_apps_folder_symlinks_are_followed_as_before(
    resolver: Resolver, tmp_path: Path
) -> None:
    ws = tmp_path / "plain"
    ws.mkdir()
    (ws / "notes.md").write_text("hello\n")
    (ws / "alias.md").symlink_to("notes.md")
    if resolver is Resolver.OPENAT2:  # the walk follows none, anywhere
        result = await call("fs.read", {"path": "alias.md"}, (grant_for(ws),))
        assert result["content"] == "hello\n"
    # Writing into the folder is refused even where it does not exist: nothing is made.
    await refused("fs.write", {"path": "apps/evil/APP.md", "content": "x"}, (grant_for(ws),))
    await refused("fs.write", {"path": "APPS/evil/APP.md", "content": "x"}, (grant_for(ws),))
    assert sorted(os.listdir(ws)) == ["alias.md", "notes.md"]


@pytest.mark.parametrize("path", IN_THE_FOLDER)
async def test_each_spelling_is_refused_before_the_tool_touches_anything(
    ws: Path, path: str
) -> None:
    grants = (grant_for(ws),)
    for tool, args in (
        ("fs.read", {"path": path}),
        ("fs.stat", {"path": path}),
        ("fs.list", {"path": path, "pattern": "**"}),
        ("fs.write", {"path": path.rstrip("/") + "/x.md", "content": "planted"}),
    ):
        message = await refused(tool, args, grants)
        assert "it lies in the apps folder '/workspace/apps'" in message, message
    assert sorted(p.name for p in (ws / "apps").rglob("*")) == [
        "APP.md",
        "data",
        "note-taker",
        "notes.md",
    ]


async def test_listing_the_workspace_never_shows_the_folder_nor_anything_in_it(
    resolver: Resolver, ws: Path
) -> None:
    grants = (grant_for(ws),)
    top = await call("fs.list", {}, grants)
    names = [e["path"] for e in top["entries"]]
    assert "/workspace/apps" not in names
    assert "/workspace/docs" in names and "/workspace/link-dir" in names
    everything = await call("fs.list", {"pattern": "**"}, grants)
    paths = [e["path"] for e in everything["entries"]]
    assert not [p for p in paths if p.startswith("/workspace/apps")], paths
    assert "/workspace/docs/apps/list.md" in paths  # another apps directory is listed
    assert "note-taker" not in str(everything)
    assert everything["truncated"] is False


async def test_a_folder_spelled_otherwise_is_neither_listed_nor_read(
    resolver: Resolver, tmp_path: Path
) -> None:
    # On this (case-sensitive) file system APPS is another directory; refused all the same,
    # since where case folds it is the apps folder.
    ws = tmp_path / "ws"
    (ws / "APPS").mkdir(parents=True)
    (ws / "APPS" / "x.md").write_text("folded\n")
    grants = (grant_for(ws),)
    message = await refused("fs.read", {"path": "APPS/x.md"}, grants)
    assert "('APPS' is its name in another case" in message
    listed = await call("fs.list", {"pattern": "**"}, grants)
    assert listed["entries"] == []


async def test_a_hard_link_to_an_apps_file_tells_nothing_of_it(
    resolver: Resolver, ws: Path
) -> None:
    os.link(ws / "apps" / "note-taker" / "data" / "notes.md", ws / "hard.md")
    grants = (grant_for(ws),)
    message = await refused("fs.read", {"path": "hard.md"}, grants)
    assert "one of several hard links to the same file" in message
    await refused("fs.edit", {"path": "hard.md", "old": "APP", "new": "X"}, grants)
    await refused("fs.write", {"path": "hard.md", "content": "x", "append": True}, grants)
    described = await call("fs.stat", {"path": "hard.md"}, grants)
    assert (described["size"], described["mtime"], described["mode"]) == (None, None, None)
    listed = await call("fs.list", {"pattern": "hard.md"}, grants)
    assert listed["entries"] == [
        {"path": "/workspace/hard.md", "type": "file", "size": None, "hardLinked": True}
    ]
    assert (ws / "hard.md").read_text() == f"{APP_DATA}\n"  # untouched


def _bind_mount(source: Path, target: Path) -> None:
    subprocess.run(["mount", "--bind", str(source), str(target)], check=True)


def _unmount(target: Path) -> None:
    libc = ctypes.CDLL(None, use_errno=True)
    libc.umount2(os.fsencode(target), 2)  # MNT_DETACH


@pytest.mark.skipif(os.geteuid() != 0, reason="a bind mount needs root")
async def test_another_mount_of_the_folder_is_refused_by_its_identity(
    resolver: Resolver, ws: Path
) -> None:
    # Another name of the folder itself (what a case-folding file system's APPS is, or a
    # host's bind mount): the path passes the policy, the folder's (device, inode) does not.
    alias = ws / "shelf"
    alias.mkdir()
    _bind_mount(ws / "apps", alias)
    try:
        grants = (grant_for(ws),)
        for tool, args in (
            ("fs.read", {"path": "shelf/note-taker/APP.md"}),
            ("fs.list", {"path": "shelf"}),
            ("fs.stat", {"path": "shelf/note-taker"}),
            ("fs.write", {"path": "shelf/evil/APP.md", "content": "planted"}),
        ):
            message = await refused(tool, args, grants)
            assert "it lies in the apps folder '/workspace/apps'" in message, (tool, message)
        listed = await call("fs.list", {"pattern": "**"}, grants)
        assert not [e for e in listed["entries"] if e["path"].startswith("/workspace/shelf")]
    finally:
        _unmount(alias)
    assert not (ws / "apps" / "evil").exists()


# --- the run's start and end (the sandbox's side; from inside: the integration tests) ---


def _open_dir(path: Path) -> int:
    return os.open(path, os.O_PATH | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)


def test_a_missing_folder_is_made_recorded_and_removed_while_still_empty(
    tmp_path: Path,
) -> None:
    ws, run_dir = tmp_path / "ws", tmp_path / "run"
    ws.mkdir()
    run_dir.mkdir()
    fd = _open_dir(ws)
    try:
        folder = prepare_apps_folder(fd, ws, run_dir)
        assert folder.made is not None and folder.identity == folder.made.identity
        st = os.lstat(ws / "apps")
        assert (st.st_dev, st.st_ino) == folder.identity
        assert stat.S_IMODE(st.st_mode) == MADE_FOLDER_MODE & ~_umask()
        assert MadeFolder.from_json((run_dir / MADE_RECORD).read_text()) == folder.made
        assert remove_made_folder(fd, folder.made)
        assert not (ws / "apps").exists()
        assert not remove_made_folder(fd, folder.made)  # gone already: nothing to do
        # One an app was installed into meanwhile stays, and so does a symlink put there.
        again = prepare_apps_folder(fd, ws, run_dir)
        assert again.made is not None
        (ws / "apps" / "x").mkdir()
        assert not remove_made_folder(fd, again.made)
        assert (ws / "apps" / "x").is_dir()
        shutil.rmtree(ws / "apps")
        (ws / "apps").symlink_to("elsewhere")
        assert not remove_made_folder(fd, again.made)
        assert (ws / "apps").is_symlink()
    finally:
        os.close(fd)


@pytest.mark.parametrize("durable", [True, False])
def test_the_made_folders_record_is_flushed_unless_the_view_is_a_mount_for_the_run(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, durable: bool
) -> None:
    # In a view mounted for the run alone (an overlay session's), a reboot takes the
    # folder with the view: the record is written whole, not flushed.
    ws, run_dir = tmp_path / "ws", tmp_path / "run"
    ws.mkdir()
    run_dir.mkdir()
    flushed: list[str] = []
    real_fsync = os.fsync

    def fsync(fd: int) -> None:
        flushed.append(os.readlink(f"/proc/self/fd/{fd}"))
        real_fsync(fd)

    monkeypatch.setattr(os, "fsync", fsync)
    fd = _open_dir(ws)
    try:
        folder = prepare_apps_folder(fd, ws, run_dir, durable_record=durable)
    finally:
        os.close(fd)
    monkeypatch.undo()
    assert MadeFolder.from_json((run_dir / MADE_RECORD).read_text()) == folder.made
    assert os.listdir(run_dir) == [MADE_RECORD]  # no temporary file left beside it
    if durable:  # the record (its temporary file), then the run's directory
        assert len(flushed) == 2 and flushed[1] == str(run_dir), flushed
    else:
        assert flushed == []


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def test_an_existing_folder_is_walked_and_a_name_outside_refuses_the_run(ws: Path) -> None:
    fd = _open_dir(ws)
    try:
        folder = prepare_apps_folder(fd, ws, ws.parent)
        assert folder.made is None
        data = ws / "apps" / "note-taker" / "data"
        os.link(data / "notes.md", data / "again.md")  # both names inside: fine
        assert prepare_apps_folder(fd, ws, ws.parent).made is None
        os.link(data / "notes.md", ws / "docs" / "n.md")
        with pytest.raises(AppsFolderRefused) as caught:
            prepare_apps_folder(fd, ws, ws.parent)
        assert caught.value.code is ErrorCode.BAD_REQUEST
        assert str(caught.value).startswith(
            f"the workspace's apps folder holds {data / 'again.md'}, a file with 3 names of "
            "which 2 lie in the folder"
        ), caught.value
    finally:
        os.close(fd)


@pytest.mark.parametrize("kind", ["symlink", "file"])
def test_an_apps_entry_that_is_no_directory_is_refused(tmp_path: Path, kind: str) -> None:
    ws = tmp_path / "ws"
    (ws / "docs").mkdir(parents=True)
    if kind == "symlink":
        (ws / "apps").symlink_to("docs")
    else:
        (ws / "apps").write_text("x")
    fd = _open_dir(ws)
    try:
        with pytest.raises(AppsFolderRefused, match=r"must be a directory \(or absent\)"):
            prepare_apps_folder(fd, ws, tmp_path)
    finally:
        os.close(fd)
    assert sorted(os.listdir(ws / "docs")) == []


def test_a_folder_nested_deeper_than_the_walk_goes_is_refused(tmp_path: Path) -> None:
    ws = tmp_path / "ws"
    deep = ws / "apps"
    deep.mkdir(parents=True)
    fd = _open_dir(deep)
    try:
        for _ in range(APPS_WALK_MAX_DEPTH):  # relative, one level at a time
            os.mkdir("d", dir_fd=fd)
            child = os.open("d", os.O_PATH | os.O_DIRECTORY, dir_fd=fd)
            os.close(fd)
            fd = child
    finally:
        os.close(fd)
    ws_fd = _open_dir(ws)
    try:
        with pytest.raises(AppsFolderRefused) as caught:
            prepare_apps_folder(ws_fd, ws, tmp_path)
    finally:
        os.close(ws_fd)
    assert f"is nested deeper than {APPS_WALK_MAX_DEPTH} directories" in str(caught.value)
    assert "flatten it, then start the run again" in str(caught.value)


@pytest.mark.parametrize("kept", [0, 40])
def test_a_record_a_power_cut_left_empty_or_cut_is_not_refused(tmp_path: Path, kept: int) -> None:
    # Not flushed (in an overlay session's view), the record's name may outlive a power
    # cut while its bytes do not (ext4 allocates a new file's blocks at writeback): the
    # next start passes over it and the run's directory goes, as for any unreadable one.
    from gatewayd.sandbox.session import clean_leftovers

    ws, runs = tmp_path / "ws", tmp_path / "runs"
    ws.mkdir()
    (runs / "a").mkdir(parents=True)
    fd = _open_dir(ws)
    try:
        made = prepare_apps_folder(fd, ws, runs / "a", durable_record=False).made
    finally:
        os.close(fd)
    assert made is not None
    record = runs / "a" / MADE_RECORD
    record.write_bytes(record.read_bytes()[:kept])
    assert remove_leftover_folder(runs / "a") is False
    assert clean_leftovers(runs, None) == {"leasesReturned": [], "runDirs": ["a"], "netns": []}
    assert (ws / "apps").is_dir()  # empty: harmless
