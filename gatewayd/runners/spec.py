"""A tool folder's tool, as the runners see it: pure data, made from a validated manifest.

An operator's tool lives in ``<tool dir>/<name>/manifest.json`` (or ``manifest.yaml``)
beside its entry (a ``.wasm`` module, or a program). :mod:`gatewayd.runners.manifest`
turns the file's data into a :class:`FolderTool`; the wasm and process runners run its
calls; :mod:`gatewayd.runners.rights` works out, per call, the intersection of what it
declares and what the calling run grants.

Paths here are as the sandbox sees them (``/workspace/src``): a manifest names
workspace-relative paths (``src``, ``.``), and the manifest reader maps them beneath
:data:`~gatewayd.policy.paths.WORKSPACE_VISIBLE_ROOT`.
"""

from __future__ import annotations

from typing import Final

import msgspec

from gatewayd.policy.paths import PathMode
from gatewayd.tools.manifest import RunnerKind, ToolManifest

# The runner kinds a tool folder may name (``runtime`` in its manifest).
FOLDER_RUNNERS: Final = (RunnerKind.WASM, RunnerKind.PROCESS)


class FileNeed(msgspec.Struct, frozen=True, kw_only=True):
    """A path the tool works on: read (``ro``) or read and write (``rw``)."""

    path: str  # as the sandbox sees it: /workspace or beneath it, normalized
    mode: PathMode
    optional: bool = False  # True: the call runs without it when the run lacks it


class NameNeed(msgspec.Struct, frozen=True, kw_only=True):
    """A network domain, a model alias or an environment variable the tool uses."""

    name: str
    optional: bool = False


class FolderTool(msgspec.Struct, frozen=True, kw_only=True):
    """One tool of a tool folder, validated.

    ``manifest`` is what dispatch and ``tools.list`` see: its ``capabilities`` declare
    every need below (optional or not), so nothing beyond them can ever be granted.
    ``entry``: for a wasm tool, the module's absolute host path (inside ``folder``);
    for a process tool, the argv run inside the sandbox, where the folder is mounted
    read-only at :data:`TOOL_MOUNT`.
    """

    manifest: ToolManifest
    folder: str  # absolute host path of the tool's folder
    manifest_path: str  # absolute host path of the manifest file read
    entry: tuple[str, ...]
    files: tuple[FileNeed, ...] = ()
    network: tuple[NameNeed, ...] = ()
    models: tuple[NameNeed, ...] = ()
    env: tuple[NameNeed, ...] = ()
    # sha256 of the manifest file's bytes and of the entry module (wasm) or "" (process),
    # as "sha256:<hex>": shown by `gatewayd tools show`, recorded in each call's audit
    # entry, so a reviewer knows which build ran.
    manifest_digest: str = ""
    entry_digest: str = ""

    @property
    def name(self) -> str:
        return self.manifest.name

    @property
    def runner(self) -> RunnerKind:
        return self.manifest.runner


# Where a process tool's own folder is mounted, read-only, in its sandbox.
TOOL_MOUNT: Final = "/tool"
