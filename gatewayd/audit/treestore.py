"""The durable store of the audit log's Merkle tree nodes, beside the log.

``<log>.tree/`` holds one file per tree level, ``level-00`` (the leaf hashes, one per
entry in seq order), ``level-01`` (the hashes of each aligned pair), and so on: file
``level-L`` holds, 32 bytes each, the roots of the perfect subtrees of ``2**L`` leaves
that are complete, left to right. About two hashes per entry (64 MiB at a million
entries). Any subtree a proof needs is then one read (an aligned perfect subtree) or
a fold of at most ~64 reads (the tree's right edge), so a proof costs O(log² n) reads
of 32 bytes, well under a millisecond at a million entries, instead of rehashing the
log.

The tree is *derived* data: everything in it can be recomputed from the log, and the
log stays the record. So it is written after the log (the flusher appends a batch's
leaves once the batch is fdatasync'd) and synced only before a checkpoint commits to
it (:meth:`TreeStore.sync`). A crash can leave it behind the log, or with a torn
record at a file's end, or with upper levels ahead of the leaves: :meth:`open_tree`
cuts each file to what the leaves below support, recomputes what is missing, and the
writer then appends the entries the log holds beyond it (:func:`chain_lines`).

Writing order within a batch: the upper levels first, the leaves last, so another
process that reads the store while it grows (``gatewayd audit prove``) and takes its
size from the leaves finds every node that size needs; a node not written yet is
computed from the level below.

Resource handling: a TreeStore owns one descriptor per level file; ``close()``
releases them. Methods are thread-safe (one lock): the flusher thread appends while
the checkpointer (another thread) reads proofs.

Error handling: :class:`TreeError` for a store that cannot be used (the log is
partial and the store does not cover it, a store ahead of its log, a leaf that does
not match the log's entry); OSError from the files passes through.
"""

from __future__ import annotations

import os
import re
import threading
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Final

from gatewayd.audit.line import (
    GENESIS_HASH,
    HASH_SUFFIX_BYTES,
    LineFormatError,
    body_hash,
    hashes_equal,
    unseal,
)
from gatewayd.audit.merkle import (
    EMPTY_ROOT,
    HASH_SIZE,
    Frontier,
    consistency_proof,
    inclusion_proof,
    leaf_hash,
    node_hash,
    split_point,
)
from gatewayd.audit.query import read_log
from gatewayd.audit.segments import log_files
from gatewayd.files import fsync_dir

DIR_MODE: Final = 0o700
FILE_MODE: Final = 0o600
# 2**64 leaves is more than a log can hold; bounds the number of level files.
MAX_LEVELS: Final = 64
# How many leaf hashes a rebuild hashes before writing them out: bounds its memory
# (32 bytes each, about 2 MiB per level) without a write per entry.
REBUILD_BATCH: Final = 1 << 16

_SEQ_PREFIX: Final = re.compile(rb'\{"seq":([1-9][0-9]{0,18}),')


class TreeError(Exception):
    """The tree store cannot be used as it is; the message says why and what to do."""


def tree_dir(log_path: Path) -> Path:
    """The node store of the log whose active file is ``log_path``."""
    return log_path.with_name(log_path.name + ".tree")


def _level_name(level: int) -> str:
    return f"level-{level:02d}"


def chain_lines(log_path: Path, first_seq: int) -> Iterator[tuple[int, bytes]]:
    """The log's entries from seq ``first_seq`` on, as ``(seq, line without newline)``.

    Only lines that continue the chain count (their hash matches their bytes, their
    seq is the next one and their ``prev`` the previous entry's hash): the torn bytes a
    crash left, which the log keeps, are no entries and no leaves. Reading starts at
    the segment that holds ``first_seq``; lines before ``first_seq - 1`` are only
    glanced at (their seq), not hashed.
    """
    expected: int | None = None
    previous = GENESIS_HASH
    if not log_files(log_path):
        return  # no log yet: no entries
    for record in read_log(log_path, since_seq=first_seq):
        raw = record.raw
        match = _SEQ_PREFIX.match(raw)
        if match is None:
            continue
        seq = int(match[1])
        if seq < first_seq - 1:
            continue  # before what is asked: neither a leaf nor the link to one
        try:
            body, claimed = unseal(raw)
        except LineFormatError:
            continue
        if not hashes_equal(body_hash(body), claimed):
            continue
        prev = body[-(HASH_SUFFIX_BYTES - 9) : -2].decode("ascii", "replace")
        if expected is not None and (seq != expected or not hashes_equal(prev, previous)):
            continue
        expected, previous = seq + 1, claimed
        if seq >= first_seq:
            yield seq, raw


class TreeStore:
    """An open node store: see the module docstring. Made by :func:`open_tree`."""

    def __init__(self, directory: Path, *, writable: bool) -> None:
        self.directory = directory
        self._writable = writable
        self._lock = threading.Lock()
        self._fds: list[int] = []
        self._frontier = Frontier()
        # Why open_tree emptied and rebuilt the store, for the daemon log; None if not.
        self.rebuilt_because: str | None = None

    # -- opening ----------------------------------------------------------------------

    def _open_level(self, level: int) -> int | None:
        path = self.directory / _level_name(level)
        flags = os.O_CLOEXEC | os.O_NOFOLLOW
        if self._writable:
            flags |= os.O_RDWR | os.O_APPEND | os.O_CREAT
        else:
            flags |= os.O_RDONLY
        try:
            return os.open(path, flags, FILE_MODE)
        except FileNotFoundError:
            if self._writable:
                raise
            return None

    def _load(self) -> None:
        """Open the level files, cut what the leaves do not support, fill what is missing."""
        leaves_fd = self._open_level(0)
        if leaves_fd is None:
            return
        self._fds.append(leaves_fd)
        size = os.fstat(leaves_fd).st_size // HASH_SIZE
        if self._writable:
            os.ftruncate(leaves_fd, size * HASH_SIZE)  # a torn record at the end
            # Levels the leaves do not reach yet may hold nodes of a longer tree (the
            # leaves were cut, or rebuilt): empty them, or appends would land after them.
            for level in range((size >> 1).bit_length() + 1, MAX_LEVELS):
                stale = self.directory / _level_name(level)
                if stale.exists():
                    os.truncate(stale, 0)
        level = 1
        while size >> level and level < MAX_LEVELS:
            fd = self._open_level(level)
            if fd is None:  # read-only and missing: computed from below when asked
                break
            self._fds.append(fd)
            want = size >> level
            have = os.fstat(fd).st_size // HASH_SIZE
            if self._writable and have != want:
                os.ftruncate(fd, min(have, want) * HASH_SIZE)
                if have < want:
                    parents = bytearray()
                    for index in range(have, want):
                        parents += node_hash(
                            self._read(level - 1, 2 * index), self._read(level - 1, 2 * index + 1)
                        )
                    os.write(fd, parents)
            level += 1
        nodes: list[bytes] = []
        offset = 0
        for bit in range(size.bit_length() - 1, -1, -1):
            if size >> bit & 1:
                nodes.append(self._node(bit, offset >> bit))
                offset += 1 << bit
        self._frontier = Frontier.from_nodes(size, nodes)

    # -- reading ----------------------------------------------------------------------

    def _read(self, level: int, index: int) -> bytes:
        data = os.pread(self._fds[level], HASH_SIZE, index * HASH_SIZE)
        if len(data) != HASH_SIZE:
            raise TreeError(f"{self.directory}: node {index} of level {level} is missing")
        return data

    def _node(self, level: int, index: int) -> bytes:
        """The root of the perfect subtree of ``2**level`` leaves starting at leaf
        ``index << level``: read, or computed from the level below when that level's
        file does not hold it (yet)."""
        if level < len(self._fds):
            data = os.pread(self._fds[level], HASH_SIZE, index * HASH_SIZE)
            if len(data) == HASH_SIZE:
                return data
        if level == 0:
            raise TreeError(f"{self.directory}: leaf {index} is not in the store")
        return node_hash(self._node(level - 1, 2 * index), self._node(level - 1, 2 * index + 1))

    def _subtree(self, start: int, end: int) -> bytes:
        """MTH(D[start:end]) of a range a proof asks for (``start`` is aligned)."""
        width = end - start
        if width & (width - 1) == 0 and start % width == 0:
            return self._node(width.bit_length() - 1, start // width)
        k = split_point(width)
        return node_hash(self._subtree(start, start + k), self._subtree(start + k, end))

    @property
    def size(self) -> int:
        """The number of leaves (entries) the store holds."""
        return self._frontier.size

    def root(self) -> bytes:
        """The root of the whole tree as stored."""
        with self._lock:
            return self._frontier.root()

    def head(self) -> tuple[int, bytes]:
        """``(size, root)`` taken together."""
        with self._lock:
            return self._frontier.size, self._frontier.root()

    def _check_size(self, size: int) -> None:
        if not 0 <= size <= self._frontier.size:
            raise ValueError(
                f"the tree holds {self._frontier.size} entries, so it has no state of size {size}"
            )

    def root_at(self, size: int) -> bytes:
        """The root of the tree of the first ``size`` leaves.

        Error handling: ValueError for a size the store does not hold.
        """
        with self._lock:
            self._check_size(size)
            return self._subtree(0, size) if size else EMPTY_ROOT

    def leaf(self, index: int) -> bytes:
        """The hash of leaf ``index`` (the entry of seq ``index + 1``)."""
        with self._lock:
            self._check_size(index + 1)
            return self._node(0, index)

    def leaves(self, start: int, end: int) -> list[bytes]:
        """The leaf hashes ``start`` to ``end`` (exclusive), read in one go."""
        with self._lock:
            self._check_size(end)
            data = os.pread(self._fds[0], (end - start) * HASH_SIZE, start * HASH_SIZE)
        return [data[i : i + HASH_SIZE] for i in range(0, len(data), HASH_SIZE)]

    def inclusion_proof(self, index: int, size: int) -> list[bytes]:
        """The inclusion proof of leaf ``index`` in the tree of ``size`` leaves."""
        with self._lock:
            self._check_size(size)
            return inclusion_proof(index, size, self._subtree)

    def consistency_proof(self, old_size: int, new_size: int) -> list[bytes]:
        """The consistency proof from size ``old_size`` to ``new_size``."""
        with self._lock:
            self._check_size(new_size)
            return consistency_proof(old_size, new_size, self._subtree)

    # -- writing ----------------------------------------------------------------------

    def append(self, hashes: Sequence[bytes]) -> None:
        """Add leaves (their hashes) and every node they complete: the upper levels
        are written before the leaves (see the module docstring).

        Error handling: OSError from writing passes through; the in-memory tree is
        then ahead of the files, so the caller must stop using the store (the next
        open recovers it from the log).
        """
        if not hashes:
            return
        if not self._writable:
            raise TreeError(f"{self.directory} is open read-only")
        with self._lock:
            written: list[bytearray] = [bytearray() for _ in range(MAX_LEVELS)]

            def keep(level: int, _index: int, value: bytes) -> None:
                written[level] += value

            for one in hashes:
                self._frontier.append(one, keep)
            for level in range(MAX_LEVELS - 1, -1, -1):
                if written[level]:
                    while level >= len(self._fds):
                        fd = self._open_level(len(self._fds))
                        if fd is None:  # pragma: no cover - writable opens create
                            raise TreeError(f"{self.directory}: cannot open level {level}")
                        self._fds.append(fd)
                    _write_all(self._fds[level], bytes(written[level]))

    def sync(self) -> None:
        """Make every node written so far durable (before a checkpoint commits to them)."""
        with self._lock:
            for fd in self._fds:
                os.fsync(fd)

    def close(self) -> None:
        with self._lock:
            for fd in self._fds:
                os.close(fd)
            self._fds.clear()


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view) :]


def open_tree(log_path: Path, *, last_seq: int | None = None, writable: bool = True) -> TreeStore:
    """Open the node store of ``log_path`` and bring it up to the log's entry
    ``last_seq`` (None: every entry the log holds), reading what it lacks from the log.

    A store whose last leaf differs from the log's entry at that seq, or that holds
    more entries than the log, is rebuilt from the log's first entry: the store is
    derived, the log is the record. ``writable=False`` (readers such as ``audit
    prove`` while the daemon runs) changes nothing on disk: entries the store lacks
    are not added, and a missing store is an empty tree.

    Error handling: TreeError when the store must be (re)built but the log no longer
    starts at seq 1 (older segments deleted); OSError passes through.
    """
    directory = tree_dir(log_path)
    if writable:
        try:
            directory.mkdir(mode=DIR_MODE)
            fsync_dir(directory.parent)
        except FileExistsError:
            pass
        if directory.is_symlink() or not directory.is_dir():
            raise TreeError(f"{directory} is not a directory")
    store = TreeStore(directory, writable=writable)
    try:
        store._load()
        if not writable:
            return store
        if last_seq is not None and store.size > last_seq:
            _rebuild(store, f"it holds {store.size} entries, the log {last_seq}")
        elif store.size:
            lines = chain_lines(log_path, store.size)
            first = next(lines, None)
            if (
                first is None
                or first[0] != store.size
                or leaf_hash(first[1]) != store.leaf(store.size - 1)
            ):
                _rebuild(store, f"its last leaf is not the log's entry of seq {store.size}")
        _catch_up(store, log_path, last_seq)
    except BaseException:
        store.close()
        raise
    return store


def _catch_up(store: TreeStore, log_path: Path, last_seq: int | None) -> None:
    batch: list[bytes] = []
    for seq, line in chain_lines(log_path, store.size + 1):
        if last_seq is not None and seq > last_seq:
            break
        if seq != store.size + len(batch) + 1:
            raise TreeError(
                f"the log starts at seq {seq}, but its tree needs every entry from seq "
                f"{store.size + len(batch) + 1}: older segments were deleted before the "
                "tree was built"
            )
        batch.append(leaf_hash(line))
        if len(batch) >= REBUILD_BATCH:
            store.append(batch)
            batch = []
    store.append(batch)


def _rebuild(store: TreeStore, why: str) -> None:
    """Empty the store (it does not match the log: ``why``), to be rebuilt from seq 1."""
    with store._lock:
        for fd in store._fds:
            os.ftruncate(fd, 0)
        store._frontier = Frontier()
    store.rebuilt_because = why
