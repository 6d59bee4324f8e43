"""Reading the tool folders: each configured tool directory's ``<name>/manifest.json``
(or ``manifest.yaml``) and, for a wasm tool, its module's digest.

Threat model: a tool folder is code gatewayd runs for its runs, so whoever can change
one changes what the runs' calls do. The operator's configuration names the tool
directories (``tool_dirs``); everything beneath them is opened one component at a time
relative to its parent's descriptor, never following a symlink (``O_NOFOLLOW``), and
checked on the descriptor actually opened:

* a folder, manifest or entry (or a directory on the entry's way) that is a symlink is
  refused: a link could lead anywhere (another tool's folder, a run's workspace);
* the tool directory, each folder, manifest and entry must be owned by root or by
  gatewayd's own user and writable by no other user (nor group, but root's or
  gatewayd's own): a folder a sandbox uid owns (one lent inside a workspace) or anyone
  may write is refused, so no run plants or changes a tool;
* files are regular and bounded (:data:`MAX_MANIFEST_BYTES`, :data:`MAX_ENTRY_BYTES`);
  a FIFO or ``/dev/zero`` in their place is refused without blocking.

The digests (sha256) of each manifest's bytes and each wasm module are the tool's
identity in ``gatewayd tools show`` and in every call's audit entry.

One bad folder never stops the others: :func:`load_tool_dirs` returns the tools it could
load and a :class:`~gatewayd.runners.manifest.Problem` (file, field, reason) for each
that it could not.
"""

from __future__ import annotations

import errno
import hashlib
import os
import stat
from collections.abc import Collection, Iterator, Sequence
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from typing import Any, Final

import msgspec

from gatewayd import strictjson, strictyaml
from gatewayd.config import GatewaydConfig
from gatewayd.runners.manifest import (
    ManifestDefaults,
    ManifestError,
    Problem,
    parse_manifest,
)
from gatewayd.runners.spec import FolderTool
from gatewayd.sandbox.plan import FIXED_ENV_NAMES, SERVICE_ENV_NAMES
from gatewayd.tools.manifest import RunnerKind

# The manifest's names, in the order looked for; a folder holds exactly one.
MANIFEST_NAMES: Final = ("manifest.json", "manifest.yaml")
# A manifest is a page of JSON or YAML with an argument schema: 256 KiB holds the
# largest schemas real tools publish many times over; more is not a manifest.
MAX_MANIFEST_BYTES: Final = 256 * 1024
# A wasm module read to be digested (and compiled by the runner): tools compiled from C,
# Rust or Zig are kilobytes to a few MiB; 64 MiB leaves room for an interpreter built to
# wasm and bounds what one bad folder makes gatewayd read and hash at start.
MAX_ENTRY_BYTES: Final = 64 * 1024 * 1024
# Folders looked at in one tool directory: more is not a tool directory (a home
# directory named by mistake), and each costs a few opens at every start.
MAX_FOLDERS_PER_DIR: Final = 1000
_READ_CHUNK: Final = 1 << 20
_DIR_FLAGS: Final = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
_FILE_FLAGS: Final = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_NOCTTY | os.O_CLOEXEC
_FIX_MODE: Final = (
    "make it owned by root or gatewayd's user and writable by no one else (chmod go-w)"
)


class _Refused(Exception):
    """One file or folder cannot be used; ``str()`` says why."""


@dataclass(frozen=True, slots=True)
class ToolFolders:
    """What the tool directories hold: the tools loaded (in directory order, then by
    folder name) and every problem met (a folder that was refused, and why)."""

    tools: tuple[FolderTool, ...]
    problems: tuple[Problem, ...]


NO_TOOL_FOLDERS: Final = ToolFolders((), ())


def manifest_defaults(config: GatewaydConfig) -> ManifestDefaults:
    """What a manifest that leaves them out gets, from gatewayd's configuration, and
    the environment names no tool may declare: those gatewayd sets for sandboxed
    programs itself (as a policy's ``env.allow`` cannot name them), and those whose
    values it holds as secrets (models' ``api_key_env``, ``secret_env``, the MCP
    servers' secrets): secrets stay on the host."""
    refused = dict.fromkeys(
        (*FIXED_ENV_NAMES, *SERVICE_ENV_NAMES),
        "gatewayd sets this variable for sandboxed programs itself; a tool cannot be "
        "handed the host's",
    )
    secrets = [alias.api_key_env for alias in config.models.values() if alias.api_key_env]
    for name in (*secrets, *config.scrubbed_secret_env):
        refused[name] = (
            "gatewayd holds a secret in this variable (a model's api_key_env or secret_env), "
            "and secrets never leave the host"
        )
    return ManifestDefaults(
        runner=RunnerKind(config.tool_default_runner),
        timeout_s=config.tool_timeout_s,
        memory_mb=config.tool_memory_mb,
        refused_env=refused,
    )


def load_tool_dirs(
    dirs: Sequence[Path], *, defaults: ManifestDefaults, taken: Collection[str] = ()
) -> ToolFolders:
    """Every tool of the tool directories ``dirs``, in order. A tool whose name is in
    ``taken`` (the built-in tools') or that an earlier folder already has is refused:
    the first one keeps it, so a later directory can never shadow a tool.

    Error handling: never raises for a directory or folder; each problem is returned.
    """
    found: list[FolderTool | Problem] = []
    for directory in dirs:
        found.extend(_scan(directory, defaults))
    return without_clashes(found, taken)


def without_clashes(found: Sequence[FolderTool | Problem], taken: Collection[str]) -> ToolFolders:
    """``found`` (tools and problems, in order) with each tool whose name is in
    ``taken`` or is an earlier tool's turned into a problem naming the clash."""
    tools: list[FolderTool] = []
    problems: list[Problem] = []
    owners: dict[str, str] = {}
    for result in found:
        if isinstance(result, Problem):
            problems.append(result)
            continue
        clash = _clash(result, taken, owners)
        if clash is not None:
            problems.append(Problem(result.manifest_path, "name", clash))
            continue
        owners[result.name] = result.folder
        tools.append(result)
    return ToolFolders(tuple(tools), tuple(problems))


def load_paths(
    paths: Sequence[Path], *, defaults: ManifestDefaults, taken: Collection[str] = ()
) -> ToolFolders:
    """``gatewayd tools check PATH...``: each path a tool directory, or one tool's
    folder (it holds a manifest), checked as :func:`load_tool_dirs` checks them."""
    found: list[FolderTool | Problem] = []
    for path in paths:
        if is_tool_folder(path):
            found.append(load_folder(path, defaults=defaults))
        else:
            found.extend(_scan(path, defaults))
    return without_clashes(found, taken)


def is_tool_folder(path: Path) -> bool:
    """Whether ``path`` is one tool's folder (it holds a manifest) rather than a tool
    directory: what ``gatewayd tools check PATH`` tells apart."""
    return any(os.path.lexists(path / name) for name in MANIFEST_NAMES)


def load_folder(folder: Path, *, defaults: ManifestDefaults) -> FolderTool | Problem:
    """The tool of the one folder ``folder`` (``gatewayd tools check FOLDER``), checked
    as :func:`load_tool_dirs` checks each folder of a tool directory, or its problem."""
    real = Path(os.path.realpath(folder))
    try:
        parent_fd = os.open(real.parent, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    except OSError as exc:
        return Problem(str(folder), "", f"cannot be opened: {exc.strerror}")
    try:
        return _load_at(parent_fd, real, defaults)
    finally:
        os.close(parent_fd)


def _clash(tool: FolderTool, taken: Collection[str], owners: dict[str, str]) -> str | None:
    if tool.name in taken:
        return f"{tool.name!r} is the name of one of gatewayd's own tools; choose another"
    if tool.name in owners:
        return (
            f"{tool.name!r} is already the name of the tool in {owners[tool.name]}, which "
            "comes first (tool_dirs order, then folder names); rename one of them"
        )
    return None


def _scan(directory: Path, defaults: ManifestDefaults) -> Iterator[FolderTool | Problem]:
    """Each folder's tool or problem, by folder name; a directory that cannot be read
    is one problem."""
    real = Path(os.path.realpath(directory))
    try:
        dir_fd = os.open(real, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    except OSError as exc:
        yield Problem(str(directory), "", f"tool directory cannot be opened: {exc.strerror}")
        return
    try:
        try:
            _check_owner(os.fstat(dir_fd), "the tool directory")
        except _Refused as exc:
            yield Problem(str(directory), "", str(exc))
            return
        try:
            listed = os.listdir(dir_fd)
        except OSError as exc:
            yield Problem(str(directory), "", f"tool directory cannot be read: {exc.strerror}")
            return
        names = sorted(name for name in listed if not name.startswith("."))
        if len(names) > MAX_FOLDERS_PER_DIR:
            yield Problem(
                str(directory),
                "",
                f"holds {len(names)} entries; a tool directory holds at most "
                f"{MAX_FOLDERS_PER_DIR} tool folders (MAX_FOLDERS_PER_DIR)",
            )
            return
        for name in names:
            try:
                st = os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
            except OSError as exc:
                yield Problem(str(real / name), "", f"cannot be read: {exc.strerror}")
                continue
            if stat.S_ISLNK(st.st_mode):
                yield Problem(
                    str(real / name),
                    "",
                    "is a symlink; a tool folder must be a directory in the tool directory "
                    "itself (a link could lead anywhere)",
                )
            elif stat.S_ISDIR(st.st_mode):
                yield _load_at(dir_fd, real / name, defaults)
            # Anything else (a README beside the folders) is no tool.
    finally:
        os.close(dir_fd)


def _load_at(parent_fd: int, folder: Path, defaults: ManifestDefaults) -> FolderTool | Problem:
    """The tool of ``folder``, opened by its name relative to ``parent_fd``; its
    manifest and module are opened relative to that one descriptor of it."""
    where = str(folder)  # the file a problem is about, once known
    try:
        with _opened(parent_fd, folder.name, directory=True, what="the tool folder") as fd:
            _check_owner(os.fstat(fd), "the tool folder")
            manifest_name = _manifest_name(fd)
            where = str(folder / manifest_name)
            raw = _read(fd, manifest_name, MAX_MANIFEST_BYTES, "the manifest")
            data = _decoded(raw, manifest_name)
            tool = parse_manifest(data, file=where, folder=str(folder), defaults=defaults)
            entry_digest = ""
            if tool.runner is RunnerKind.WASM:
                relative = PurePosixPath(tool.entry[0]).relative_to(folder)
                try:
                    entry_digest = _entry_digest(fd, relative.parts)
                except _Refused as exc:
                    return Problem(where, "entry", f"{relative}: {exc}")
    except _Refused as exc:
        return Problem(where, "", str(exc))
    except ManifestError as exc:
        # Every problem of the file is in the message; the first names the field.
        first = exc.problems[0]
        more = "".join(f"\n  {p.field or '(document)'}: {p.reason}" for p in exc.problems[1:])
        return Problem(first.file, first.field, first.reason + more)
    except OSError as exc:  # a read that failed midway (EIO): this folder only
        return Problem(where, "", f"cannot be read: {exc.strerror or exc}")
    except (ValueError, TypeError, RecursionError) as exc:
        # The manifest's checks missed something a library refused: still this folder's
        # problem only, never the daemon's start.
        return Problem(where, "", f"cannot be used: {type(exc).__name__}: {str(exc)[:300]}")
    return msgspec.structs.replace(tool, manifest_digest=_sha256(raw), entry_digest=entry_digest)


def _manifest_name(folder_fd: int) -> str:
    present = []
    for name in MANIFEST_NAMES:
        try:
            os.stat(name, dir_fd=folder_fd, follow_symlinks=False)
        except FileNotFoundError:
            continue
        except OSError as exc:
            raise _Refused(f"{name} cannot be read: {exc.strerror}") from None
        present.append(name)
    if not present:
        raise _Refused(f"holds no manifest ({' or '.join(MANIFEST_NAMES)})")
    if len(present) > 1:
        raise _Refused(f"holds both {' and '.join(present)}; keep one")
    return present[0]


def _decoded(raw: bytes, name: str) -> Any:
    try:
        if name.endswith(".json"):
            return strictjson.loads(raw)
        return strictyaml.load(raw.decode("utf-8"))
    except UnicodeDecodeError as exc:
        raise _Refused(f"not UTF-8 text (bad byte at offset {exc.start})") from None
    except strictjson.JsonInputError as exc:
        raise _Refused(f"not valid JSON: {exc}") from None
    except strictyaml.YamlInputError as exc:
        raise _Refused(f"not valid YAML: {exc}") from None


@contextmanager
def _opened(dir_fd: int, name: str, *, directory: bool, what: str) -> Iterator[int]:
    """``name`` in ``dir_fd``, never through a symlink; closed on exit."""
    try:
        fd = os.open(name, _DIR_FLAGS if directory else _FILE_FLAGS, dir_fd=dir_fd)
    except OSError as exc:
        # O_NOFOLLOW on a symlink: ELOOP, or ENOTDIR with O_DIRECTORY.
        if exc.errno in (errno.ELOOP, errno.ENOTDIR) and _is_symlink(dir_fd, name):
            raise _Refused(
                f"{what} ({name}) is a symlink, which gatewayd never follows here (a link "
                "could lead out of the tool's folder)"
            ) from None
        raise _Refused(f"{what} ({name}) cannot be opened: {exc.strerror}") from None
    try:
        yield fd
    finally:
        os.close(fd)


def _is_symlink(dir_fd: int, name: str) -> bool:
    try:
        return stat.S_ISLNK(os.stat(name, dir_fd=dir_fd, follow_symlinks=False).st_mode)
    except OSError:
        return False


def _check_owner(st: os.stat_result, what: str) -> None:
    if st.st_uid not in (0, os.geteuid()):
        raise _Refused(
            f"{what} is owned by uid {st.st_uid}, neither root nor gatewayd's user; {_FIX_MODE}"
        )
    # Group-writable is fine for gatewayd's own group or root's (a umask of 002 with a
    # group per user): no one outside them could change the tool.
    own_group = st.st_gid in (0, os.getegid())
    if st.st_mode & stat.S_IWOTH or (st.st_mode & stat.S_IWGRP and not own_group):
        raise _Refused(
            f"{what} is writable by group or others (mode {stat.S_IMODE(st.st_mode):04o}, "
            f"gid {st.st_gid}), who could change the tool; {_FIX_MODE}"
        )


def _regular(fd: int, what: str, max_bytes: int) -> os.stat_result:
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode):
        raise _Refused(f"{what} is not a regular file")
    _check_owner(st, what)
    if st.st_size > max_bytes:
        raise _Refused(f"{what} is {st.st_size} bytes; at most {max_bytes} are read")
    return st


def _read(dir_fd: int, name: str, max_bytes: int, what: str) -> bytes:
    with _opened(dir_fd, name, directory=False, what=what) as fd:
        _regular(fd, what, max_bytes)
        chunks = []
        size = 0
        while chunk := os.read(fd, _READ_CHUNK):
            size += len(chunk)
            if size > max_bytes:  # it grew while read
                raise _Refused(f"{what} is over {max_bytes} bytes")
            chunks.append(chunk)
        return b"".join(chunks)


def _entry_digest(folder_fd: int, parts: tuple[str, ...]) -> str:
    """The sha256 of the module at ``parts`` beneath the folder, walked one directory
    at a time without following a symlink."""
    with ExitStack() as stack:
        current = folder_fd
        for part in parts[:-1]:
            current = stack.enter_context(
                _opened(current, part, directory=True, what="a directory on its way")
            )
            _check_owner(os.fstat(current), f"the directory {part}")
        module = stack.enter_context(
            _opened(current, parts[-1], directory=False, what="the module")
        )
        _regular(module, "the module", MAX_ENTRY_BYTES)
        digest = hashlib.sha256()
        size = 0
        while chunk := os.read(module, _READ_CHUNK):
            size += len(chunk)
            if size > MAX_ENTRY_BYTES:  # it grew while read
                raise _Refused(f"the module is over {MAX_ENTRY_BYTES} bytes")
            digest.update(chunk)
        return f"sha256:{digest.hexdigest()}"


def _sha256(data: bytes) -> str:
    return f"sha256:{hashlib.sha256(data).hexdigest()}"
