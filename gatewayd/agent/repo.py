"""Host-side repository operations for agent runs (reference note 004's RepoPort).

An agent run: the host clones a repository at a commit into a workspace, the sandbox
edits it, then the host turns the changed files into git patches, pushes them to a
``cogni/...`` branch and may open a pull request.

Threat model: the sandbox may write *anything* into its workspace, ``.git/`` included
(hooks, a config with ``core.fsmonitor``, filters, ``core.sshCommand``, ``insteadOf``
rewrites, symlinks out of the tree). So the host never runs git inside a directory the
sandbox could write: it only reads file contents from the workspace, without following
a symlink in any component, and runs git in host-private clones of a host-private
mirror, with a configuration of our own (no system or global config, hooks off).

Credentials travel only as an HTTP header in git's environment configuration
(``GIT_CONFIG_COUNT``): never in argv (world-readable in ``/proc``), never in a file,
never in a URL. ``/proc/<pid>/environ`` is readable only by the process's owner.

All functions block; callers run them in a worker thread (``trio.to_thread``).

Error handling: every failure is a :class:`RepoError` whose message says what failed
and what to do, with git's stderr trimmed and scrubbed of credentials.
"""

from __future__ import annotations

import base64
import contextlib
import http.client
import json
import os
import re
import shutil
import signal
import stat
import subprocess
import tempfile
import urllib.error
import urllib.request
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Final, Literal
from urllib.parse import urlsplit

from gatewayd import strictjson
from gatewayd.errors import GatewayError
from gatewayd.files import write_all
from gatewayd.protocol import ErrorCode
from gatewayd.workspace.session import WorkspaceDiff, open_dirs
from gatewayd.workspace.treediff import open_parent

# Network operations on a large repository can take minutes; local ones should not.
FETCH_TIMEOUT_S: Final = 600.0
LOCAL_TIMEOUT_S: Final = 120.0
PUSH_TIMEOUT_S: Final = 300.0
LS_REMOTE_TIMEOUT_S: Final = 60.0
PR_TIMEOUT_S: Final = 30.0
# What one patch may carry from the workspace (file contents and link targets).
MAX_PATCH_INPUT_BYTES: Final = 64 << 20
COPY_CHUNK_BYTES: Final = 1 << 20
# What each entry costs the patch beyond its content: its paths in the headers and the
# stat line, and git's lines around them (format-patch repeats a path about 3 times).
PATCH_ENTRY_OVERHEAD_BYTES: Final = 128
MAX_PATCH_ENTRIES: Final = 20_000
# The result names at most this many skipped paths (then how many more there were).
MAX_SKIPPED_LISTED: Final = 100
# Lines git's mail parser reads as the start of a patch, a new mail or a header: in a
# commit message they would let the message carry a diff of its own through `git am`.
_MAIL_BREAK_RE: Final = re.compile(r"^(?:diff -|Index: |---|From |From:|Subject:|Date:)")
# Enough of git's stderr to diagnose, short enough for an audit entry.
STDERR_LIMIT: Final = 2000
# A forge's answer to "open a pull request" is a few KiB; anything bigger is not one.
FORGE_RESPONSE_LIMIT: Final = 1 << 20
# A pull request's URL goes into the run's result, its progress line and the audit log:
# a forge's is well under this; a longer one is not the URL of a pull request.
MAX_PR_URL_CHARS: Final = 2048
# The forge's words quoted in an error: enough to say what it refused.
FORGE_QUOTE_CHARS: Final = 200

# Only system directories: git must not pick up helpers from an attacker-writable PATH.
SAFE_PATH: Final = "/usr/local/bin:/usr/bin:/bin"
DEFAULT_AUTHOR: Final = ("cogni agent", "agent@cogni.invalid")
# The only branches an agent run pushes: its own namespace on the forge, never main.
BRANCH_PREFIX: Final = "cogni/"
_BRANCH_RE: Final = re.compile(re.escape(BRANCH_PREFIX) + r"[A-Za-z0-9._-]+")
# A full commit id (SHA-1 or SHA-256, lowercase hex): never a branch name or a prefix.
SHA_RE: Final = re.compile(r"[0-9a-f]{40}|[0-9a-f]{64}")
_REPOSITORY_RE: Final = re.compile(r"[A-Za-z0-9._-]+/[A-Za-z0-9._-]+")
_URL_USERINFO_RE: Final = re.compile(r"(://)[^/\s@]*@")
_LOOPBACK_HOSTS: Final = frozenset({"127.0.0.1", "::1", "localhost"})

# Passed as ``-c`` on every git call; they override anything in a repository's config.
_SAFE_CONFIG: Final = (
    "core.hooksPath=/dev/null",  # no hook runs, whatever a repository says
    "core.fsmonitor=false",  # fsmonitor is a command git would run
    "core.untrackedCache=false",
    "core.pager=cat",
    "core.symlinks=true",
    "core.fileMode=true",
    "core.autocrlf=false",
    "credential.helper=",  # empty value: reset the list, no helper runs
    "protocol.file.allow=always",  # local mirrors (and test repos) are plain paths
    "protocol.ext.allow=never",  # ext:: runs an arbitrary command
    "http.followRedirects=false",  # the Authorization header must not follow a redirect
    "transfer.fsckObjects=true",  # reject malformed objects from the remote
    "submodule.recurse=false",
    "gc.auto=0",  # no detached background gc outliving our timeout
    "maintenance.auto=false",
    "commit.gpgSign=false",
    "advice.detachedHead=false",
    "init.defaultBranch=main",
)


# ``--no-hardlinks``: a hard-linked object file would be shared with the source, so
# whoever can write the clone could change the mirror. ``--template=``: no sample hooks.
_CLONE: Final = ("clone", "--no-hardlinks", "--template=", "--quiet")
_FORMAT_PATCH: Final = ("format-patch", "-1", "--binary", "--stdout", "--no-signature")
_COMMIT: Final = ("commit", "--quiet", "--no-verify", "--no-gpg-sign", "--cleanup=strip", "-m")


class RepoError(GatewayError):
    """A repository operation failed; the message says what and what to do."""

    code = ErrorCode.TOOL_FAILED


@dataclass(frozen=True, repr=False)
class RepoCredentials:
    """A forge token, sent only as ``Authorization: Basic`` via git's env config."""

    token: str | None = None
    username: str = "x-access-token"

    def __repr__(self) -> str:
        shown = "None" if self.token is None else "'***'"
        return f"RepoCredentials(token={shown}, username={self.username!r})"

    def header(self) -> str | None:
        """The ``http.extraHeader`` value, or None without a token."""
        if not self.token:
            return None
        if _has_control(self.token) or _has_control(self.username) or ":" in self.username:
            # A CR/LF would inject headers; ':' would split user and password wrongly.
            raise RepoError(
                "repository credentials are malformed: the token and username must not "
                "contain control characters and the username must not contain ':'"
            )
        pair = f"{self.username}:{self.token}".encode()
        return "Authorization: Basic " + base64.b64encode(pair).decode("ascii")

    def secrets(self) -> list[str]:
        """Every form of the token that could show up in git's output."""
        if not self.token:
            return []
        pair = f"{self.username}:{self.token}".encode()
        return [self.token, base64.b64encode(pair).decode("ascii")]


@dataclass(frozen=True)
class PatchResult:
    """``patch``: ``git format-patch`` output ("" when nothing changed);
    ``skipped``: ``"path: why"`` for every changed path that was not copied."""

    patch: str
    skipped: list[str] = field(default_factory=list)


@dataclass(frozen=True)
class PushResult:
    branch: str
    head_sha: str


# --- running git --------------------------------------------------------------------


def _has_control(text: str) -> bool:
    return any(ord(ch) < 0x20 or ord(ch) == 0x7F for ch in text)


def _scrub(text: str, secrets: Iterable[str]) -> str:
    for secret in secrets:
        if secret:
            text = text.replace(secret, "***")
    text = _URL_USERINFO_RE.sub(r"\1***@", text)
    text = text.strip()
    if len(text) > STDERR_LIMIT:
        text = text[:STDERR_LIMIT] + " [...]"
    return text


def _hint(stderr: str) -> str:
    """What the operator should do, for the failures we recognise."""
    low = stderr.lower()
    if (
        "authentication failed" in low
        or "could not read username" in low
        or "could not read password" in low
        or " 401" in low
        or " 403" in low
    ):
        return (
            " The server refused access: check that the token is set, valid and allowed "
            "to read (and, for a push, write) this repository."
        )
    if "could not resolve host" in low or "failed to connect" in low:
        return " The server is unreachable: check the repository URL and the network."
    if "not found" in low and "repository" in low:
        return " Check the repository URL."
    return ""


def _git(
    args: Sequence[str],
    *,
    what: str,
    cwd: Path | None = None,
    credentials: RepoCredentials | None = None,
    timeout_s: float = LOCAL_TIMEOUT_S,
    stdin: bytes | None = None,
    extra_env: Mapping[str, str] | None = None,
    ok_codes: Sequence[int] = (0,),
) -> subprocess.CompletedProcess[bytes]:
    """Run git with the safe configuration; RepoError on failure or timeout.

    Resource handling: each call gets an empty private HOME (no ``~/.gitconfig``,
    no ``$XDG_CONFIG_HOME/git``), removed afterwards. Without ``cwd`` git runs in that
    HOME with a ceiling above it, so it never discovers a repository someone planted
    in a parent directory (``/tmp/.git``) and reads its config.
    """
    git = shutil.which("git", path=SAFE_PATH)
    if git is None:
        raise RepoError(f"{what} failed: git is not installed (looked in {SAFE_PATH})")
    secrets = credentials.secrets() if credentials else []
    home = Path(tempfile.mkdtemp(prefix="cogni-git-home-"))
    try:
        env = {
            "PATH": SAFE_PATH,
            "HOME": str(home),
            "XDG_CONFIG_HOME": str(home),
            "LC_ALL": "C",
            "GIT_CONFIG_NOSYSTEM": "1",
            "GIT_CONFIG_GLOBAL": "/dev/null",
            "GIT_ATTR_NOSYSTEM": "1",
            "GIT_TERMINAL_PROMPT": "0",
            "GIT_ASKPASS": "/bin/false",  # a 401 fails instead of prompting
            "GIT_PROTOCOL_FROM_USER": "0",
            "GIT_NO_REPLACE_OBJECTS": "1",
            "GIT_CEILING_DIRECTORIES": str(home.parent),
        }
        header = credentials.header() if credentials else None
        if header is not None:
            env |= {
                "GIT_CONFIG_COUNT": "1",
                "GIT_CONFIG_KEY_0": "http.extraHeader",
                "GIT_CONFIG_VALUE_0": header,
            }
        if extra_env:
            env |= extra_env
        argv = [git]
        for item in _SAFE_CONFIG:
            argv += ["-c", item]
        argv += args
        # Popen rather than run(): a timeout must kill git's helpers (git-remote-https,
        # index-pack) too, or they keep the pipes open and the wait never ends.
        with subprocess.Popen(
            argv,
            cwd=cwd or home,
            env=env,
            stdin=subprocess.PIPE if stdin is not None else subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            start_new_session=True,
        ) as proc:
            try:
                out, err = proc.communicate(stdin, timeout=timeout_s)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGKILL)
                proc.communicate()
                raise RepoError(
                    f"{what} failed: git did not finish within {timeout_s:g} s; check that "
                    "the server is reachable, or raise the timeout for large repositories"
                ) from None
    except OSError as exc:
        raise RepoError(f"{what} failed: could not run git: {exc.strerror}") from None
    finally:
        shutil.rmtree(home, ignore_errors=True)
    if proc.returncode not in ok_codes:
        detail = _scrub(err.decode("utf-8", "replace"), secrets)
        raise RepoError(
            f"{what} failed (git exit {proc.returncode}): {detail or 'no error output'}."
            + _hint(detail)
        )
    return subprocess.CompletedProcess(argv, proc.returncode, out, err)


# --- checks -------------------------------------------------------------------------


def _check_url(repo_url: str, credentials: RepoCredentials | None) -> None:
    """Only http(s) and file URLs or absolute paths, never with userinfo."""
    if not repo_url or _has_control(repo_url) or repo_url.startswith("-"):
        raise RepoError("the repository URL is empty or contains control characters")
    if repo_url.startswith("/"):
        return
    parts = urlsplit(repo_url)
    if parts.scheme not in ("https", "http", "file"):
        raise RepoError(
            f"repository URL scheme {parts.scheme!r} is not supported: use https:// "
            "(or http:// to a loopback test server, or file:// / an absolute path)"
        )
    if "@" in parts.netloc:
        raise RepoError(
            f"the repository URL {_scrub(repo_url, [])} carries credentials (user@ or "
            "user:password@): remove them from the URL and pass the token as "
            "RepoCredentials, which git sends as a header"
        )
    token = credentials.token if credentials else None
    if token and parts.scheme == "http" and parts.hostname not in _LOOPBACK_HOSTS:
        raise RepoError(
            f"refusing to send the token over plain http to {parts.hostname}: use https"
        )


def _check_sha(sha: str) -> None:
    if not SHA_RE.fullmatch(sha):
        raise RepoError(
            f"commit {sha!r} is not a full commit id: pass 40 (SHA-1) or 64 (SHA-256) "
            "lowercase hex digits, not a branch name or an abbreviation"
        )


def _check_branch(branch: str) -> None:
    if not _BRANCH_RE.fullmatch(branch) or ".." in branch or branch.endswith((".", ".lock")):
        raise RepoError(
            f"branch {branch!r} is not allowed: agent runs push only to new branches named "
            f"{BRANCH_PREFIX}<name>, <name> made of letters, digits, '.', '_' and '-' "
            "(no '..', not ending in '.' or '.lock')"
        )


def _require_commit(mirror: Path, sha: str, timeout_s: float) -> None:
    _check_sha(sha)
    found = _git(
        ["--git-dir", str(mirror), "cat-file", "-e", f"{sha}^{{commit}}"],
        what=f"looking up commit {sha}",
        timeout_s=timeout_s,
        ok_codes=(0, 1, 128),
    )
    if found.returncode != 0:
        raise RepoError(
            f"commit {sha} is not in the mirror {mirror}: check the commit id, or refresh "
            "the mirror with fetch_mirror if the commit is newer than the last fetch"
        )


def _prepare_empty_dir(path: Path, role: str) -> None:
    """``path`` must not exist (created here, mode 0700) or be an empty directory."""
    try:
        path.mkdir(mode=0o700)
    except FileExistsError:
        if not path.is_dir() or path.is_symlink() or any(path.iterdir()):
            raise RepoError(
                f"the {role} {path} already exists and is not an empty directory: pass a new path"
            ) from None
        path.chmod(0o700)
    except OSError as exc:
        raise RepoError(f"could not create the {role} {path}: {exc.strerror}") from None


# --- public operations --------------------------------------------------------------


def fetch_mirror(
    repo_url: str,
    mirror: Path,
    *,
    credentials: RepoCredentials,
    timeout_s: float = FETCH_TIMEOUT_S,
) -> None:
    """Make (or refresh) a bare mirror of ``repo_url`` in the host-private ``mirror``.

    A new ``mirror`` is a ``git clone --bare``; an existing bare repository is brought up
    to date (branches and tags, pruned). Only the URL, never the token, is stored.
    """
    _check_url(repo_url, credentials)
    if (mirror / "HEAD").is_file() and (mirror / "objects").is_dir():
        _git(
            [
                "--git-dir",
                str(mirror),
                "fetch",
                "--quiet",
                "--prune",
                "--",
                repo_url,
                "+refs/heads/*:refs/heads/*",
                "+refs/tags/*:refs/tags/*",
            ],
            what=f"updating the mirror of {_scrub(repo_url, [])}",
            credentials=credentials,
            timeout_s=timeout_s,
        )
        return
    _prepare_empty_dir(mirror, "mirror directory")
    try:
        _git(
            [*_CLONE, "--bare", "--", repo_url, str(mirror)],
            what=f"cloning {_scrub(repo_url, [])}",
            credentials=credentials,
            timeout_s=timeout_s,
        )
    except BaseException:
        shutil.rmtree(mirror, ignore_errors=True)
        raise


def _clone_at(mirror: Path, sha: str, dest: Path, timeout_s: float, role: str) -> None:
    """A clone of ``mirror`` in ``dest``, detached at ``sha``, with no remote.

    ``--no-hardlinks``: a hard-linked object file would be shared with the mirror, and
    whoever writes ``dest`` could then change the mirror. ``--template=``: no sample
    hooks, no ``info/exclude``.
    """
    _prepare_empty_dir(dest, role)
    _git(
        [*_CLONE, "--no-checkout", "--", str(mirror), str(dest)],
        what=f"cloning the mirror into the {role}",
        timeout_s=timeout_s,
    )
    _git(
        ["-C", str(dest), "checkout", "--quiet", "--detach", sha],
        what=f"checking out {sha}",
        timeout_s=timeout_s,
    )
    _git(
        ["-C", str(dest), "remote", "remove", "origin"],
        what="removing the mirror remote",
        timeout_s=timeout_s,
    )


def checkout_at(mirror: Path, sha: str, dest: Path, *, timeout_s: float = LOCAL_TIMEOUT_S) -> None:
    """The workspace base: ``dest`` becomes a clone of ``mirror`` detached at ``sha``.

    No remote is left and no credential is anywhere in it; after this, ``dest`` belongs
    to the sandbox and the host never runs git in it again.
    """
    _check_sha(sha)
    _require_commit(mirror, sha, timeout_s)
    _clone_at(mirror, sha, dest, timeout_s, "workspace directory")


def default_branch(
    repo_url: str, *, credentials: RepoCredentials, timeout_s: float = LS_REMOTE_TIMEOUT_S
) -> str:
    """The branch the remote's HEAD points at (``git ls-remote --symref``)."""
    default, _ = _ls_remote(repo_url, credentials, ["HEAD"], timeout_s)
    if default is None:
        raise RepoError(
            f"the remote {_scrub(repo_url, [])} does not say which branch is its default "
            "(HEAD is not a symbolic ref: empty repository or very old server)"
        )
    return default


def _ls_remote(
    repo_url: str, credentials: RepoCredentials, patterns: Sequence[str], timeout_s: float
) -> tuple[str | None, dict[str, str]]:
    """(default branch or None, {ref name: sha}) for ``patterns``."""
    _check_url(repo_url, credentials)
    out = _git(
        ["ls-remote", "--symref", "--", repo_url, *patterns],
        what=f"listing the branches of {_scrub(repo_url, [])}",
        credentials=credentials,
        timeout_s=timeout_s,
    ).stdout.decode("utf-8", "replace")
    default: str | None = None
    refs: dict[str, str] = {}
    for line in out.splitlines():
        value, _, name = line.partition("\t")
        if value.startswith("ref: "):
            if name == "HEAD":
                default = value[len("ref: ") :].removeprefix("refs/heads/")
        elif name:
            refs[name] = value
    return default, refs


# --- patches from a sandbox-written tree --------------------------------------------

EntryKind = Literal["file", "link"]


def _refusal(rel: str) -> str | None:
    """Why ``rel`` must not be copied into a commit, or None."""
    parts = rel.rstrip("/").split("/")
    if rel.startswith("/") or any(p in ("", ".", "..") for p in parts):
        return "not a normalized relative path"
    for part in parts:
        # Also the names Windows and macOS git treat as .git ('.git.', '.git ', 'git~1').
        folded = part.casefold().rstrip(". ")
        if folded in (".git", "git~1"):
            return "a .git path: git metadata is never taken from the workspace"
    return None


def _read_entry(tree: Path, rel: str) -> tuple[EntryKind, bytes | int, bool] | None:
    """(kind, an open descriptor of the file or the link's target, executable) of
    ``tree/rel``; None if it is not a file or link. The caller closes the descriptor.
    No symlink is followed in any component (OSError: ELOOP/ENOTDIR)."""
    parent, name = open_parent(tree, rel)
    try:
        mode = os.stat(name, dir_fd=parent, follow_symlinks=False).st_mode
        if stat.S_ISLNK(mode):
            return "link", os.fsencode(os.readlink(name, dir_fd=parent)), False
        if not stat.S_ISREG(mode):
            return None
        fd = os.open(
            name, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, dir_fd=parent
        )
    finally:
        os.close(parent)
    # Mode and content from one descriptor: the sandbox may be swapping the file.
    mode = os.fstat(fd).st_mode
    if not stat.S_ISREG(mode):
        os.close(fd)
        return None
    return "file", fd, bool(mode & stat.S_IXUSR)


def _write_entry(
    root: Path, rel: str, kind: EntryKind, data: bytes | int, executable: bool
) -> None:
    """Create ``root/rel`` (replacing a file, link or empty directory there) from
    ``data``: bytes, or a descriptor to copy from in chunks (any size, little memory)."""
    *dirs, name = rel.split("/")
    fd = open_dirs(root, dirs, create=True)
    try:
        try:
            existing = os.stat(name, dir_fd=fd, follow_symlinks=False).st_mode
        except FileNotFoundError:
            pass
        else:
            if stat.S_ISDIR(existing):
                os.rmdir(name, dir_fd=fd)  # OSError ENOTEMPTY: reported as skipped
            else:
                os.unlink(name, dir_fd=fd)
        if kind == "link":
            assert isinstance(data, bytes)
            os.symlink(os.fsdecode(data), name, dir_fd=fd)
            return
        mode = 0o755 if executable else 0o644
        flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
        out = os.open(name, flags, mode, dir_fd=fd)
        try:
            if isinstance(data, int):
                while chunk := os.read(data, COPY_CHUNK_BYTES):
                    write_all(out, chunk)
            else:
                write_all(out, data)
            os.fchmod(out, mode)  # the umask must not drop the exec bit
        finally:
            os.close(out)
    finally:
        os.close(fd)


def _remove_entry(root: Path, rel: str) -> None:
    *dirs, name = rel.split("/")
    try:
        fd = open_dirs(root, dirs, create=False)
    except FileNotFoundError:
        return
    try:
        os.unlink(name, dir_fd=fd)
    except FileNotFoundError:
        pass
    finally:
        os.close(fd)


def _identity_env(author: tuple[str, str]) -> dict[str, str]:
    name, email = author
    if not name or not email or any(_has_control(x) or "<" in x or ">" in x for x in author):
        raise RepoError(
            "the commit author must be a non-empty (name, email) without '<', '>' or "
            "control characters"
        )
    return {
        "GIT_AUTHOR_NAME": name,
        "GIT_AUTHOR_EMAIL": email,
        "GIT_COMMITTER_NAME": name,
        "GIT_COMMITTER_EMAIL": email,
    }


def patch_from_tree(
    mirror: Path,
    sha: str,
    tree: Path,
    changes: WorkspaceDiff,
    *,
    message: str,
    author: tuple[str, str] = DEFAULT_AUTHOR,
    scratch: Path,
    timeout_s: float = LOCAL_TIMEOUT_S,
    max_bytes: int = MAX_PATCH_INPUT_BYTES,
) -> PatchResult:
    """One commit's ``format-patch`` with the changed entries of the sandbox's ``tree``.

    A fresh clone of ``mirror`` at ``sha`` is made in ``scratch`` (host-private); the
    entries ``changes`` names are copied from ``tree`` into it - files by content and exec
    bit, symlinks as links, deletions as deletions - without following a symlink on
    either side. Paths with a ``.git`` component are refused and listed in ``skipped``,
    as are entries that vanished, could not be read without following a link, or that
    ``.gitignore`` excludes. Directory entries (``dir/``) are implied by their files;
    an empty directory cannot be committed. The written entries total ``max_bytes`` at
    most: the sandbox chooses how much it writes, and the patch is held in memory and
    in the run's result; an entry past the budget is skipped, and says so.
    """
    if not message.strip():
        raise RepoError("the commit message is empty: describe the change")
    message = mail_safe(message)
    identity = _identity_env(author)
    _check_sha(sha)
    _require_commit(mirror, sha, timeout_s)
    _clone_at(mirror, sha, scratch, timeout_s, "scratch directory")

    skipped: list[str] = []
    removals = [*changes.removed, *(old for old, _ in changes.renamed)]
    writes = [*changes.added, *changes.modified, *(new for _, new in changes.renamed)]
    removed_dirs: list[str] = []
    budget, entries = max_bytes, 0
    # Removals first: a file replaced by a directory of the same name needs the room.
    for rel in sorted(set(removals)):
        if (why := _refusal(rel)) is not None:
            skipped.append(f"{rel}: {why}")
        elif rel.endswith("/"):
            removed_dirs.append(rel.rstrip("/"))
        else:
            try:
                _remove_entry(scratch, rel)
            except OSError as exc:
                skipped.append(f"{rel}: could not be deleted ({exc.strerror})")
    for rel in sorted(removed_dirs, key=lambda r: r.count("/"), reverse=True):
        # Left behind empty by the removals above; git does not track directories.
        with contextlib.suppress(OSError):
            _remove_entry_dir(scratch, rel)
    # Sorted: a parent link ('a -> /etc') is written before 'a/x' would go through it.
    for rel in sorted(set(writes)):
        if (why := _refusal(rel)) is not None:
            skipped.append(f"{rel}: {why}")
            continue
        if rel.endswith("/"):
            continue
        try:
            entry = _read_entry(tree, rel)
        except FileNotFoundError:
            entry = None
        except OSError as exc:
            skipped.append(
                f"{rel}: not read, a parent in the workspace is a symlink or not a "
                f"directory ({exc.strerror})"
            )
            continue
        if entry is None:
            skipped.append(f"{rel}: no longer a file or symlink in the workspace")
            continue
        kind, data, executable = entry
        try:
            size = len(data) if isinstance(data, bytes) else os.fstat(data).st_size
            size += PATCH_ENTRY_OVERHEAD_BYTES + 3 * len(rel.encode())
            if entries >= MAX_PATCH_ENTRIES:
                skipped.append(f"{rel}: over the patch's limit of {MAX_PATCH_ENTRIES} files")
                continue
            if size > budget:
                skipped.append(
                    f"{rel}: {size} bytes, over what is left of the patch's "
                    f"{max_bytes}-byte limit ({budget} bytes)"
                )
                continue
            budget -= size
            entries += 1
            _write_entry(scratch, rel, kind, data, executable)
        except OSError as exc:
            skipped.append(
                f"{rel}: not written, a parent is a symlink or file, or a non-empty "
                f"directory is in the way ({exc.strerror})"
            )
        finally:
            if isinstance(data, int):
                os.close(data)

    repo = ["-C", str(scratch)]
    _git([*repo, "add", "--all", "--", "."], what="staging the changes", timeout_s=timeout_s)
    ignored = _git(
        [*repo, "ls-files", "-z", "--others", "--ignored", "--exclude-standard"],
        what="listing ignored files",
        timeout_s=timeout_s,
    ).stdout
    for rel_bytes in sorted(filter(None, ignored.split(b"\0"))):
        skipped.append(f"{os.fsdecode(rel_bytes)}: ignored by .gitignore")
    staged = _git(
        [*repo, "diff", "--cached", "--quiet"],
        what="checking for changes",
        timeout_s=timeout_s,
        ok_codes=(0, 1),
    )
    if staged.returncode == 0:
        return PatchResult(patch="", skipped=_capped(skipped))
    name, email = author
    _git(
        [*repo, "-c", f"user.name={name}", "-c", f"user.email={email}", *_COMMIT, message],
        what="committing the changes",
        timeout_s=timeout_s,
        extra_env=identity,
    )
    patch = _git(
        [*repo, *_FORMAT_PATCH, "HEAD"], what="writing the patch", timeout_s=timeout_s
    ).stdout
    # Text files need not be UTF-8; surrogateescape keeps their bytes for `git am`.
    return PatchResult(patch=patch.decode("utf-8", "surrogateescape"), skipped=_capped(skipped))


def mail_safe(message: str) -> str:
    """``message`` with every line git's mail parser would take for a patch, a mail
    separator or an in-body header indented by one space: a model's commit message
    must not carry a diff of its own into `git am` (nor change the author)."""
    lines = message.splitlines(keepends=True)
    return "".join(" " + line if _MAIL_BREAK_RE.match(line) else line for line in lines)


def _after_first_line(patch: bytes) -> bytes:
    """A patch without its ``From <commit> <date>`` line (the commit id differs after
    `git am`: its committer date is new)."""
    return patch.split(b"\n", 1)[1] if b"\n" in patch else b""


def _capped(skipped: list[str]) -> list[str]:
    if len(skipped) <= MAX_SKIPPED_LISTED:
        return skipped
    return [*skipped[:MAX_SKIPPED_LISTED], f"... and {len(skipped) - MAX_SKIPPED_LISTED} more"]


def _remove_entry_dir(root: Path, rel: str) -> None:
    *dirs, name = rel.split("/")
    fd = open_dirs(root, dirs, create=False)
    try:
        os.rmdir(name, dir_fd=fd)
    finally:
        os.close(fd)


# --- pushing ------------------------------------------------------------------------


def push_branch_from_patches(
    repo_url: str,
    mirror: Path,
    base_sha: str,
    patches: Sequence[str],
    branch: str,
    *,
    credentials: RepoCredentials,
    scratch: Path,
    author: tuple[str, str] = DEFAULT_AUTHOR,
    timeout_s: float = PUSH_TIMEOUT_S,
) -> PushResult:
    """Apply ``patches`` (``git am``, hooks off) on ``base_sha`` in a fresh clone in
    ``scratch`` and push the result to the *new* branch ``branch`` of ``repo_url``.

    Refused: a branch outside ``cogni/``, the remote's default branch, a branch that
    already exists (no force push, ever), and an empty ``patches``.
    """
    _check_url(repo_url, credentials)
    _check_branch(branch)
    _check_sha(base_sha)
    if not patches:
        raise RepoError("nothing to push: there are no patches (the run changed no file)")
    for index, patch in enumerate(patches, 1):
        if not patch.strip():
            raise RepoError(f"patch {index} of {len(patches)} is empty: nothing to apply")
    identity = _identity_env(author)
    ref = f"refs/heads/{branch}"
    default, refs = _ls_remote(repo_url, credentials, ["HEAD", ref], timeout_s)
    if branch == default:
        raise RepoError(
            f"refusing to push to {branch!r}: it is the remote's default branch; "
            "pick another cogni/ branch name"
        )
    if ref in refs:
        raise RepoError(
            f"branch {branch!r} already exists on the remote (at {refs[ref][:12]}); agent "
            "runs never force-push or add to an existing branch: pick a new branch name"
        )
    _require_commit(mirror, base_sha, timeout_s)
    _clone_at(mirror, base_sha, scratch, timeout_s, "scratch directory")
    repo = ["-C", str(scratch)]
    for index, patch in enumerate(patches, 1):
        what = f"applying patch {index} of {len(patches)} on {base_sha[:12]}"
        raw = patch.encode("utf-8", "surrogateescape")
        _git(
            [*repo, "am", "--quiet", "--no-gpg-sign", "--keep-cr"],
            what=what,
            timeout_s=timeout_s,
            stdin=raw,
            extra_env=identity,
        )
        # The commit must say exactly what the patch said: a message that git's mail
        # parser read as more patch (or a header) would show here as a difference.
        again = _git([*repo, *_FORMAT_PATCH, "HEAD"], what=what, timeout_s=timeout_s).stdout
        if _after_first_line(again) != _after_first_line(raw):
            raise RepoError(
                f"patch {index} of {len(patches)} does not come out of `git am` as it went "
                "in (its message or headers hold what git reads as patch); nothing was "
                "pushed. Patches must be as patch_from_tree makes them"
            )
    head = _git([*repo, "rev-parse", "HEAD"], what="reading the new head", timeout_s=timeout_s)
    # The empty lease means "the ref must not exist": creating the branch stays atomic
    # even if someone creates it between the check above and this push.
    target = [repo_url, f"HEAD:{ref}"]
    _git(
        [*repo, "push", "--quiet", "--no-verify", f"--force-with-lease={ref}:", "--", *target],
        what=f"pushing {branch!r} to {_scrub(repo_url, [])}",
        credentials=credentials,
        timeout_s=timeout_s,
    )
    return PushResult(branch=branch, head_sha=head.stdout.decode("ascii").strip())


# --- pull requests ------------------------------------------------------------------


class _NoRedirect(urllib.request.HTTPRedirectHandler):
    """A redirect becomes an error: the token must go to ``api_base`` and nowhere else."""

    def redirect_request(self, *args: object, **kwargs: object) -> None:
        return None


def _forge_message(raw: bytes, token: str) -> str:
    """The forge's own words: GitHub's ``{"message", "errors": [...]}``, else the text.

    Parsed under gatewayd's JSON discipline (gatewayd/strictjson.py): an answer nested
    deep enough to exhaust a parser, or of any other shape, is quoted, never a failure of
    its own."""
    try:
        doc = strictjson.loads(raw)
    except strictjson.JsonInputError:
        doc = None
    if not isinstance(doc, dict):
        return _scrub(_quoted(raw), [token]) or "no message"
    text = _shown(doc.get("message")) or "no message"
    errors = doc.get("errors")
    details = []
    for item in errors if isinstance(errors, list) else []:
        said = item.get("message") or item.get("code") or item if isinstance(item, dict) else item
        details.append(_shown(said))
    if details:
        text += " (" + "; ".join(details) + ")"
    return _scrub(text, [token])


def _shown(value: object) -> str:
    """A value of the forge's answer as a short line of text."""
    text = value if isinstance(value, str) else json.dumps(value)
    return " ".join(text.split())[:FORGE_QUOTE_CHARS]


def _quoted(raw: bytes) -> str:
    """The start of an answer that is not the JSON expected, as one line of text."""
    return " ".join(raw[: FORGE_QUOTE_CHARS * 4].decode("utf-8", "replace").split())[
        :FORGE_QUOTE_CHARS
    ]


def _pull_request_url(raw: bytes) -> tuple[str | None, str]:
    """The ``html_url`` of the forge's answer to a new pull request, or None and why not.

    Only an http(s) URL of printable ASCII, at most MAX_PR_URL_CHARS long, is one: it is
    shown to the operator and written to the audit log."""
    try:
        doc = strictjson.loads(raw)
    except strictjson.JsonInputError as exc:
        return None, f"it is not JSON gatewayd accepts ({exc})"
    url = doc.get("html_url") if isinstance(doc, dict) else None
    if not isinstance(url, str):
        return None, "it has no html_url"
    if len(url) > MAX_PR_URL_CHARS:
        return None, f"its html_url is {len(url)} characters long (at most {MAX_PR_URL_CHARS})"
    if not url.isascii() or not url.isprintable() or " " in url:
        return None, "its html_url holds characters a URL cannot"
    if urlsplit(url).scheme not in ("https", "http"):
        return None, "its html_url is not an http(s) URL"
    return url, ""


def open_pull_request(
    api_base: str,
    repository: str,
    *,
    source_branch: str,
    target_branch: str,
    title: str,
    body: str,
    token: str,
    timeout_s: float = PR_TIMEOUT_S,
) -> str:
    """Open a pull request (GitHub REST ``POST /repos/{owner}/{repo}/pulls``); its URL."""
    parts = urlsplit(api_base)
    if parts.scheme not in ("https", "http") or "@" in parts.netloc or not parts.hostname:
        raise RepoError(
            "the forge API base must be an https:// URL without credentials in it, "
            "e.g. https://api.github.com"
        )
    if parts.scheme == "http" and parts.hostname not in _LOOPBACK_HOSTS:
        raise RepoError(f"refusing to send the token over plain http to {parts.hostname}")
    if not _REPOSITORY_RE.fullmatch(repository):
        raise RepoError(f"repository {repository!r} is not of the form owner/name")
    if not token or _has_control(token):
        raise RepoError("the forge token is empty or contains control characters")
    if not title.strip():
        raise RepoError("the pull request title is empty")
    url = f"{api_base.rstrip('/')}/repos/{repository}/pulls"
    payload = {"title": title, "body": body, "head": source_branch, "base": target_branch}
    request = urllib.request.Request(  # noqa: S310 - scheme checked above: http(s) only
        url,
        data=json.dumps(payload).encode(),
        method="POST",
        headers={
            "Accept": "application/vnd.github+json",
            "Content-Type": "application/json",
            "User-Agent": "cogni-gatewayd",
        },
    )
    request.add_unredirected_header("Authorization", f"Bearer {token}")
    # No proxy from the environment and no redirects: the token goes to api_base only.
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}), _NoRedirect())
    where = f"{repository} at {api_base}"
    try:
        with opener.open(request, timeout=timeout_s) as response:
            raw = response.read(FORGE_RESPONSE_LIMIT)
    except urllib.error.HTTPError as exc:
        detail = _forge_message(_error_body(exc), token)
        raise RepoError(
            f"opening a pull request {source_branch} -> {target_branch} on {where} failed: "
            f"the forge answered {exc.code}: {detail}"
        ) from None
    except http.client.HTTPException as exc:  # an answer that is not HTTP, or cut short
        raise RepoError(
            f"the forge's answer to opening a pull request on {where} could not be read "
            f"({type(exc).__name__}: {_scrub(_quoted(str(exc).encode()), [token])}); the "
            "pull request may or may not exist: check the forge, and its API URL"
        ) from None
    except (urllib.error.URLError, OSError) as exc:
        reason = getattr(exc, "reason", exc)
        raise RepoError(
            f"could not reach the forge to open a pull request on {where}: "
            f"{_scrub(str(reason), [token])}; check the API URL and the network"
        ) from None
    html_url, why = _pull_request_url(raw)
    if html_url is None:
        raise RepoError(
            f"the forge's answer to opening a pull request on {where} is not a pull "
            f"request: {why}: {_scrub(_quoted(raw), [token]) or 'an empty answer'}"
        )
    return html_url


def _error_body(exc: urllib.error.HTTPError) -> bytes:
    """As much of an error answer's body as arrives; the status says enough without it."""
    try:
        return exc.read(FORGE_RESPONSE_LIMIT)
    except (http.client.HTTPException, OSError, ValueError):  # ValueError: a closed body
        return b""
