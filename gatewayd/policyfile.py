"""Reading a policy file: the file edge of :mod:`gatewayd.policy`, which parses text only.

A policy file is something someone else wrote, so it is read as any such input
(:mod:`gatewayd.inputfile`): a regular file (a FIFO or a device is refused without
blocking), at most :data:`MAX_POLICY_BYTES`, UTF-8. Every failure is a
:class:`~gatewayd.policy.PolicyError` naming the file.

:class:`PolicyLoader` finds the file a run's ``policy`` names: by name in the configured
policy directories, or (gatewayd's own command line, a live run's source) by path; it
keeps what it parsed (:class:`PolicyCache`), so an unchanged file is not parsed again
for every run.
"""

from __future__ import annotations

import os
import stat
import threading
import time
from pathlib import Path
from typing import Any, Final, NamedTuple

from gatewayd.inputfile import InputFileError, read_input_file
from gatewayd.policy.model import (
    POLICY_NAME_RE,
    Policy,
    PolicyError,
    parse_policy_text,
    validate_policy,
)

# A policy is a few hundred lines at most; refusing anything bigger stops a wrong
# path (a log, a binary) from being parsed and echoed back in error messages.
MAX_POLICY_BYTES: Final = 1 << 20
# A policy named by its name is the file ``<name>.yaml`` in a policy directory
# (policy.model's POLICY_NAME_RE: the characters of a policy's own ``name`` field).
POLICY_SUFFIX: Final = ".yaml"
# A name longer than this is shown cut in a refusal (it is no policy's name anyway).
MAX_SHOWN_NAME_CHARS: Final = 70
# Parsed policies kept, one per file path: a daemon's policy directories hold a few
# dozen; past this the oldest goes (a caller naming files by path cannot grow it).
MAX_CACHED_POLICIES: Final = 256
# A file changed this recently is parsed again at every use: two writes within one tick
# of the file system's clock (a few ms on ext4, 2 s on FAT) can leave the same size and
# times, which the cache's key cannot tell apart (git's "racily clean" entries). 2 s:
# the coarsest timestamp of a file system a policy directory may lie on.
RACY_WINDOW_NS: Final = 2_000_000_000


def load_policy(path: Path) -> Policy:
    """Read and validate the policy file at ``path``.

    Error handling: every failure (unreadable, not a regular file, too large, not
    UTF-8, bad YAML, invalid fields) is a :class:`PolicyError` whose source is
    ``str(path)``.
    """
    return validate_policy(read_policy_mapping(path), str(path))


def read_policy_mapping(path: Path) -> dict[str, Any]:
    """The policy file at ``path`` parsed, not yet validated: a regular file, size-capped,
    UTF-8, strict YAML (see :mod:`gatewayd.strictyaml`), a mapping at the top. For tools
    that edit a policy.

    Error handling: :class:`PolicyError` whose source is ``str(path)``.
    """
    source = str(path)
    try:
        data = read_input_file(path, max_bytes=MAX_POLICY_BYTES, what="the policy file")
    except InputFileError as exc:
        raise PolicyError(source, [str(exc)]) from None
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise PolicyError(
            source, [f"policy file is not UTF-8 text (bad byte at offset {exc.start})"]
        ) from None
    return parse_policy_text(text, source)


class FileStamp(NamedTuple):
    """What tells one version of a file from another without reading it: its identity,
    size, and modification and change times. The change time is set by the kernel at
    every write, chmod or utime, and no process can set it back, so an edit that keeps
    the size and restores the modification time (``touch -d``) still shows."""

    device: int
    inode: int
    size: int
    mtime_ns: int
    ctime_ns: int

    @classmethod
    def of(cls, path: Path) -> FileStamp | None:
        """The stamp of the regular file at ``path`` (followed), or None when it is
        not one or cannot be looked at (reading it then says why)."""
        try:
            st = os.stat(path)
        except OSError:
            return None
        if not stat.S_ISREG(st.st_mode):
            return None
        return cls(st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns)

    def settled(self, now_ns: int) -> bool:
        """Old enough that a later write must show in the stamp (:data:`RACY_WINDOW_NS`)."""
        return max(self.mtime_ns, self.ctime_ns) < now_ns - RACY_WINDOW_NS


class PolicyCache:
    """Parsed and validated policies by file path, each kept with the :class:`FileStamp`
    of the file it was read from: a use whose file has the same stamp gets the same
    (frozen) :class:`Policy` without reading the file; any other stamp reads it again.

    Not kept: a file changed within :data:`RACY_WINDOW_NS` of its reading (its stamp
    could miss a second write in the same clock tick), a file whose stamp changed while
    it was read, and a file that does not load (its error is raised every time). What
    the cache cannot see: a change that leaves the size and both times as they were, which
    takes setting the system clock back, or a file system whose times do not move on a
    write. Thread-safe (one lock around the table; files are read outside it).
    """

    def __init__(self, max_entries: int = MAX_CACHED_POLICIES) -> None:
        self._max = max_entries
        self._lock = threading.Lock()
        self._entries: dict[str, tuple[FileStamp, Policy]] = {}
        self.hits = 0
        self.misses = 0

    def load(self, path: Path) -> Policy:
        """:func:`load_policy` of ``path``, from the cache when its file is unchanged.

        Error handling: as :func:`load_policy`.
        """
        key = str(path)
        before = FileStamp.of(path)
        with self._lock:
            kept = self._entries.get(key)
            if kept is not None and before is not None and kept[0] == before:
                self.hits += 1
                return kept[1]
            self.misses += 1
        policy = load_policy(path)
        after = FileStamp.of(path)
        if before is not None and after == before and before.settled(time.time_ns()):
            with self._lock:
                self._entries.pop(key, None)
                self._entries[key] = (before, policy)
                while len(self._entries) > self._max:
                    del self._entries[next(iter(self._entries))]
        return policy


class PolicyLoader:
    """Turns a request's ``policy`` string into a loaded policy: (policy, source path).

    :meth:`by_name` looks a name up as ``<name>.yaml`` in the configured policy
    directories, in order, and nothing else: what a control-socket caller may ask for.
    Calling the loader also takes a path (anything with a ``/`` or a ``.yaml``/``.yml``
    suffix), for gatewayd's own command line and a live run's recorded source.
    """

    def __init__(self, search_dirs: tuple[Path, ...]) -> None:
        self.search_dirs = search_dirs
        # What it parsed, kept for the daemon's life: a run start reads no unchanged file.
        self.cache = PolicyCache()

    def by_name(self, name: str) -> tuple[Policy, str]:
        """The policy called ``name`` in the policy directories.

        Error handling: PolicyError for a string that is not a policy name (a path, a
        long string: nothing is looked up) or a name no directory holds.
        """
        if not POLICY_NAME_RE.fullmatch(name):
            shown = (
                repr(name)
                if len(name) <= MAX_SHOWN_NAME_CHARS
                else repr(name[:64]) + f"... ({len(name)} characters)"
            )
            raise PolicyError(
                "policy",
                [
                    f"{shown} is not a policy name: give the name of a policy in the "
                    f"policy directories ({self._where()}), 1-64 letters, digits and ._- "
                    "(e.g. 'demo'); a path is not accepted here"
                ],
            )
        for directory in self.search_dirs:
            path = directory / f"{name}{POLICY_SUFFIX}"
            if os.path.lexists(path):
                # The source is the file itself: what the audit names and a reload reads.
                return self.cache.load(path), os.path.realpath(path)
        hint = ""
        if name.endswith((".yaml", ".yml")):
            stem = name.rsplit(".", 1)[0]
            hint = f" (a policy's name is its file's name without the suffix: {stem!r})"
        raise PolicyError(name, [f"no policy named {name!r} in {self._where()}{hint}"])

    def __call__(self, ref: str) -> tuple[Policy, str]:
        if "/" in ref or ref.endswith((".yaml", ".yml")):
            path = Path(ref)
            return self.cache.load(path), str(path)
        return self.by_name(ref)

    def _where(self) -> str:
        return ", ".join(str(d) for d in self.search_dirs) or "(no policy directory configured)"
