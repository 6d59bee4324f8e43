"""The audit log's Merkle tree (RFC 9162, section 2.1): hashing, proofs, their checks.

Every entry of the log is a leaf, in seq order (leaf index = seq - 1), and a leaf's data
is the entry's line exactly as written, without its newline. Hashing is RFC 9162's
(the same as RFC 6962's, so Certificate Transparency's test data applies):

- leaf: ``SHA-256(0x00 || data)``; interior node: ``SHA-256(0x01 || left || right)``;
- the tree of ``n`` leaves splits at ``k``, the largest power of two below ``n``; the
  empty tree's hash is ``SHA-256("")``.

This module is pure (no I/O): the functions that build a proof take a *node source*,
``subtree(start, end) -> MTH(D[start:end])``, which the durable store
(:mod:`gatewayd.audit.treestore`) answers from disk and :func:`leaves_source` from a
list in memory. The checks (:func:`verify_inclusion`, :func:`verify_consistency`) are
RFC 9162's algorithms 2.1.3.2 and 2.1.4.2 and raise :class:`ProofError` saying what
failed.

We write this ourselves (about a hundred lines) instead of using a package: the tree
must be appended to incrementally inside the audit writer and read from our own
on-disk node store, which no maintained Python package offers; ``pymerkle`` (an
independent implementation) checks ours in the tests, and so do CT's published
vectors.
"""

from __future__ import annotations

import hashlib
import hmac
from collections.abc import Callable, Sequence
from typing import Final

HASH_SIZE: Final = 32
LEAF_PREFIX: Final = b"\x00"
NODE_PREFIX: Final = b"\x01"
EMPTY_ROOT: Final = hashlib.sha256(b"").digest()

# A proof never holds more hashes than the tree has levels; 64 covers any size an int
# of the log can reach (2**64 entries), and bounds the work a forged proof can cause.
MAX_PROOF_HASHES: Final = 64

#: MTH(D[start:end]) for 0 <= start < end <= size.
SubtreeSource = Callable[[int, int], bytes]


class ProofError(ValueError):
    """A proof does not prove what it claims; the message says which check failed."""


def leaf_hash(data: bytes) -> bytes:
    """The hash of one leaf: ``SHA-256(0x00 || data)``."""
    return hashlib.sha256(LEAF_PREFIX + data).digest()


def node_hash(left: bytes, right: bytes) -> bytes:
    """The hash of an interior node: ``SHA-256(0x01 || left || right)``."""
    return hashlib.sha256(NODE_PREFIX + left + right).digest()


def split_point(size: int) -> int:
    """The largest power of two strictly below ``size`` (``size`` >= 2)."""
    return 1 << ((size - 1).bit_length() - 1)


def root_from_hashes(hashes: Sequence[bytes]) -> bytes:
    """The root of the tree whose leaf hashes are ``hashes`` (``EMPTY_ROOT`` if none)."""
    if not hashes:
        return EMPTY_ROOT
    frontier = Frontier()
    for one in hashes:
        frontier.append(one)
    return frontier.root()


def root_from_leaves(leaves: Sequence[bytes]) -> bytes:
    """The root of the tree over the leaf *data* ``leaves`` (each hashed as a leaf)."""
    return root_from_hashes([leaf_hash(leaf) for leaf in leaves])


class Frontier:
    """The right edge of a growing tree: the roots of its perfect subtrees, largest
    first (a "compact range" over ``[0, size)``). Appending costs one leaf's worth of
    hashing on average; the root is a fold over at most 64 hashes.

    ``on_node(level, index, hash)`` (optional) is told every node a leaf completes,
    leaf included (level 0), so a store can keep them.
    """

    __slots__ = ("_hashes", "_levels", "size")

    def __init__(self) -> None:
        self._levels: list[int] = []
        self._hashes: list[bytes] = []
        self.size = 0

    @classmethod
    def from_nodes(cls, size: int, nodes: Sequence[bytes]) -> Frontier:
        """The frontier of a tree of ``size`` leaves from its perfect subtrees' roots,
        largest first (one per set bit of ``size``)."""
        levels = [bit for bit in range(size.bit_length() - 1, -1, -1) if size >> bit & 1]
        if len(levels) != len(nodes):
            raise ValueError(f"a tree of {size} leaves has {len(levels)} frontier nodes")
        frontier = cls()
        frontier._levels = levels
        frontier._hashes = list(nodes)
        frontier.size = size
        return frontier

    def append(
        self, hashed_leaf: bytes, on_node: Callable[[int, int, bytes], None] | None = None
    ) -> None:
        """Add one leaf (its hash), merging the perfect subtrees it completes."""
        index = self.size
        current, level = hashed_leaf, 0
        if on_node is not None:
            on_node(0, index, current)
        while self._levels and self._levels[-1] == level:
            self._levels.pop()
            current = node_hash(self._hashes.pop(), current)
            level += 1
            if on_node is not None:
                on_node(level, index >> level, current)
        self._levels.append(level)
        self._hashes.append(current)
        self.size += 1

    def root(self) -> bytes:
        """The tree's root hash."""
        if not self._hashes:
            return EMPTY_ROOT
        current = self._hashes[-1]
        for left in reversed(self._hashes[:-1]):
            current = node_hash(left, current)
        return current

    def nodes(self) -> list[bytes]:
        """The perfect subtrees' roots, largest first."""
        return list(self._hashes)


def leaves_source(hashes: Sequence[bytes]) -> SubtreeSource:
    """A node source over leaf hashes held in memory (tests, small trees)."""

    def subtree(start: int, end: int) -> bytes:
        if end - start == 1:
            return hashes[start]
        k = split_point(end - start)
        return node_hash(subtree(start, start + k), subtree(start + k, end))

    return subtree


# -- building proofs (RFC 9162 2.1.3.1 and 2.1.4.1) -------------------------------


def inclusion_proof(index: int, size: int, subtree: SubtreeSource) -> list[bytes]:
    """The inclusion proof of leaf ``index`` in the tree of ``size`` leaves, leaf first.

    Error handling: ValueError when ``index`` is not a leaf of that tree.
    """
    if not 0 <= index < size:
        raise ValueError(f"leaf {index} is not in a tree of {size} leaves")
    proof: list[bytes] = []
    start, end = 0, size
    # Walk down from the root; the sibling at each level is the proof's hash for it,
    # so collect top-down and return bottom-up.
    while end - start > 1:
        k = split_point(end - start)
        if index < start + k:
            proof.append(subtree(start + k, end))
            end = start + k
        else:
            proof.append(subtree(start, start + k))
            start += k
    proof.reverse()
    return proof


def consistency_proof(old_size: int, new_size: int, subtree: SubtreeSource) -> list[bytes]:
    """The consistency proof from the tree of ``old_size`` leaves to ``new_size``.

    Empty when ``old_size`` is 0 or equals ``new_size`` (nothing to prove).

    Error handling: ValueError when ``old_size`` is negative or beyond ``new_size``.
    """
    if not 0 <= old_size <= new_size:
        raise ValueError(f"no consistency proof from size {old_size} to size {new_size}")
    if old_size in (0, new_size):
        return []
    proof: list[bytes] = []
    m, start, end, whole = old_size, 0, new_size, True
    while m != end - start:
        k = split_point(end - start)
        if m <= k:
            proof.append(subtree(start + k, end))
            end = start + k
        else:
            proof.append(subtree(start, start + k))
            m -= k
            start += k
            whole = False
    if not whole:
        proof.append(subtree(start, end))
    proof.reverse()
    return proof


# -- checking proofs (RFC 9162 2.1.3.2 and 2.1.4.2) ------------------------------


def _check_hash(what: str, value: bytes) -> None:
    if len(value) != HASH_SIZE:
        raise ProofError(f"{what} is {len(value)} bytes, not a {HASH_SIZE}-byte SHA-256 hash")


def _check_proof(proof: Sequence[bytes]) -> None:
    if len(proof) > MAX_PROOF_HASHES:
        raise ProofError(f"the proof has {len(proof)} hashes, more than any tree needs")
    for number, one in enumerate(proof):
        _check_hash(f"proof hash {number}", one)


def root_from_inclusion(index: int, size: int, hashed_leaf: bytes, proof: Sequence[bytes]) -> bytes:
    """The root an inclusion proof leads to (RFC 9162 2.1.3.2, up to the comparison).

    Error handling: ProofError when the proof cannot be one for that leaf and size.
    """
    if not 0 <= index < size:
        raise ProofError(f"leaf index {index} is not in a tree of {size} leaves")
    _check_hash("the leaf hash", hashed_leaf)
    _check_proof(proof)
    fn, sn, current = index, size - 1, hashed_leaf
    for one in proof:
        if sn == 0:
            raise ProofError(
                f"the inclusion proof is too long: {len(proof)} hashes for leaf {index} of {size}"
            )
        if fn & 1 or fn == sn:
            current = node_hash(one, current)
            while not fn & 1 and fn != 0:
                fn >>= 1
                sn >>= 1
        else:
            current = node_hash(current, one)
        fn >>= 1
        sn >>= 1
    if sn != 0:
        raise ProofError(
            f"the inclusion proof is too short: {len(proof)} hashes for leaf {index} of {size}"
        )
    return current


def verify_inclusion(
    index: int, size: int, hashed_leaf: bytes, proof: Sequence[bytes], root: bytes
) -> None:
    """Check that the leaf with hash ``hashed_leaf`` is leaf ``index`` of the tree of
    ``size`` leaves whose root is ``root``.

    Error handling: ProofError naming what failed (the sizes, or the root reached).
    """
    _check_hash("the root", root)
    reached = root_from_inclusion(index, size, hashed_leaf, proof)
    if not hmac.compare_digest(reached, root):
        raise ProofError(
            f"the inclusion proof of leaf {index} leads to root {reached.hex()}, not "
            f"{root.hex()} (the tree of size {size}): the leaf, the proof or the root "
            "was altered"
        )


def verify_consistency(
    old_size: int, new_size: int, old_root: bytes, new_root: bytes, proof: Sequence[bytes]
) -> None:
    """Check that the tree of ``old_size`` leaves with root ``old_root`` is a prefix of
    the tree of ``new_size`` leaves with root ``new_root``.

    A tree of size 0 is a prefix of every tree (its proof is empty); two trees of the
    same size are consistent only if their roots are equal (and the proof empty).

    Error handling: ProofError naming what failed.
    """
    _check_hash("the old root", old_root)
    _check_hash("the new root", new_root)
    _check_proof(proof)
    if not 0 <= old_size <= new_size:
        raise ProofError(
            f"size {old_size} cannot be a prefix of size {new_size}: a log never shrinks"
        )
    if old_size in (0, new_size):
        if proof:
            raise ProofError(
                f"a consistency proof from size {old_size} to {new_size} must be empty, "
                f"this one has {len(proof)} hashes"
            )
        if old_size == new_size and not hmac.compare_digest(old_root, new_root):
            raise ProofError(
                f"two trees of size {new_size} with different roots ({old_root.hex()} and "
                f"{new_root.hex()}): the history was rewritten"
            )
        return
    if not proof:
        raise ProofError(f"the consistency proof from size {old_size} to {new_size} is empty")
    path = list(proof)
    if old_size & (old_size - 1) == 0:  # a power of two: the old root is a node itself
        path.insert(0, old_root)
    fn, sn = old_size - 1, new_size - 1
    while fn & 1:
        fn >>= 1
        sn >>= 1
    first = path[0]
    old_reached, new_reached = first, first
    for one in path[1:]:
        if sn == 0:
            raise ProofError(
                f"the consistency proof from size {old_size} to {new_size} is too long"
            )
        if fn & 1 or fn == sn:
            old_reached = node_hash(one, old_reached)
            new_reached = node_hash(one, new_reached)
            while not fn & 1 and fn != 0:
                fn >>= 1
                sn >>= 1
        else:
            new_reached = node_hash(new_reached, one)
        fn >>= 1
        sn >>= 1
    if sn != 0:
        raise ProofError(f"the consistency proof from size {old_size} to {new_size} is too short")
    if not hmac.compare_digest(old_reached, old_root):
        raise ProofError(
            f"the consistency proof does not lead to the old root {old_root.hex()} (size "
            f"{old_size}): the tree of size {new_size} does not extend it, or the proof "
            "was altered"
        )
    if not hmac.compare_digest(new_reached, new_root):
        raise ProofError(
            f"the consistency proof does not lead to the new root {new_root.hex()} (size "
            f"{new_size}): the history before size {old_size} was rewritten, or the proof "
            "was altered"
        )
