"""The audit tree's hashing and proofs against published vectors and an independent
implementation: Certificate Transparency's RFC 6962 test data (as carried by
github.com/transparency-dev/merkle, proof/verify_test.go), the corruption probes of
that suite, and pymerkle (an independent RFC 9162 tree) for roots and inclusion paths
at every size up to 70."""

from __future__ import annotations

import hashlib

import pytest
from pymerkle import InmemoryTree

from gatewayd.audit.merkle import (
    EMPTY_ROOT,
    MAX_PROOF_HASHES,
    Frontier,
    ProofError,
    consistency_proof,
    inclusion_proof,
    leaf_hash,
    leaves_source,
    node_hash,
    root_from_hashes,
    root_from_leaves,
    verify_consistency,
    verify_inclusion,
)

# CT's eight test leaves and the roots of the trees of their first 1..8.
LEAVES = [
    bytes.fromhex(h)
    for h in (
        "",
        "00",
        "10",
        "2021",
        "3031",
        "40414243",
        "5051525354555657",
        "606162636465666768696a6b6c6d6e6f",
    )
]
ROOTS = [
    bytes.fromhex(h)
    for h in (
        "6e340b9cffb37a989ca544e6bb780a2c78901d3fb33738768511a30617afa01d",
        "fac54203e7cc696cf0dfcb42c92a1d9dbaf70ad9e621f4bd8d98662f00e3c125",
        "aeb6bcfe274b70a14fb067a5e5578264db0fa9b51af5e0ba159158f329e06e77",
        "d37ee418976dd95753c1c73862b9398fa2a2cf9b4ff0fdfe8b30cd95209614b7",
        "4e3bbb1f7b478dcfe71fb631631519a3bca12c9aefca1612bfce4c13a86264d4",
        "76e67dadbcdf1e10e1b74ddc608abd2f98dfb16fbce75277b5232a127f2087ef",
        "ddb89be403809e325750d3d263cd78929c2942b7942a34b77e122c9594a74c8c",
        "5dc9da79a70659a9ad559cb701ded9a2ab9d823aad2f4960cfe370eff4604328",
    )
]


def h(text: str) -> bytes:
    return bytes.fromhex(text)


# (leaf, size, proof): the 1-based leaf of CT's suite.
INCLUSION_VECTORS = [
    (
        1,
        8,
        [
            h("96a296d224f285c67bee93c30f8a309157f0daa35dc5b87e410b78630a09cfc7"),
            h("5f083f0a1a33ca076a95279832580db3e0ef4584bdff1f54c8a360f50de3031e"),
            h("6b47aaf29ee3c2af9af889bc1fb9254dabd31177f16232dd6aab035ca39bf6e4"),
        ],
    ),
    (
        6,
        8,
        [
            h("bc1a0643b12e4d2d7c77918f44e0f4f79a838b6cf9ec5b5c283e1f4d88599e6b"),
            h("ca854ea128ed050b41b35ffc1b87b8eb2bde461e9e3b5596ece6b9d5975a0ae0"),
            h("d37ee418976dd95753c1c73862b9398fa2a2cf9b4ff0fdfe8b30cd95209614b7"),
        ],
    ),
    (3, 3, [h("fac54203e7cc696cf0dfcb42c92a1d9dbaf70ad9e621f4bd8d98662f00e3c125")]),
    (
        2,
        5,
        [
            h("6e340b9cffb37a989ca544e6bb780a2c78901d3fb33738768511a30617afa01d"),
            h("5f083f0a1a33ca076a95279832580db3e0ef4584bdff1f54c8a360f50de3031e"),
            h("bc1a0643b12e4d2d7c77918f44e0f4f79a838b6cf9ec5b5c283e1f4d88599e6b"),
        ],
    ),
]
CONSISTENCY_VECTORS = [
    (1, 1, []),
    (
        1,
        8,
        [
            h("96a296d224f285c67bee93c30f8a309157f0daa35dc5b87e410b78630a09cfc7"),
            h("5f083f0a1a33ca076a95279832580db3e0ef4584bdff1f54c8a360f50de3031e"),
            h("6b47aaf29ee3c2af9af889bc1fb9254dabd31177f16232dd6aab035ca39bf6e4"),
        ],
    ),
    (
        6,
        8,
        [
            h("0ebc5d3437fbe2db158b9f126a1d118e308181031d0a949f8dededebc558ef6a"),
            h("ca854ea128ed050b41b35ffc1b87b8eb2bde461e9e3b5596ece6b9d5975a0ae0"),
            h("d37ee418976dd95753c1c73862b9398fa2a2cf9b4ff0fdfe8b30cd95209614b7"),
        ],
    ),
    (
        2,
        5,
        [
            h("5f083f0a1a33ca076a95279832580db3e0ef4584bdff1f54c8a360f50de3031e"),
            h("bc1a0643b12e4d2d7c77918f44e0f4f79a838b6cf9ec5b5c283e1f4d88599e6b"),
        ],
    ),
    (
        6,
        7,
        [
            h("0ebc5d3437fbe2db158b9f126a1d118e308181031d0a949f8dededebc558ef6a"),
            h("b08693ec2e721597130641e8211e7eedccb4c26413963eee6c1e2ed16ffb1a5f"),
            h("d37ee418976dd95753c1c73862b9398fa2a2cf9b4ff0fdfe8b30cd95209614b7"),
        ],
    ),
]
SOME_HASH = h("abacaba000000000000000000000000000000000000000000060061e00123456")


def ct_source() -> tuple[list[bytes], object]:
    hashes = [leaf_hash(leaf) for leaf in LEAVES]
    return hashes, leaves_source(hashes)


def test_the_hash_prefixes_are_rfc_9162s() -> None:
    assert leaf_hash(b"x") == hashlib.sha256(b"\x00x").digest()
    assert node_hash(b"l", b"r") == hashlib.sha256(b"\x01lr").digest()
    assert EMPTY_ROOT.hex() == "e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855"
    assert root_from_leaves([]) == EMPTY_ROOT


@pytest.mark.parametrize("size", range(1, 9))
def test_roots_match_certificate_transparency(size: int) -> None:
    assert root_from_leaves(LEAVES[:size]) == ROOTS[size - 1]
    frontier = Frontier()
    for leaf in LEAVES[:size]:
        frontier.append(leaf_hash(leaf))
    assert frontier.root() == ROOTS[size - 1]
    rebuilt = Frontier.from_nodes(size, frontier.nodes())
    assert rebuilt.root() == ROOTS[size - 1]


@pytest.mark.parametrize(("leaf", "size", "proof"), INCLUSION_VECTORS)
def test_inclusion_proofs_match_certificate_transparency(
    leaf: int, size: int, proof: list[bytes]
) -> None:
    hashes = [leaf_hash(x) for x in LEAVES]
    assert inclusion_proof(leaf - 1, size, leaves_source(hashes)) == proof
    verify_inclusion(leaf - 1, size, hashes[leaf - 1], proof, ROOTS[size - 1])


@pytest.mark.parametrize(("old", "new", "proof"), CONSISTENCY_VECTORS)
def test_consistency_proofs_match_certificate_transparency(
    old: int, new: int, proof: list[bytes]
) -> None:
    hashes = [leaf_hash(x) for x in LEAVES]
    assert consistency_proof(old, new, leaves_source(hashes)) == proof
    verify_consistency(old, new, ROOTS[old - 1], ROOTS[new - 1], proof)


def _flip(value: bytes, bit: int) -> bytes:
    return bytes([value[0] ^ bit]) + value[1:]


@pytest.mark.parametrize(("leaf", "size", "proof"), INCLUSION_VECTORS)
def test_every_corrupted_inclusion_proof_fails(leaf: int, size: int, proof: list[bytes]) -> None:
    """CT's probes: wrong index or size, wrong leaf or root, garbage before or after,
    each hash with a bit flipped, a hash removed or inserted."""
    index, root = leaf - 1, ROOTS[size - 1]
    hashed = leaf_hash(LEAVES[index])
    probes: list[tuple[int, int, bytes, list[bytes], bytes]] = [
        (index - 1, size, hashed, proof, root),
        (index + 1, size, hashed, proof, root),
        (index ^ 2, size, hashed, proof, root),
        (index, size * 2, hashed, proof, root),
        (index, size // 2, hashed, proof, root),
        (index, size, hashlib.sha256(b"WrongLeaf").digest(), proof, root),
        (index, size, hashed, proof, EMPTY_ROOT),
        (index, size, hashed, proof, SOME_HASH),
        (index, size, hashed, [*proof, root], root),
        (index, size, hashed, [root, *proof], root),
    ]
    probes += [
        (index, size, hashed, [*proof[:i], _flip(p, 8), *proof[i + 1 :]], root)
        for i, p in enumerate(proof)
    ]
    probes.append((index, size, hashed, proof[:-1], root))
    if len(proof) > 1:
        probes.append((index, size, hashed, [proof[0], SOME_HASH, *proof[1:]], root))
    for probe in probes:
        with pytest.raises(ProofError):
            verify_inclusion(*probe)


@pytest.mark.parametrize(("old", "new", "proof"), CONSISTENCY_VECTORS[1:])
def test_every_corrupted_consistency_proof_fails(old: int, new: int, proof: list[bytes]) -> None:
    r1, r2 = ROOTS[old - 1], ROOTS[new - 1]
    probes: list[tuple[int, int, bytes, bytes, list[bytes]]] = [
        (old - 1, new, r1, r2, proof),
        (old + 1, new, r1, r2, proof),
        (old ^ 2, new, r1, r2, proof),
        (old, new * 2, r1, r2, proof),
        (old, new // 2, r1, r2, proof),
        (old, new, SOME_HASH, r2, proof),
        (old, new, r1, SOME_HASH, proof),
        (old, new, r2, r1, proof),
        (old, new, r1, r2, []),
        (old, new, r1, r2, [*proof, r1]),
        (old, new, r1, r2, [*proof, r2]),
        (old, new, r1, r2, [r1, *proof]),
        (old, new, r1, r2, [r2, *proof]),
        (old, new, r1, r2, [proof[0], *proof]),
        (old, new, r1, r2, proof[:-1]),
    ]
    probes += [
        (old, new, r1, r2, [*proof[:i], _flip(p, 16), *proof[i + 1 :]]) for i, p in enumerate(proof)
    ]
    for probe in probes:
        with pytest.raises(ProofError):
            verify_consistency(*probe)


def test_trivial_consistency_cases_follow_the_reference() -> None:
    verify_consistency(0, 0, SOME_HASH, SOME_HASH, [])
    verify_consistency(0, 5, SOME_HASH, ROOTS[4], [])  # the empty tree is everyone's prefix
    verify_consistency(3, 3, ROOTS[2], ROOTS[2], [])
    with pytest.raises(ProofError, match="different roots"):
        verify_consistency(3, 3, ROOTS[2], ROOTS[3], [])
    with pytest.raises(ProofError, match="never shrinks"):
        verify_consistency(2, 1, ROOTS[1], ROOTS[0], [])
    with pytest.raises(ProofError, match="must be empty"):
        verify_consistency(0, 1, EMPTY_ROOT, ROOTS[0], [EMPTY_ROOT])
    with pytest.raises(ProofError, match="is empty"):
        verify_consistency(1, 2, ROOTS[0], ROOTS[1], [])


def test_malformed_inputs_are_proof_errors_that_say_what() -> None:
    hashed = leaf_hash(b"x")
    with pytest.raises(ProofError, match="not in a tree of 0"):
        verify_inclusion(0, 0, hashed, [], hashed)
    with pytest.raises(ProofError, match="the leaf hash is 3 bytes"):
        verify_inclusion(0, 1, b"abc", [], hashed)
    with pytest.raises(ProofError, match="the root is 0 bytes"):
        verify_inclusion(0, 1, hashed, [], b"")
    with pytest.raises(ProofError, match="proof hash 1 is 31 bytes"):
        verify_inclusion(0, 4, hashed, [hashed, hashed[:31]], hashed)
    with pytest.raises(ProofError, match="more than any tree needs"):
        verify_inclusion(0, 4, hashed, [hashed] * (MAX_PROOF_HASHES + 1), hashed)
    with pytest.raises(ProofError, match="too long"):
        verify_inclusion(0, 1, hashed, [hashed], hashed)
    with pytest.raises(ProofError, match="too short"):
        verify_inclusion(0, 4, hashed, [hashed], hashed)
    with pytest.raises(ProofError, match=r"leads to root .* leaf, the proof or the root"):
        verify_inclusion(0, 2, hashed, [hashed], SOME_HASH)
    with pytest.raises(ValueError, match="leaf 3 is not in a tree of 3"):
        inclusion_proof(3, 3, leaves_source([hashed] * 3))
    with pytest.raises(ValueError, match="from size 4 to size 3"):
        consistency_proof(4, 3, leaves_source([hashed] * 4))


def test_a_single_leaf_tree_is_its_leaf() -> None:
    hashed = leaf_hash(b"data")
    assert root_from_hashes([hashed]) == hashed
    verify_inclusion(0, 1, hashed, [], hashed)
    with pytest.raises(ProofError):
        verify_inclusion(0, 1, hashed, [], EMPTY_ROOT)


@pytest.fixture(scope="module")
def pymerkle_tree() -> tuple[InmemoryTree, list[bytes]]:
    data = [f"entry {i}".encode() for i in range(70)]
    tree = InmemoryTree(algorithm="sha256")
    for item in data:
        tree.append_entry(item)
    return tree, data


def test_roots_and_inclusion_paths_match_pymerkle(
    pymerkle_tree: tuple[InmemoryTree, list[bytes]],
) -> None:
    """pymerkle is 1-based and puts the leaf itself first in its path."""
    tree, data = pymerkle_tree
    hashes = [leaf_hash(item) for item in data]
    source = leaves_source(hashes)
    for index, item in enumerate(data):
        assert tree.get_leaf(index + 1) == leaf_hash(item)
    for size in range(1, len(data) + 1):
        assert tree.get_root(size) == source(0, size) == root_from_leaves(data[:size])
        for index in range(size):
            ours = inclusion_proof(index, size, source)
            theirs = tree.prove_inclusion(index + 1, size).serialize()["path"][1:]
            assert [p.hex() for p in ours] == theirs
            verify_inclusion(index, size, hashes[index], ours, tree.get_root(size))


def test_our_consistency_proofs_verify_against_pymerkle_roots(
    pymerkle_tree: tuple[InmemoryTree, list[bytes]],
) -> None:
    """pymerkle's consistency proofs use a format of their own, so we check ours against
    its roots (and CT's vectors above check the format)."""
    tree, data = pymerkle_tree
    source = leaves_source([leaf_hash(item) for item in data])
    for new in range(1, len(data) + 1):
        for old in range(0, new + 1):
            proof = consistency_proof(old, new, source)
            old_root = tree.get_root(old) if old else EMPTY_ROOT
            verify_consistency(old, new, old_root, tree.get_root(new), proof)
            if 0 < old < new:
                with pytest.raises(ProofError):
                    verify_consistency(old, new, tree.get_root(new), tree.get_root(new), proof)
