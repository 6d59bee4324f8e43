"""Binding a policy's path rules to host directories: roots resolved once, checked and
pinned, and every refusal naming the rule and the path."""

from __future__ import annotations

import textwrap
from pathlib import Path, PurePosixPath

import pytest

from gatewayd.hostpaths.binding import bind_paths
from gatewayd.policy import PathMode, Policy, PolicyError
from tests.unit.test_policy_model import load

# --- bind_paths: the only filesystem access -----------------------------------------------


def policy_with_paths(paths: str) -> Policy:
    return load(
        f"version: 1\nname: bindme\nfilesystem:\n  paths:\n{textwrap.indent(paths, '    ')}"
    )


def test_bind_maps_relative_roots_into_the_workspace_and_absolute_roots_as_is(
    tmp_path: Path,
) -> None:
    ws = tmp_path / "ws"
    (ws / "ref" / "deep").mkdir(parents=True)
    host_docs = tmp_path / "host-docs"
    host_docs.mkdir()
    policy = policy_with_paths(
        "workspace: {root: ., mode: rw, suffixes: [.md], max_file_bytes: 10}\n"
        "ref: {root: ref/deep, mode: ro}\n"
        f"docs: {{root: {host_docs}, mode: ro, mount: /data/docs}}\n"
    )
    workspace, ref, docs = bind_paths(policy, ws)
    assert workspace.name == "workspace"
    assert workspace.host_root == ws.resolve()
    assert workspace.visible_root == PurePosixPath("/workspace")
    assert workspace.mode is PathMode.RW
    assert (workspace.suffixes, workspace.max_file_bytes) == ((".md",), 10)
    assert ref.host_root == (ws / "ref" / "deep").resolve()
    assert ref.visible_root == PurePosixPath("/workspace/ref/deep")
    assert ref.mode is PathMode.RO
    assert (ref.suffixes, ref.max_file_bytes) == ((), None)
    assert docs.host_root == host_docs.resolve()
    assert docs.visible_root == PurePosixPath("/data/docs")


def test_bind_resolves_symlinked_roots_once(tmp_path: Path) -> None:
    real = tmp_path / "real"
    real.mkdir()
    link = tmp_path / "link"
    link.symlink_to(real)
    (grant,) = bind_paths(
        policy_with_paths(f"d: {{root: {link}, mode: ro, mount: /data/d}}\n"), tmp_path
    )
    assert grant.host_root == real
    assert not grant.host_root.is_symlink()


def test_bind_refuses_a_relative_root_that_symlinks_out_of_the_workspace(tmp_path: Path) -> None:
    ws = tmp_path / "ws"
    ws.mkdir()
    outside = tmp_path / "outside"
    outside.mkdir()
    (ws / "escape").symlink_to(outside)
    with pytest.raises(PolicyError) as info:
        bind_paths(policy_with_paths("e: {root: escape, mode: ro}\n"), ws)
    assert str(info.value) == (
        f"policy 'bindme': filesystem.paths.e.root: {ws / 'escape'} resolves to {outside}, "
        f"outside the workspace {ws}; a relative root must stay inside the workspace"
    )


def test_bind_allows_a_relative_symlink_that_stays_inside(tmp_path: Path) -> None:
    ws = tmp_path / "ws"
    (ws / "real").mkdir(parents=True)
    (ws / "alias").symlink_to("real")
    (grant,) = bind_paths(policy_with_paths("a: {root: alias, mode: ro}\n"), ws)
    assert grant.host_root == ws / "real"
    assert grant.visible_root == PurePosixPath("/workspace/alias")


def test_bind_refuses_a_missing_root_naming_the_path(tmp_path: Path) -> None:
    with pytest.raises(PolicyError) as info:
        bind_paths(policy_with_paths("m: {root: missing, mode: ro}\n"), tmp_path)
    assert str(info.value) == (
        f"policy 'bindme': filesystem.paths.m.root: {tmp_path / 'missing'}: "
        "No such file or directory"
    )


def test_bind_refuses_a_root_that_is_a_file(tmp_path: Path) -> None:
    (tmp_path / "f.txt").write_text("x")
    with pytest.raises(PolicyError) as info:
        bind_paths(
            policy_with_paths(f"f: {{root: {tmp_path / 'f.txt'}, mode: ro, mount: /d}}\n"), tmp_path
        )
    assert str(info.value) == (
        f"policy 'bindme': filesystem.paths.f.root: {tmp_path / 'f.txt'} is not a directory"
    )


def test_bind_refuses_a_missing_workspace(tmp_path: Path) -> None:
    with pytest.raises(PolicyError, match=r"workspace .*/nope: No such file or directory"):
        bind_paths(policy_with_paths("w: {root: ., mode: rw}\n"), tmp_path / "nope")


def test_bind_of_a_policy_without_paths_grants_nothing_and_touches_nothing(tmp_path: Path) -> None:
    assert bind_paths(load("version: 1\nname: p\n"), tmp_path / "does-not-exist") == ()


def test_bind_pins_root_identity_and_marks_grants_holding_another_on_the_host(
    tmp_path: Path,
) -> None:
    ws = tmp_path / "ws"
    (ws / "ref").mkdir(parents=True)
    (ws / "inner").mkdir()
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    policy = policy_with_paths(
        "workspace: {root: ., mode: rw}\n"
        "ref: {root: ref, mode: ro}\n"
        # Seen at /data/inner, but on the host inside the workspace: a symlink in the
        # workspace could reach it, so the workspace holds it all the same.
        f"inner: {{root: {ws / 'inner'}, mode: ro, mount: /data/inner}}\n"
        f"side: {{root: {elsewhere}, mode: ro, mount: /data/side}}\n"
    )
    grants = bind_paths(policy, ws)
    assert [g.holds_nested for g in grants] == [True, False, False, False]
    for grant, path in zip(grants, (ws, ws / "ref", ws / "inner", elsewhere), strict=True):
        st = path.stat()
        assert grant.root_id == (st.st_dev, st.st_ino)
