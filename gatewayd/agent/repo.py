"""Host-side repository operations for agent runs.

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

This module runs git and keeps the mirror and the checkouts; the patch and the push
are :mod:`gatewayd.agent.patches`'s, the pull request :mod:`gatewayd.agent.forge`'s.
"""

from __future__ import annotations

import base64
import contextlib
import os
import re
import shutil
import signal
import subprocess
import tempfile
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Final
from urllib.parse import urlsplit

from gatewayd.errors import GatewayError
from gatewayd.protocol import ErrorCode

# Network operations on a large repository can take minutes; local ones should not.
FETCH_TIMEOUT_S: Final = 600.0
LOCAL_TIMEOUT_S: Final = 120.0
LS_REMOTE_TIMEOUT_S: Final = 60.0
# Enough of git's stderr to diagnose, short enough for an audit entry.
STDERR_LIMIT: Final = 2000
# Only system directories: git must not pick up helpers from an attacker-writable PATH.
SAFE_PATH: Final = "/usr/local/bin:/usr/bin:/bin"
# A full commit id (SHA-1 or SHA-256, lowercase hex): never a branch name or a prefix.
SHA_RE: Final = re.compile(r"[0-9a-f]{40}|[0-9a-f]{64}")
_URL_USERINFO_RE: Final = re.compile(r"(://)[^/\s@]*@")
# Plain http (and a token over it) only to a server on this host: a test forge.
LOOPBACK_HOSTS: Final = frozenset({"127.0.0.1", "::1", "localhost"})

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
        if has_control(self.token) or has_control(self.username) or ":" in self.username:
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


# --- running git --------------------------------------------------------------------


def has_control(text: str) -> bool:
    return any(ord(ch) < 0x20 or ord(ch) == 0x7F for ch in text)


def scrub(text: str, secrets: Iterable[str]) -> str:
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


def run_git(
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
        detail = scrub(err.decode("utf-8", "replace"), secrets)
        raise RepoError(
            f"{what} failed (git exit {proc.returncode}): {detail or 'no error output'}."
            + _hint(detail)
        )
    return subprocess.CompletedProcess(argv, proc.returncode, out, err)


# --- checks -------------------------------------------------------------------------


def check_url(repo_url: str, credentials: RepoCredentials | None) -> None:
    """Only http(s) and file URLs or absolute paths, never with userinfo."""
    if not repo_url or has_control(repo_url):
        raise RepoError("the repository URL is empty or contains control characters")
    if repo_url.startswith("-"):  # git would read it as an option
        raise RepoError(
            f"the repository URL {repo_url[:80]!r} starts with '-': give an https://, "
            "http:// or file:// URL or an absolute path"
        )
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
            f"the repository URL {scrub(repo_url, [])} carries credentials (user@ or "
            "user:password@): remove them from the URL and pass the token as "
            "RepoCredentials, which git sends as a header"
        )
    token = credentials.token if credentials else None
    if token and parts.scheme == "http" and parts.hostname not in LOOPBACK_HOSTS:
        raise RepoError(
            f"refusing to send the token over plain http to {parts.hostname}: use https"
        )


def check_sha(sha: str) -> None:
    if not SHA_RE.fullmatch(sha):
        raise RepoError(
            f"commit {sha!r} is not a full commit id: pass 40 (SHA-1) or 64 (SHA-256) "
            "lowercase hex digits, not a branch name or an abbreviation"
        )


def require_commit(mirror: Path, sha: str, timeout_s: float) -> None:
    check_sha(sha)
    found = run_git(
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


# --- the mirror and checkouts -------------------------------------------------------


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
    check_url(repo_url, credentials)
    if (mirror / "HEAD").is_file() and (mirror / "objects").is_dir():
        run_git(
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
            what=f"updating the mirror of {scrub(repo_url, [])}",
            credentials=credentials,
            timeout_s=timeout_s,
        )
        return
    _prepare_empty_dir(mirror, "mirror directory")
    try:
        run_git(
            [*_CLONE, "--bare", "--", repo_url, str(mirror)],
            what=f"cloning {scrub(repo_url, [])}",
            credentials=credentials,
            timeout_s=timeout_s,
        )
    except BaseException:
        shutil.rmtree(mirror, ignore_errors=True)
        raise


def clone_at(mirror: Path, sha: str, dest: Path, timeout_s: float, role: str) -> None:
    """A clone of ``mirror`` in ``dest``, detached at ``sha``, with no remote.

    ``--no-hardlinks``: a hard-linked object file would be shared with the mirror, and
    whoever writes ``dest`` could then change the mirror. ``--template=``: no sample
    hooks, no ``info/exclude``.
    """
    _prepare_empty_dir(dest, role)
    run_git(
        [*_CLONE, "--no-checkout", "--", str(mirror), str(dest)],
        what=f"cloning the mirror into the {role}",
        timeout_s=timeout_s,
    )
    run_git(
        ["-C", str(dest), "checkout", "--quiet", "--detach", sha],
        what=f"checking out {sha}",
        timeout_s=timeout_s,
    )
    run_git(
        ["-C", str(dest), "remote", "remove", "origin"],
        what="removing the mirror remote",
        timeout_s=timeout_s,
    )


def checkout_at(mirror: Path, sha: str, dest: Path, *, timeout_s: float = LOCAL_TIMEOUT_S) -> None:
    """The workspace base: ``dest`` becomes a clone of ``mirror`` detached at ``sha``.

    No remote is left and no credential is anywhere in it; after this, ``dest`` belongs
    to the sandbox and the host never runs git in it again.
    """
    check_sha(sha)
    require_commit(mirror, sha, timeout_s)
    clone_at(mirror, sha, dest, timeout_s, "workspace directory")


def default_branch(
    repo_url: str, *, credentials: RepoCredentials, timeout_s: float = LS_REMOTE_TIMEOUT_S
) -> str:
    """The branch the remote's HEAD points at (``git ls-remote --symref``)."""
    default, _ = ls_remote(repo_url, credentials, ["HEAD"], timeout_s)
    if default is None:
        raise RepoError(
            f"the remote {scrub(repo_url, [])} does not say which branch is its default "
            "(HEAD is not a symbolic ref: empty repository or very old server)"
        )
    return default


def ls_remote(
    repo_url: str, credentials: RepoCredentials, patterns: Sequence[str], timeout_s: float
) -> tuple[str | None, dict[str, str]]:
    """(default branch or None, {ref name: sha}) for ``patterns``."""
    check_url(repo_url, credentials)
    out = run_git(
        ["ls-remote", "--symref", "--", repo_url, *patterns],
        what=f"listing the branches of {scrub(repo_url, [])}",
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
