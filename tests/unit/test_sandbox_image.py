"""check_image over hand-made image trees: each problem is found, named, and its fix works.

Where a message carries a shell command as its fix, the test runs that command and checks
the image again: a fix that does not fix is a defect of the message.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from gatewayd.errors import GatewayError
from gatewayd.sandbox import image as image_module
from gatewayd.sandbox.image import (
    MAX_PROBLEMS_SHOWN,
    MAX_SYMLINKS,
    MOUNT_POINTS,
    EntryKind,
    ImageError,
    ImageReport,
    check_image,
    require_image,
)
from gatewayd.sandbox.plan import (
    SANDBOX_SOCKET,
    WORKSPACE,
    HostLayout,
    RemountRo,
    build_plan,
)

# Images must be owned by root; only root can make trees owned by root (and by others).
pytestmark = pytest.mark.skipif(
    os.geteuid() != 0, reason="building root-owned image trees (and chown to others) needs root"
)

OTHER_UID = 4_000_123  # a uid nobody on this host has


@pytest.fixture
def base() -> Iterator[Path]:
    # Not pytest's tmp_path: its parents are 0700, and parents must be traversable.
    path = Path(tempfile.mkdtemp(prefix="cg-image-", dir="/tmp"))
    path.chmod(0o755)
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


@pytest.fixture
def img(base: Path) -> Path:
    return make_image(base)


def make_image(base: Path) -> Path:
    """A minimal complete image at ``base/img``: the mount points, python3, merged /usr."""
    root = base / "img"
    for directory in (
        "proc",
        "dev",
        "tmp",
        "workspace",
        "opt/cogni-tool",
        "run/cogni",
        "etc",
        "usr/bin",
        "usr/lib/python3.11/encodings",
        "usr/local/bin",
    ):
        (root / directory).mkdir(parents=True, exist_ok=True)
    for name in ("etc/passwd", "etc/group", "etc/hosts", "run/cogni/gateway.sock", "etc/motd"):
        (root / name).write_text("")
    (root / "usr/bin/python3.11").write_text("#!/bin/sh\n")
    (root / "usr/bin/python3").symlink_to("python3.11")
    (root / "bin").symlink_to("usr/bin")
    for directory, _dirs, files in os.walk(root):
        os.chmod(directory, 0o755)
        for name in files:
            os.chmod(os.path.join(directory, name), 0o644)
    (root / "usr/bin/python3.11").chmod(0o755)
    return root


def problems_about(report: ImageReport, text: str) -> list[str]:
    return [problem for problem in report.problems if text in problem]


def only_problem(report: ImageReport) -> str:
    assert len(report.problems) == 1, report.render()
    return report.problems[0]


def run_fix(problem: str, marker: str) -> None:
    """Run the shell command the message gives after ``marker``."""
    command = problem.split(marker, 1)[1]
    subprocess.run(["/bin/sh", "-c", command], check=True)


# --- the good case ------------------------------------------------------------------------


def test_a_complete_image_has_no_problems_and_says_where_python3_leads(img: Path) -> None:
    report = check_image(img)
    assert report.ok, report.render()
    assert report.python3 == "/usr/bin/python3.11"
    # The 9 top-level entries, then the entries of /etc (4), /opt (1), /run (1), /usr (3),
    # and of the PATH directories /usr/local/bin (0) and /usr/bin (2; /bin is the same).
    assert report.entries_checked == 20
    assert report.render().startswith(f"OK: {img} can be a sandbox root (python3 is /usr/bin/")
    assert require_image(img) == report


# --- the image path ----------------------------------------------------------------------


def test_a_relative_path_is_refused_with_its_absolute_form() -> None:
    report = check_image(Path("images/debian"))
    assert only_problem(report) == (
        f"'images/debian' is a relative path; give the image as an absolute path "
        f"(from here that is {Path.cwd() / 'images/debian'})"
    )
    assert not report.ok


def test_a_missing_directory_is_named(base: Path) -> None:
    problem = only_problem(check_image(base / "nothing"))
    assert (
        problem
        == f"{base}/nothing cannot be used: No such file or directory; give an existing directory"
    )


def test_a_file_is_not_an_image(img: Path) -> None:
    problem = only_problem(check_image(img / "etc/motd"))
    assert (
        problem == f"{img}/etc/motd is not a directory; an image is a directory holding a root tree"
    )


def test_an_image_reached_through_a_symlink_must_be_given_by_its_real_path(
    base: Path, img: Path
) -> None:
    (base / "link").symlink_to(img)
    problem = only_problem(check_image(base / "link"))
    assert f"it is really {img}); give {img}:" in problem


def test_the_host_root_is_refused_for_the_trees_it_would_expose() -> None:
    report = check_image(Path("/"))
    [problem] = problems_about(report, "holds host trees a sandbox never sees")
    assert "/root" in problem and "/home" in problem and "/etc/ssh" in problem
    assert "keep images in a directory of their own, e.g. /srv/cogni/images/NAME" in problem


def test_an_image_inside_a_denied_host_tree_is_refused(img: Path) -> None:
    # /run holds the host's sockets; an image there is refused by the plan as well.
    inside = Path(tempfile.mkdtemp(prefix="cg-image-", dir="/run"))
    try:
        inside.chmod(0o755)
        shutil.copytree(img, inside / "img", symlinks=True)
        [problem] = problems_about(check_image(inside / "img"), "lies in")
        assert problem.startswith(f"{inside}/img lies in /run, which a sandbox never sees;")
    finally:
        shutil.rmtree(inside)


# --- mount points -------------------------------------------------------------------------


@pytest.mark.parametrize("mount_point", MOUNT_POINTS, ids=lambda mp: mp.path)
def test_a_missing_mount_point_is_named_with_a_command_that_creates_it(
    img: Path, mount_point: image_module.MountPoint
) -> None:
    target = img / mount_point.path.lstrip("/")
    if target.is_dir():
        shutil.rmtree(target)
    else:
        target.unlink()
    report = check_image(img)
    assert not report.ok
    [problem] = problems_about(report, f"{mount_point.path} is missing")
    assert "bwrap cannot create it in a read-only image" in problem
    for found in report.problems:  # a removed directory takes its mount points with it
        assert " is missing" in found, found
        run_fix(found, "create it: ")
    assert check_image(img).ok, check_image(img).render()


@pytest.mark.parametrize(
    ("visible", "make_wrong", "expected"),
    [
        ("/workspace", "file", "/workspace is not a directory; gatewayd mounts at /workspace"),
        ("/etc/hosts", "dir", "/etc/hosts is not a file; gatewayd mounts at /etc/hosts"),
        (
            "/run/cogni/gateway.sock",
            "dir",
            "/run/cogni/gateway.sock is not a file; gatewayd mounts at /run/cogni/gateway.sock",
        ),
        ("/run/cogni", "file", "/run/cogni is not a directory; gatewayd mounts at /run/cogni"),
    ],
)
def test_a_mount_point_of_the_wrong_type_is_named_with_a_command_that_replaces_it(
    img: Path, visible: str, make_wrong: str, expected: str
) -> None:
    target = img / visible.lstrip("/")
    shutil.rmtree(target) if target.is_dir() else target.unlink()
    if make_wrong == "dir":
        target.mkdir(mode=0o755)
    else:
        target.write_text("")
    report = check_image(img)
    problem = only_problem(report)
    assert problem.startswith(expected), problem
    assert "bwrap binds directories onto directories and files onto files" in problem
    run_fix(problem, "replace it: ")
    # Replacing /run/cogni removed the socket file in it: the next check names that.
    for remaining in check_image(img).problems:
        run_fix(remaining, "create it: ")
    assert check_image(img).ok, check_image(img).render()


def test_a_symlinked_parent_of_mount_points_is_reported_once(img: Path) -> None:
    (img / "var").mkdir(mode=0o755)
    (img / "run").rename(img / "var/run")
    (img / "run").symlink_to("/var/run")
    problem = only_problem(check_image(img))
    assert problem.startswith(
        "/run is a symlink (to '/var/run'); gatewayd mounts at /run/cogni, so /run must be a "
        "real directory: replace it:"
    )


def test_a_symlink_where_a_mount_point_file_belongs_is_refused(img: Path) -> None:
    (img / "etc/hosts").unlink()
    (img / "etc/hosts").symlink_to("/etc/hosts")  # on the host: it must not count
    problem = only_problem(check_image(img))
    assert problem.startswith("/etc/hosts is a symlink (to '/etc/hosts');")
    run_fix(problem, "replace it: ")
    assert check_image(img).ok


# --- python3 ------------------------------------------------------------------------------

INSTALL_HINT = "install it (debootstrap --include=python3, or apt-get install python3"


def test_no_python3_is_a_problem_that_says_how_to_install_it(img: Path) -> None:
    (img / "usr/bin/python3").unlink()
    report = check_image(img)
    problem = only_problem(report)
    assert problem.startswith(
        "/usr/bin/python3 does not lead to a file in the image: /usr/bin/python3 does not exist"
    )
    assert INSTALL_HINT in problem
    assert report.python3 is None


def test_an_absolute_python3_link_to_a_host_only_file_is_a_problem(img: Path) -> None:
    host_only = os.path.realpath("/bin/sh")  # /usr/bin/dash on Debian: on the host ...
    assert os.path.isfile(host_only)
    assert not os.path.lexists(img / host_only.lstrip("/"))  # ... and not in the image
    (img / "usr/bin/python3").unlink()
    (img / "usr/bin/python3").symlink_to(host_only)
    problem = only_problem(check_image(img))
    assert f"{host_only} does not exist in the image" in problem
    assert f"/usr/bin/python3 -> {host_only}" in problem
    assert "never on the host" in problem


def test_a_dotdot_link_cannot_climb_out_of_the_image_to_the_host(img: Path) -> None:
    (img / "usr/bin/python3").unlink()
    # From the host these many '..' reach the host's /, where /bin/sh exists.
    (img / "usr/bin/python3").symlink_to("../../../../../../../../bin/sh")
    problem = only_problem(check_image(img))
    assert "/usr/bin/sh does not exist in the image" in problem  # /bin is usr/bin in here


def test_an_absolute_python3_link_resolves_inside_the_image(img: Path) -> None:
    (img / "usr/bin/python3").unlink()
    (img / "usr/bin/python3").symlink_to("/bin/python3.11")  # /bin -> usr/bin, in the image
    report = check_image(img)
    assert report.ok, report.render()
    assert report.python3 == "/usr/bin/python3.11"


def test_a_python3_symlink_loop_ends_after_the_kernels_limit(img: Path) -> None:
    (img / "usr/bin/python3").unlink()
    (img / "usr/bin/python3").symlink_to("python3")
    problem = only_problem(check_image(img))
    assert f"more than {MAX_SYMLINKS} symlinks (a loop?)" in problem


def test_python3_that_is_a_directory_is_a_problem(img: Path) -> None:
    (img / "usr/bin/python3.11").unlink()
    (img / "usr/bin/python3.11").mkdir(mode=0o755)
    problem = only_problem(check_image(img))
    assert problem.startswith("/usr/bin/python3 leads to /usr/bin/python3.11, not a regular file")
    assert INSTALL_HINT in problem


def test_a_path_through_a_file_to_python3_is_a_problem(img: Path) -> None:
    (img / "usr/bin/python3").unlink()
    (img / "usr/bin/python3").symlink_to("../../etc/motd/python3")
    problem = only_problem(check_image(img))
    assert "/etc/motd is not a directory" in problem


def test_python3_others_cannot_execute_is_a_problem_with_the_chmod(img: Path) -> None:
    (img / "usr/bin/python3.11").chmod(0o700)
    problem = only_problem(check_image(img))
    assert problem == (
        "/usr/bin/python3 leads to /usr/bin/python3.11, which others cannot read and execute; "
        f"the sandbox's uid is an other: chmod 0755 {img}/usr/bin/python3.11"
    )
    run_fix(problem, "is an other: ")
    assert check_image(img).ok


# --- traversal -------------------------------------------------------------------------


def test_a_parent_others_cannot_traverse_is_a_problem_with_the_chmod(base: Path) -> None:
    # The shape of pytest's own tmp_path: a 0700 directory above the image.
    (base / "private").mkdir(mode=0o700)
    root = make_image(base / "private")
    problem = only_problem(check_image(root))
    assert problem == (
        f"{base}/private (a parent of the image) is not traversable by others; bwrap runs as "
        f"an unprivileged per-run uid and must reach the image: chmod o+x {base}/private"
    )
    run_fix(problem, "reach the image: ")
    assert check_image(root).ok


def test_the_image_root_others_cannot_traverse_is_a_problem(img: Path) -> None:
    img.chmod(0o750)
    problem = only_problem(check_image(img))
    assert problem == (
        "the image root is not traversable by others; bwrap runs as an unprivileged per-run "
        f"uid: chmod o+x {img}"
    )
    run_fix(problem, "per-run uid: ")
    assert check_image(img).ok


@pytest.mark.parametrize("visible", ["/run", "/etc", "/usr/bin"])
def test_a_directory_on_the_way_to_a_mount_point_or_python3_must_be_traversable(
    img: Path, visible: str
) -> None:
    (img / visible.lstrip("/")).chmod(0o750)
    problem = only_problem(check_image(img))
    assert problem == (
        f"{visible} is not traversable by others; the sandbox's uid is an other and must pass "
        f"through it: chmod o+x {img}{visible}"
    )
    run_fix(problem, "pass through it: ")
    assert check_image(img).ok


def test_covered_mount_points_may_have_any_mode(img: Path) -> None:
    # gatewayd mounts over these, so their own modes never reach the sandbox.
    (img / "tmp").chmod(0o1777)
    (img / "workspace").chmod(0o700)
    (img / "proc").chmod(0o000)
    (img / "etc/hosts").chmod(0o666)
    (img / "dev/null").write_text("")
    (img / "dev/null").chmod(0o666)
    assert check_image(img).ok, check_image(img).render()


# --- nothing changeable by others ------------------------------------------------------


@pytest.mark.parametrize(
    ("relative", "mode"),
    [
        ("usr", 0o775),  # a top-level directory, group-writable
        ("var/tmp", 0o1777),  # sticky shared scratch space still lets others add files
        ("etc/motd", 0o666),  # a file at the second level
        ("usr/local/bin/tool", 0o757),  # a program on the sandbox's PATH
        ("", 0o775),  # the image root itself
    ],
)
def test_anything_near_the_top_writable_by_group_or_others_is_a_problem_with_the_chmod(
    img: Path, relative: str, mode: int
) -> None:
    target = img / relative
    if not target.exists():
        if relative.endswith("tmp"):
            target.mkdir(parents=True)
        else:
            target.write_text("")
    target.chmod(mode)
    problem = only_problem(check_image(img))
    visible = "/" + relative
    assert problem.startswith(f"{visible} is writable by group or others (mode ")
    assert "the image's groups are host groups" in problem
    run_fix(problem, "later run: ")
    assert check_image(img).ok


def test_the_walk_is_bounded_to_the_top_levels(img: Path) -> None:
    deep = img / "usr/lib/python3.11/encodings/utf_8.py"
    deep.write_text("")
    deep.chmod(0o666)
    os.chown(img / "usr/lib/python3.11/encodings", OTHER_UID, OTHER_UID)
    assert check_image(img).ok  # not every file of /usr: only the top levels and PATH


def test_the_walk_stops_after_the_entry_limit(img: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (img / "var").mkdir()
    (img / "var").chmod(0o777)  # /var sorts after the first three top-level entries
    assert not check_image(img).ok
    monkeypatch.setattr(image_module, "MAX_ENTRIES_CHECKED", 3)
    report = check_image(img)
    assert report.entries_checked == 3
    assert report.ok, report.render()


def test_an_entry_owned_by_another_uid_is_a_problem_with_the_chown(img: Path) -> None:
    os.chown(img / "etc", OTHER_UID, OTHER_UID)
    problem = only_problem(check_image(img))
    assert problem == (
        f"/etc is owned by uid {OTHER_UID}; on the host that uid could change it under every "
        f"later run: chown root {img}/etc (or chown -R root:root on the whole image)"
    )
    run_fix(problem.removesuffix(" (or chown -R root:root on the whole image)"), "later run: ")
    assert check_image(img).ok


def test_the_owner_of_a_symlink_does_not_matter(img: Path) -> None:
    os.lchown(img / "bin", OTHER_UID, OTHER_UID)  # it cannot be changed in place
    assert check_image(img).ok


@pytest.mark.parametrize(
    ("mode", "owner", "expected"),
    [
        (
            0o775,
            0,
            "is writable by group or others, who could swap the image for another: chmod go-w",
        ),
        (0o755, OTHER_UID, f"is owned by uid {OTHER_UID}, who could swap the image for another"),
    ],
)
def test_a_parent_others_could_change_is_a_problem(
    base: Path, mode: int, owner: int, expected: str
) -> None:
    parent = base / "shared"
    parent.mkdir()
    root = make_image(parent)
    parent.chmod(mode)
    os.chown(parent, owner, owner)
    problem = only_problem(check_image(root))
    assert problem.startswith(f"{parent} (a parent of the image) {expected}")


def test_a_sticky_world_writable_parent_is_fine(base: Path) -> None:
    # Like /tmp: only an entry's owner (root, for the image) may rename or remove it.
    parent = base / "sticky"
    parent.mkdir()
    root = make_image(parent)
    parent.chmod(0o1777)
    assert check_image(root).ok


# --- reading the report -----------------------------------------------------------------


def test_every_problem_is_found_in_one_check(img: Path) -> None:
    (img / "workspace").rmdir()
    (img / "usr/bin/python3").unlink()
    (img / "etc").chmod(0o777)
    report = check_image(img)
    assert len(report.problems) == 3, report.render()


def test_the_rendered_report_lists_the_first_problems_and_counts_the_rest(img: Path) -> None:
    extra = 15
    for index in range(MAX_PROBLEMS_SHOWN + extra):
        (img / "etc" / f"file{index:03}").write_text("")
        os.chown(img / "etc" / f"file{index:03}", OTHER_UID, OTHER_UID)
    lines = check_image(img).render().splitlines()
    assert lines[0] == (
        f"{img} cannot be a sandbox root; {MAX_PROBLEMS_SHOWN + extra} problem(s) "
        "(paths inside the image as the sandbox sees them):"
    )
    assert len(lines) == 1 + MAX_PROBLEMS_SHOWN + 1
    assert lines[1].startswith("  - /etc/file000 is owned by uid")
    assert lines[-1] == f"  ... and {extra} more; fix the ones above and check again"


def test_require_image_raises_image_error_listing_the_problems(img: Path) -> None:
    (img / "opt/cogni-tool").rmdir()
    with pytest.raises(ImageError) as caught:
        require_image(img)
    assert isinstance(caught.value, GatewayError)
    message = str(caught.value)
    assert message.startswith(f"{img} cannot be a sandbox root; 1 problem(s)")
    assert "/opt/cogni-tool is missing: gatewayd mounts cogni-tool (read-only) on it" in message
    assert f"create it: mkdir -p {img}/opt/cogni-tool" in message


def test_an_unreadable_directory_asks_for_the_check_to_run_as_root(img: Path) -> None:
    # Run the check as an unprivileged uid in a child, where /usr is closed to it.
    (img / "usr").chmod(0o700)
    read_end, write_end = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: drop to nobody, check, send the report, never return
        try:
            os.close(read_end)
            os.setgroups([])
            os.setresgid(65534, 65534, 65534)
            os.setresuid(65534, 65534, 65534)
            os.write(write_end, "\n".join(check_image(img).problems).encode())
        finally:
            os._exit(0)
    os.close(write_end)
    with os.fdopen(read_end, "rb") as reader:
        problems = reader.read().decode().splitlines()
    os.waitpid(pid, 0)
    assert any(
        problem.startswith(
            f"cannot inspect /usr/bin ({img}/usr/bin): Permission denied; run the check as root"
        )
        for problem in problems
    ), problems
    assert any(problem.startswith("/usr is not traversable by others") for problem in problems), (
        problems
    )


def test_mount_points_cover_what_the_plan_mounts_into_an_image() -> None:
    plan = build_plan(
        run_id="r1",
        workspace_host="/srv/ws",
        policy_paths=[],
        gateway_socket_host="/state/runs/r1/gateway.sock",
        cogni_tool_host_dir="/opt/cogni",
        command=["true"],
        extra_env_names=[],
        env_values={},
        state_dir="/state",
        netns_path="/run/netns/x",
        layout=HostLayout(),
        image_dir="/srv/images/debian",
    )
    # What lies inside /dev is made in the tmpfs bwrap's --dev creates, not in the image.
    mounted = {
        step.dest
        for step in plan.steps[1:]
        if not isinstance(step, RemountRo) and not step.dest.startswith("/dev/")
    }
    ours = {mp.path for mp in MOUNT_POINTS}
    assert mounted <= ours, mounted - ours
    kinds = {mp.path: mp.kind for mp in MOUNT_POINTS}
    assert kinds[SANDBOX_SOCKET] is EntryKind.FILE
    assert kinds[WORKSPACE] is EntryKind.DIRECTORY


def test_policy_directories_outside_the_workspace_need_mount_points_in_the_image(
    img: Path,
) -> None:
    visible = ["/data/reference", "/workspace/docs"]  # the second is made in the workspace
    report = check_image(img, policy_mount_points=visible)
    problem = only_problem(report)
    assert problem.startswith(
        "/data/reference is missing (there is no /data): gatewayd mounts a directory of the "
        "run's policy on it"
    )
    with pytest.raises(ImageError, match=r"/data/reference is missing"):
        require_image(img, policy_mount_points=visible)
    run_fix(problem, "create it: ")
    assert check_image(img, policy_mount_points=visible).ok
