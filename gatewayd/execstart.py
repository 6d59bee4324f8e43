"""Whether a systemd unit's service could start the program its ``ExecStart`` names.

Two things make systemd fail such a unit with ``203/EXEC`` although the program exists
where it was installed from:

- the unit's own sandboxing hides it: ``ProtectHome=`` puts an empty directory over
  ``/home``, ``/root`` and ``/run/user``, ``PrivateTmp=`` gives the service its own
  ``/tmp`` and ``/var/tmp``, ``InaccessiblePaths=`` and ``TemporaryFileSystem=`` mask what
  they name. A checkout's virtualenv under ``/root`` or ``/home``, or a pyenv's
  interpreter it links to, is gone for the service.
- the service's ``User=`` may not search a directory on the way, or execute the file.

:func:`check_exec_start` follows the program as the kernel would when systemd starts it:
every symbolic link on the way, and a script's ``#!`` interpreter (a virtualenv's
``gatewayd`` names ``bin/python``, which links to the interpreter it was made with), and
checks every path it meets against both. Hand-written: systemd has no "would this
ExecStart run" query short of starting the unit, and ``systemd-analyze verify`` checks
only that the file exists for root.

Under a staging root (``gatewayd install-systemd --root DIR``) paths are those the
service will see: a path is looked up in DIR, and on this host where DIR lacks it (a
package staged here links its virtualenv to this host's ``/usr/bin/python3``). DIR's own
mode is not checked (it stands for ``/``).

Permissions are the mode bits of the owner, group and others; ACLs are not read (an ACL
granting more than the bits is reported as missing, the safe direction), and the
service's capabilities are not counted on: systemd resolves ``ExecStart`` before it
hands them over.
"""

from __future__ import annotations

import grp
import os
import pwd
import stat
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from typing import Final

# The kernel's own limit on symbolic links followed in one lookup (ELOOP past it).
MAX_SYMLINKS: Final = 40
# A #! line is at most this long (the kernel's BINPRM_BUF_SIZE before Linux 5.1).
MAX_SHEBANG_BYTES: Final = 128
# A script's interpreter may itself be a script: the kernel follows four levels.
MAX_INTERPRETER_DEPTH: Final = 4
_S_IXOTH_SEARCH: Final = 0o1  # the x bit of one permission triple
_S_IROTH_READ: Final = 0o4  # the r bit of one permission triple

# What each setting hides, when it hides (ProtectHome=read-only leaves paths visible).
_PROTECT_HOME: Final = ("/home", "/root", "/run/user")
_PRIVATE_TMP: Final = ("/tmp", "/var/tmp")
_HIDING_PROTECT_HOME: Final = frozenset({"yes", "true", "on", "1", "tmpfs"})
_TRUE: Final = frozenset({"yes", "true", "on", "1"})

FIX_HINT: Final = (
    "install gatewayd where the service can run it: `make install` in a checkout makes "
    "/opt/gatewayd/venv with the system python3 and installs the unit for it "
    "(docs/operations.md, Install)"
)


class UnreachableProgram(Exception):
    """The service could not start the program; the message names the path, the reason,
    and the fix."""


@dataclass(frozen=True, slots=True)
class ServiceView:
    """What a unit's sandboxing hides (path prefix → the setting that hides it), and the
    service's user: its name, and uid and groups when it exists already (None: it is
    made later, so it owns nothing and is in no group of any file checked)."""

    hidden: tuple[tuple[str, str], ...]
    user: str
    uid: int | None
    gids: frozenset[int]


def service_view(unit_text: str) -> ServiceView:
    """Read a unit's ``[Service]`` settings that hide paths, and its ``User=``."""
    settings = _service_settings(unit_text)
    hidden: list[tuple[str, str]] = []
    if settings.get("ProtectHome", [""])[-1].lower() in _HIDING_PROTECT_HOME:
        hidden += [(prefix, "ProtectHome=") for prefix in _PROTECT_HOME]
    if settings.get("PrivateTmp", [""])[-1].lower() in _TRUE:
        hidden += [(prefix, "PrivateTmp=") for prefix in _PRIVATE_TMP]
    for value in settings.get("InaccessiblePaths", []):
        # "-path": ignored when missing, "+path": relative to the root directory.
        hidden += [(entry.lstrip("-+"), "InaccessiblePaths=") for entry in value.split()]
    for value in settings.get("TemporaryFileSystem", []):
        hidden += [(entry.split(":", 1)[0], "TemporaryFileSystem=") for entry in value.split()]
    user = settings.get("User", ["root"])[-1]
    try:
        entry = pwd.getpwnam(user)
    except KeyError:
        return ServiceView(tuple(hidden), user, None, frozenset())
    gids = frozenset(os.getgrouplist(user, entry.pw_gid))
    return ServiceView(tuple(hidden), user, entry.pw_uid, gids)


def _service_settings(unit_text: str) -> dict[str, list[str]]:
    """``[Service]``'s assignments, each key's values in order (an empty assignment
    resets the list, as systemd does)."""
    settings: dict[str, list[str]] = {}
    section = ""
    for raw in unit_text.splitlines():
        line = raw.strip()
        if not line or line[0] in "#;":
            continue
        if line.startswith("[") and line.endswith("]"):
            section = line[1:-1]
            continue
        if section != "Service" or "=" not in line:
            continue
        key, value = (part.strip() for part in line.split("=", 1))
        if value:
            settings.setdefault(key, []).append(value)
        else:
            settings[key] = []
    return settings


def check_exec_start(program: Path, view: ServiceView, *, root: Path = Path("/")) -> None:
    """Raise UnreachableProgram unless ``view``'s service can execute ``program`` (an
    absolute path as the service sees it), its links and its interpreters.

    Error handling: UnreachableProgram with the path, why, and the fix; also for a loop
    of links or a path that does not exist.
    """
    _check_file(program, view, root, named_by=f"ExecStart {program}", depth=0)


def _check_file(path: Path, view: ServiceView, root: Path, *, named_by: str, depth: int) -> None:
    real = _follow(path, view, root, named_by=named_by)
    found = _lstat(real, root)
    assert found is not None  # _follow ended on an existing non-link
    st, where = found
    if not stat.S_ISREG(st.st_mode):
        raise UnreachableProgram(f"{named_by}: {real} is not a regular file; {FIX_HINT}")
    if not _may(st, view, _S_IXOTH_SEARCH):
        raise UnreachableProgram(
            f"{named_by}: the service user {view.user} may not execute {real} "
            f"({_describe(st)}); chmod o+x {where}, or {FIX_HINT}"
        )
    interpreter = _interpreter(where)
    if interpreter is None:
        return
    # The kernel runs the interpreter with the script's path, and the interpreter opens
    # it as the service user: a script it may execute but not read fails after the exec
    # (python: "can't open file"), not with 203/EXEC, but fails all the same.
    if not _may(st, view, _S_IROTH_READ):
        raise UnreachableProgram(
            f"{named_by}: the service user {view.user} may not read {real} ({_describe(st)}), "
            f"which its #! interpreter {interpreter} must open; chmod o+r {where}, or {FIX_HINT}"
        )
    if depth >= MAX_INTERPRETER_DEPTH:
        raise UnreachableProgram(
            f"{named_by}: {real} starts a chain of more than {MAX_INTERPRETER_DEPTH} "
            "#! interpreters, which the kernel does not follow"
        )
    _check_file(
        interpreter,
        view,
        root,
        named_by=f"{named_by}, whose #! interpreter is {interpreter}",
        depth=depth + 1,
    )


def _follow(path: Path, view: ServiceView, root: Path, *, named_by: str) -> Path:
    """``path`` with every link followed, each path met checked (hidden, searchable);
    the final non-link path."""
    if not path.is_absolute():
        raise UnreachableProgram(f"{named_by}: {path} is not an absolute path")
    pending = list(PurePosixPath(path).parts[1:])
    current = Path("/")
    links = 0
    while pending:
        name = pending.pop(0)
        if name in ("", "."):
            continue
        if name == "..":
            current = current.parent
            continue
        candidate = current / name
        _check_visible(candidate, view, named_by=named_by, leads_to=Path(candidate, *pending))
        _check_searchable(current, view, root, named_by=named_by)
        found = _lstat(candidate, root)
        if found is None:
            raise UnreachableProgram(f"{named_by}: {candidate} does not exist; {FIX_HINT}")
        st, where = found
        if stat.S_ISLNK(st.st_mode):
            links += 1
            if links > MAX_SYMLINKS:
                raise UnreachableProgram(f"{named_by}: more than {MAX_SYMLINKS} links at {path}")
            target = PurePosixPath(os.readlink(where))
            pending = list(target.parts[1:] if target.is_absolute() else target.parts) + pending
            current = Path("/") if target.is_absolute() else current
            continue
        if pending and not stat.S_ISDIR(st.st_mode):
            raise UnreachableProgram(f"{named_by}: {candidate} is not a directory")
        current = candidate
    return current


def _check_visible(path: Path, view: ServiceView, *, named_by: str, leads_to: Path) -> None:
    for prefix, setting in view.hidden:
        if path == Path(prefix) or Path(prefix) in path.parents:
            raise UnreachableProgram(
                f"{named_by}: {leads_to} lies under {prefix}, which the unit's "
                f"{setting} hides from the service (systemd would fail it with 203/EXEC); "
                f"{FIX_HINT}"
            )


def _check_searchable(directory: Path, view: ServiceView, root: Path, *, named_by: str) -> None:
    if directory == Path("/") and root != Path("/"):
        return  # the staging root's own mode is not the target's
    found = _lstat(directory, root)
    if found is None:
        return  # its child is reported missing
    st, where = found
    if not _may(st, view, _S_IXOTH_SEARCH):
        raise UnreachableProgram(
            f"{named_by}: the service user {view.user} may not search the directory "
            f"{directory} ({_describe(st)}), so it cannot reach the program; "
            f"chmod o+x {where}, or {FIX_HINT}"
        )


def _lstat(path: Path, root: Path) -> tuple[os.stat_result, Path] | None:
    """The file the service would see at ``path``: in ``root``, else (staging) on this
    host; with where it was found. None: nowhere."""
    places = [root / path.relative_to("/")]
    if root != Path("/"):
        places.append(path)
    for place in places:
        try:
            return os.lstat(place), place
        except FileNotFoundError:
            continue
        except OSError as exc:
            raise UnreachableProgram(f"cannot look at {place}: {exc.strerror}") from exc
    return None


def _interpreter(path: Path) -> Path | None:
    """The interpreter a ``#!`` line names, or None for a file without one."""
    try:
        with path.open("rb") as file:
            head = file.read(MAX_SHEBANG_BYTES)
    except OSError as exc:
        raise UnreachableProgram(f"cannot read {path}: {exc.strerror}") from exc
    if not head.startswith(b"#!"):
        return None
    line = head[2:].split(b"\n", 1)[0].strip()
    if not line:
        return None
    return Path(os.fsdecode(line.split()[0]))


def _may(st: os.stat_result, view: ServiceView, bit: int) -> bool:
    """Whether the mode bits give ``view``'s user ``bit`` (1: execute/search, 4: read)."""
    if view.uid is not None and st.st_uid == view.uid:
        shift = 6
    elif st.st_gid in view.gids:
        shift = 3
    else:
        shift = 0
    return bool((st.st_mode >> shift) & bit)


def _describe(st: os.stat_result) -> str:
    try:
        owner = pwd.getpwuid(st.st_uid).pw_name
    except KeyError:
        owner = str(st.st_uid)
    try:
        group = grp.getgrgid(st.st_gid).gr_name
    except KeyError:
        group = str(st.st_gid)
    return f"mode {stat.S_IMODE(st.st_mode):04o}, owner {owner}:{group}"
