"""A real git smart-HTTP server on 127.0.0.1 for tests: ``git http-backend`` run as a CGI
behind ``http.server``, with HTTP Basic auth on every request.

Usage::

    with GitServer(tmp_path / "served", token="t0k") as server:
        sha = make_bare_repo(server.root, "proj.git", {"README.md": b"hi\\n"})
        url = server.url_for("proj.git")      # http://127.0.0.1:<port>/proj.git
        ...
        assert all(r.auth_ok for r in server.requests)

or the ``git_server`` pytest fixture below (import it into a test module or conftest).
Any username is accepted; the password must equal ``token`` (``token=None``: no auth).
"""

from __future__ import annotations

import base64
import subprocess
import tempfile
import threading
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from types import TracebackType
from urllib.parse import urlsplit

import pytest

DEFAULT_TOKEN = "gitserver-test-token-5f3a9c"


@dataclass(frozen=True)
class SeenRequest:
    method: str
    path: str
    query: str
    auth_sent: bool  # an Authorization header was present
    auth_ok: bool  # ... and it carried the right token


def git_env(home: Path) -> dict[str, str]:
    """A clean environment for test-side git: no user or system config."""
    return {
        "PATH": "/usr/bin:/bin",
        "HOME": str(home),
        "GIT_CONFIG_NOSYSTEM": "1",
        "GIT_CONFIG_GLOBAL": "/dev/null",
        "GIT_AUTHOR_NAME": "test",
        "GIT_AUTHOR_EMAIL": "test@example.invalid",
        "GIT_COMMITTER_NAME": "test",
        "GIT_COMMITTER_EMAIL": "test@example.invalid",
        "LC_ALL": "C",
    }


def git(*args: str, cwd: Path | None = None, stdin: bytes | None = None) -> bytes:
    """Run test-side git (plain git, hooks and all); stdout, or an AssertionError."""
    with tempfile.TemporaryDirectory() as home:
        done = subprocess.run(
            ["git", *args],
            cwd=cwd,
            env=git_env(Path(home)),
            input=stdin,
            capture_output=True,
            timeout=60,
        )
    assert done.returncode == 0, f"git {args} failed: {done.stderr.decode()}"
    return done.stdout


def make_bare_repo(
    root: Path,
    name: str,
    files: Mapping[str, bytes],
    *,
    branch: str = "main",
    executable: frozenset[str] = frozenset(),
) -> str:
    """A bare repository ``root/name`` (push over HTTP enabled) whose ``branch`` (also
    its HEAD) has one commit with ``files``; returns that commit's sha."""
    bare = root / name
    git("init", "--quiet", "--bare", f"--initial-branch={branch}", str(bare))
    git("--git-dir", str(bare), "config", "http.receivepack", "true")
    return commit_files(bare, files, branch=branch, executable=executable)


def commit_files(
    bare: Path,
    files: Mapping[str, bytes],
    *,
    branch: str = "main",
    message: str = "test commit",
    executable: frozenset[str] = frozenset(),
) -> str:
    """Commit ``files`` (the whole tree) on top of ``branch`` in ``bare``; the new sha."""
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        git("init", "--quiet", f"--initial-branch={branch}", str(work))
        for rel, data in files.items():
            path = work / rel
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_bytes(data)
            path.chmod(0o755 if rel in executable else 0o644)
        git("add", "--all", cwd=work)
        parent = subprocess.run(
            ["git", "--git-dir", str(bare), "rev-parse", "--verify", "-q", branch],
            capture_output=True,
            env=git_env(work),
        ).stdout.strip()
        tree = git("write-tree", cwd=work).decode().strip()
        args = ["commit-tree", tree, "-m", message]
        if parent:
            git("fetch", "--quiet", str(bare), branch, cwd=work)  # commit-tree needs it
            args += ["-p", parent.decode()]
        sha = git(*args, cwd=work).decode().strip()
        git("push", "--quiet", str(bare), f"{sha}:refs/heads/{branch}", cwd=work)
    return sha


def read_tree(bare: Path, rev: str) -> dict[str, tuple[str, bytes]]:
    """``{path: (mode, content)}`` of every blob (and link) at ``rev`` in ``bare``."""
    listing = git("--git-dir", str(bare), "ls-tree", "-r", "-z", "--full-tree", rev)
    out: dict[str, tuple[str, bytes]] = {}
    for entry in filter(None, listing.split(b"\0")):
        meta, path = entry.split(b"\t", 1)
        mode, _kind, obj = meta.decode().split()
        out[path.decode()] = (mode, git("--git-dir", str(bare), "cat-file", "blob", obj))
    return out


def ref_sha(bare: Path, ref: str) -> str | None:
    done = subprocess.run(
        ["git", "--git-dir", str(bare), "rev-parse", "--verify", "-q", ref],
        capture_output=True,
        env=git_env(bare),
    )
    return done.stdout.decode().strip() or None


class GitServer:
    """``git http-backend`` over HTTP on 127.0.0.1, serving the bare repos in ``root``."""

    def __init__(self, root: Path, token: str | None = DEFAULT_TOKEN) -> None:
        self.root = root
        self.token = token
        self.requests: list[SeenRequest] = []
        self._lock = threading.Lock()
        root.mkdir(parents=True, exist_ok=True)
        self._httpd = ThreadingHTTPServer(("127.0.0.1", 0), self._handler_class())
        # A short poll interval: shutdown() waits up to one interval.
        self._thread = threading.Thread(
            target=self._httpd.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True
        )

    @property
    def base_url(self) -> str:
        host, port = self._httpd.server_address[:2]
        return f"http://{host!s}:{port}"

    def url_for(self, name: str) -> str:
        return f"{self.base_url}/{name}"

    def __enter__(self) -> GitServer:
        self._thread.start()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self._httpd.shutdown()
        self._httpd.server_close()
        self._thread.join(timeout=10)

    def _check_auth(self, header: str | None) -> bool:
        if self.token is None:
            return True
        if not header or not header.startswith("Basic "):
            return False
        try:
            decoded = base64.b64decode(header[len("Basic ") :], validate=True).decode()
        except ValueError:
            return False
        _user, _, password = decoded.partition(":")
        return password == self.token

    def _record(self, seen: SeenRequest) -> None:
        with self._lock:
            self.requests.append(seen)

    def _handler_class(self) -> type[BaseHTTPRequestHandler]:
        server = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, format: str, *args: object) -> None:
                pass  # keep pytest output clean

            def do_GET(self) -> None:
                self._serve()

            def do_POST(self) -> None:
                self._serve()

            def _body(self) -> bytes:
                if self.headers.get("Transfer-Encoding", "").lower() == "chunked":
                    chunks: list[bytes] = []
                    while True:
                        size = int(self.rfile.readline().split(b";")[0].strip(), 16)
                        if size == 0:
                            self.rfile.readline()
                            return b"".join(chunks)
                        chunks.append(self.rfile.read(size))
                        self.rfile.readline()
                return self.rfile.read(int(self.headers.get("Content-Length") or 0))

            def _serve(self) -> None:
                parts = urlsplit(self.path)
                header = self.headers.get("Authorization")
                ok = server._check_auth(header)
                server._record(
                    SeenRequest(self.command, parts.path, parts.query, header is not None, ok)
                )
                body = self._body() if self.command == "POST" else b""
                if not ok:
                    self.send_response(401)
                    self.send_header("WWW-Authenticate", 'Basic realm="gitserver"')
                    self.send_header("Content-Length", "0")
                    self.end_headers()
                    return
                with tempfile.TemporaryDirectory() as home:
                    env = git_env(Path(home)) | {
                        "GIT_PROJECT_ROOT": str(server.root),
                        "GIT_HTTP_EXPORT_ALL": "1",
                        "REQUEST_METHOD": self.command,
                        "PATH_INFO": parts.path,
                        "QUERY_STRING": parts.query,
                        "CONTENT_TYPE": self.headers.get("Content-Type", ""),
                        "CONTENT_LENGTH": str(len(body)),
                        "REMOTE_USER": "test",
                        "REMOTE_ADDR": "127.0.0.1",
                    }
                    if encoding := self.headers.get("Content-Encoding"):
                        env["HTTP_CONTENT_ENCODING"] = encoding
                    if protocol := self.headers.get("Git-Protocol"):
                        env["GIT_PROTOCOL"] = protocol
                    done = subprocess.run(
                        ["git", "http-backend"],
                        input=body,
                        env=env,
                        capture_output=True,
                        timeout=60,
                    )
                head, sep, payload = done.stdout.partition(b"\r\n\r\n")
                if not sep:
                    head, _, payload = done.stdout.partition(b"\n\n")
                status = 200
                headers: list[tuple[str, str]] = []
                for line in head.decode("latin-1").splitlines():
                    name, _, value = line.partition(":")
                    if name.lower() == "status":
                        status = int(value.split()[0])
                    elif name:
                        headers.append((name, value.strip()))
                self.send_response(status)
                for name, value in headers:
                    self.send_header(name, value)
                self.send_header("Content-Length", str(len(payload)))
                self.end_headers()
                self.wfile.write(payload)

        return Handler


@pytest.fixture
def git_server(tmp_path: Path) -> Iterator[GitServer]:
    """A running :class:`GitServer` serving ``tmp_path/served`` with ``DEFAULT_TOKEN``."""
    with GitServer(tmp_path / "served") as server:
        yield server


__all__ = [
    "DEFAULT_TOKEN",
    "GitServer",
    "SeenRequest",
    "commit_files",
    "git",
    "git_env",
    "git_server",
    "make_bare_repo",
    "read_tree",
    "ref_sha",
]
