"""The witness's decisions (C2SP tlog-witness add-checkpoint), its wire format and its
durable state, without HTTP: every status the spec names, each with its message; an
independent implementation's checkpoints and consistency proof
(github.com/transparency-dev/witness); the record across reopen, a torn write, a
corrupt or moved record, a second witness on the same directory; racing requests."""

from __future__ import annotations

import base64
import json
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from gatewayd.audit.checkpoint import Checkpoint
from gatewayd.audit.cosignature import CosignatureVerifier, Cosigner, generate_cosigner_key
from gatewayd.audit.merkle import (
    EMPTY_ROOT,
    consistency_proof,
    leaf_hash,
    leaves_source,
    root_from_hashes,
)
from gatewayd.audit.note import Signer, Verifier, generate_key, parse_note, sign_note
from gatewayd.audit.witness_wire import (
    MAX_PROOF_LINES,
    MAX_REQUEST_BYTES,
    SIZE_CONTENT_TYPE,
    BadRequest,
    format_add_checkpoint,
    format_size,
    parse_add_checkpoint,
    parse_size,
)
from gatewayd.witness.state import (
    EVIDENCE_DIR,
    LOGS_DIR,
    WitnessState,
    WitnessStateError,
    origin_hash,
)
from gatewayd.witness.witness import Witness

ORIGIN = "log.example/audit"

# --- github.com/transparency-dev/witness, witness/witness_test.go: a log's checkpoints of
# size 5 and 8 and the consistency proof between them (made by its Go implementation).
TD_LOG_VKEY = "monkeys+db4d9f7e+AULaJMvTtDLHPUcUrjdDad9vDlh/PTfC2VV60JUtCfWT"
TD_INIT = (
    "monkeys\n5\n41smjBUiAU70EtKlT6lIOIYtRTYxYXsDB+XHfcvu/BE=\n\n"
    "\u2014 monkeys 202fftzGl3LVoqjXfwCFZZXs8I+5G22+Ek2K0AOyBuSJ/8/CZawNF+6fNlTKOCd622pbzJ"
    "NkkJFWuw9DbicZCkEx9AY=\n"
)
TD_NEXT = (
    "monkeys\n8\nV8K9aklZ4EPB+RMOk1/8VsJUdFZR77GDtZUQq84vSbo=\n\n"
    "\u2014 monkeys 202ffoUEboiQYpHzICeaFmoy3RNviHTpAxYrq/eO4QQVQMvu9UebKBMX2MJC76NLthZaKs"
    "nKbCA8GxrjePZhvDCH7Ag=\n"
)
TD_PROOF = [
    bytes.fromhex(h)
    for h in (
        "b9e1d62618f7fee8034e4c5010f727ab24d8e4705cb296c374bf2025a87a10d2",
        "aac66cd7a79ce4012d80762fe8eec3a77f22d1ca4145c3f4cee022e7efcd599d",
        "89d0f753f66a290c483b39cd5e9eafb12021293395fad3d4a2ad053cfbcfdc9e",
        "29e40bb79c966f4c6fe96aff6f30acfce5f3e8d84c02215175d6e018a5dee833",
    )
]


class Log:
    """A log in memory: its leaves, and signed checkpoints and proofs of it."""

    def __init__(self, signer: Signer, entries: list[bytes] | None = None) -> None:
        self.signer = signer
        self.hashes = [leaf_hash(e) for e in entries or []]

    def append(self, *entries: bytes) -> Log:
        self.hashes += [leaf_hash(e) for e in entries]
        return self

    def note(self, size: int | None = None) -> str:
        size = len(self.hashes) if size is None else size
        root = root_from_hashes(self.hashes[:size])
        return sign_note(Checkpoint(self.signer.name, size, root).body(), [self.signer])

    def proof(self, old: int, new: int | None = None) -> list[bytes]:
        new = len(self.hashes) if new is None else new
        if old in (0, new):
            return []
        return consistency_proof(old, new, leaves_source(self.hashes))

    def request(self, old: int, size: int | None = None) -> bytes:
        size = len(self.hashes) if size is None else size
        return format_add_checkpoint(old, self.proof(old, size), self.note(size))


@pytest.fixture(scope="module")
def log_signer() -> Signer:
    return Signer.from_string(generate_key(ORIGIN)[0])


@pytest.fixture(scope="module")
def cosigner() -> Cosigner:
    return Cosigner.from_string(generate_cosigner_key("witness.example/w1")[0])


@pytest.fixture
def state(tmp_path: Path) -> Iterator[WitnessState]:
    opened = WitnessState.open(tmp_path / "witness")
    yield opened
    opened.close()


@pytest.fixture
def witness(state: WitnessState, cosigner: Cosigner, log_signer: Signer) -> Witness:
    logs = {ORIGIN: [log_signer.verifier], "monkeys": [Verifier.from_string(TD_LOG_VKEY)]}
    return Witness(cosigner=cosigner, logs=logs, state=state, clock=lambda: 1_700_000_000.5)


def _cosignature_verifies(cosigner: Cosigner, note: str, answer: bytes) -> bool:
    text, _ = parse_note(note)
    _, [line] = parse_note(text + "\n" + answer.decode())
    return cosigner.verifier.verify(text.encode(), line.signature)


# --- the wire format ---------------------------------------------------------------------


def test_a_request_round_trips() -> None:
    proof = [bytes([n]) * 32 for n in range(3)]
    parsed = parse_add_checkpoint(format_add_checkpoint(12, proof, "a\n1\nroot\n\n\u2014 x y\n"))
    assert (parsed.old_size, list(parsed.proof), parsed.note) == (
        12,
        proof,
        "a\n1\nroot\n\n\u2014 x y\n",
    )


def test_the_specs_example_request_parses() -> None:
    body = (
        "old 20852014\n"
        "PlRNCrwHpqhGrupue0L7gxbjbMiKA9temvuZZDDpkaw=\n"
        "jrJZDmY8Y7SyJE0MWLpLozkIVMSMZcD5kvuKxPC3swk=\n"
        "5+pKlUdi2LeF/BcMHBn+Ku6yhPGNCswZZD1X/6QgPd8=\n"
        "/6WVhPs2CwSsb5rYBH5cjHV/wSmA79abXAwhXw3Kj/0=\n"
        "\n"
        "example.com/behind-the-sofa\n20852163\nCsUYapGGPo4dkMgIAUqom/Xajj7h2fB2MPA3j2jxq2I=\n\n"
        "\u2014 example.com/behind-the-sofa Az3grlgtzPICa5OS8npVmf1Myq/5IZniMp+ZJurmRDeOoRDe4U"
        "RYN7u5/Zhcyv2q1gGzGku9nTo+zyWE+xeMcTOAYQ8=\n"
    ).encode()
    parsed = parse_add_checkpoint(body)
    assert parsed.old_size == 20852014 and len(parsed.proof) == 4
    assert parsed.note.startswith("example.com/behind-the-sofa\n20852163\n")


@pytest.mark.parametrize(
    ("body", "says"),
    [
        (b"old 5\nAAAA", "no empty line"),
        (b"old 05\n\nx", "'old N'"),
        (b"old -1\n\nx", "'old N'"),
        (b"new 5\n\nx", "'old N'"),
        (b"old 5 \n\nx", "'old N'"),
        (b"old 99999999999999999999\n\nx", "'old N'"),
        (b"old 5\nnot base64!\n\nx", "line 2 is not a base64 32-byte proof hash"),
        (b"old 5\n" + base64.b64encode(bytes(31)) + b"\n\nx", "line 2 is not a base64 32-byte"),
        (b"\xff\xfe\n\n", "not UTF-8"),
    ],
)
def test_a_malformed_request_is_refused_naming_the_line(body: bytes, says: str) -> None:
    with pytest.raises(BadRequest) as caught:
        parse_add_checkpoint(body)
    assert says in str(caught.value)


def test_at_most_63_proof_lines_and_a_bounded_body() -> None:
    line = base64.b64encode(bytes(32)).decode()
    ok = f"old 1\n{(line + chr(10)) * MAX_PROOF_LINES}\nx".encode()
    assert len(parse_add_checkpoint(ok).proof) == MAX_PROOF_LINES
    with pytest.raises(BadRequest, match="64 consistency proof lines, over 63"):
        parse_add_checkpoint(f"old 1\n{(line + chr(10)) * 64}\nx".encode())
    with pytest.raises(BadRequest, match=f"over {MAX_REQUEST_BYTES}"):
        parse_add_checkpoint(b"old 0\n\n" + b"x" * MAX_REQUEST_BYTES)


def test_the_conflict_body_is_a_size_line() -> None:
    assert parse_size(format_size(42)) == 42
    for bad in (b"42", b"042\n", b"x\n", b"1\n2\n"):
        with pytest.raises(ValueError, match="a size and a newline"):
            parse_size(bad)


# --- an independent implementation's log -------------------------------------------------


def test_the_independent_logs_checkpoints_are_cosigned_with_its_proof(
    witness: Witness, cosigner: Cosigner
) -> None:
    first = witness.add_checkpoint(format_add_checkpoint(0, [], TD_INIT))
    assert first.status == 200, first.body
    assert _cosignature_verifies(cosigner, TD_INIT, first.body)
    second = witness.add_checkpoint(format_add_checkpoint(5, TD_PROOF, TD_NEXT))
    assert second.status == 200, second.body
    assert _cosignature_verifies(cosigner, TD_NEXT, second.body)
    assert witness.state.latest("monkeys").size == 8  # type: ignore[union-attr]


def test_the_independent_logs_proof_with_one_hash_flipped_is_refused(witness: Witness) -> None:
    assert witness.add_checkpoint(format_add_checkpoint(0, [], TD_INIT)).status == 200
    for index in range(len(TD_PROOF)):
        proof = list(TD_PROOF)
        proof[index] = bytes([proof[index][0] ^ 1]) + proof[index][1:]
        answer = witness.add_checkpoint(format_add_checkpoint(5, proof, TD_NEXT))
        assert answer.status == 422, answer.body
        assert b"not consistent with the checkpoint of size 5" in answer.body
    assert witness.state.latest("monkeys").size == 5  # type: ignore[union-attr]


# --- every status --------------------------------------------------------------------------


def test_a_growing_log_is_cosigned_at_each_size(
    witness: Witness, log_signer: Signer, cosigner: Cosigner
) -> None:
    log = Log(log_signer)
    old = 0
    for count in (1, 1, 2, 5, 8, 1):
        log.append(*(f"entry {len(log.hashes) + n}".encode() for n in range(count)))
        answer = witness.add_checkpoint(log.request(old))
        assert answer.status == 200, answer.body
        assert answer.content_type.startswith("text/plain")
        assert answer.body.startswith(b"\xe2\x80\x94 witness.example/w1 ")
        assert _cosignature_verifies(cosigner, log.note(), answer.body)
        old = len(log.hashes)
    # the same checkpoint again: consistent with itself, cosigned again
    assert witness.add_checkpoint(log.request(old)).status == 200


def test_a_rewritten_history_is_refused_and_kept_as_evidence(
    witness: Witness, log_signer: Signer, state: WitnessState
) -> None:
    honest = Log(log_signer, [b"a", b"b", b"c"])
    assert witness.add_checkpoint(honest.request(0)).status == 200
    # Root rewrote entry 2 and re-signed with the log's key: a different tree of size 5.
    rewritten = Log(log_signer, [b"a", b"B", b"c", b"d", b"e"])
    proof = consistency_proof(3, 5, leaves_source(rewritten.hashes))
    answer = witness.add_checkpoint(format_add_checkpoint(3, proof, rewritten.note()))
    assert answer.status == 422
    assert b"not consistent with the checkpoint of size 3 this witness cosigned" in answer.body
    # the honest continuation's proof does not help the rewrite either
    honest_proof = Log(log_signer, [b"a", b"b", b"c", b"d", b"e"]).proof(3)
    assert (
        witness.add_checkpoint(format_add_checkpoint(3, honest_proof, rewritten.note())).status
        == 422
    )
    assert state.latest(ORIGIN).size == 3  # type: ignore[union-attr]
    evidence = sorted((state.directory / EVIDENCE_DIR).iterdir())
    assert len(evidence) == 2
    kept = evidence[0].read_bytes()
    assert (
        kept.startswith(b"# checkpoint of size 5 is not consistent")
        and rewritten.note().encode() in kept
    )


def test_a_rewrite_of_the_same_size_is_refused(
    witness: Witness, log_signer: Signer, state: WitnessState
) -> None:
    """C2SP tlog-witness: same size, another root: 409 Conflict, with a text body (a
    size body would make a client resend the same request for ever)."""
    assert witness.add_checkpoint(Log(log_signer, [b"a", b"b"]).request(0)).status == 200
    answer = witness.add_checkpoint(Log(log_signer, [b"a", b"X"]).request(2))
    assert answer.status == 409
    assert answer.content_type != SIZE_CONTENT_TYPE
    assert b"different roots" in answer.body
    assert b"the history was rewritten" in answer.body
    assert state.latest(ORIGIN).root == root_from_hashes(  # type: ignore[union-attr]
        [leaf_hash(b"a"), leaf_hash(b"b")]
    )
    assert len(list((state.directory / EVIDENCE_DIR).iterdir())) == 1


def test_an_older_checkpoint_is_refused(witness: Witness, log_signer: Signer) -> None:
    log = Log(log_signer, [b"a", b"b", b"c", b"d"])
    assert witness.add_checkpoint(log.request(0)).status == 200
    # replayed with the witness's own size: old > size
    older = witness.add_checkpoint(format_add_checkpoint(4, [], log.note(2)))
    assert older.status == 400
    assert b"old size 4 is larger than the checkpoint's size 2" in older.body
    # replayed with its own old size: the witness says where it is
    conflict = witness.add_checkpoint(log.request(0, 2))
    assert (conflict.status, conflict.content_type, conflict.body) == (
        409,
        SIZE_CONTENT_TYPE,
        b"4\n",
    )


def test_a_stale_old_size_gets_409_with_the_witnesses_size(
    witness: Witness, log_signer: Signer
) -> None:
    log = Log(log_signer, [b"a", b"b"])
    first = witness.add_checkpoint(log.request(1))  # the witness has never seen it: size 0
    assert (first.status, first.body) == (409, b"0\n")
    assert witness.add_checkpoint(log.request(0)).status == 200
    log.append(b"c")
    assert witness.add_checkpoint(log.request(1)).body == b"2\n"
    assert witness.add_checkpoint(log.request(2)).status == 200


def test_an_unknown_log_is_404(witness: Witness) -> None:
    stranger = Log(Signer.from_string(generate_key("other.example/log")[0]), [b"a"])
    answer = witness.add_checkpoint(stranger.request(0))
    assert answer.status == 404
    assert b"unknown log 'other.example/log'" in answer.body


def test_a_checkpoint_not_signed_by_the_logs_key_is_403(witness: Witness) -> None:
    impostor = Log(Signer.from_string(generate_key(ORIGIN)[0]), [b"a"])  # same name, other key
    answer = witness.add_checkpoint(impostor.request(0))
    assert answer.status == 403
    assert b"no signature by a known key" in answer.body


def test_a_forged_signature_by_the_logs_key_is_403(witness: Witness, log_signer: Signer) -> None:
    note = Log(log_signer, [b"a"]).note()
    text, _ = parse_note(note)
    forged = note.replace(text, text.replace("\n1\n", "\n2\n"))
    answer = witness.add_checkpoint(format_add_checkpoint(0, [], forged))
    assert answer.status == 403
    assert b"invalid signature for key" in answer.body


@pytest.mark.parametrize(
    ("note", "says"),
    [
        ("no blank line\n", b"the checkpoint is malformed"),
        ("log.example/audit\nnot a size\nroot\n\n\u2014 x AAAAAAAA\n", b"tree size"),
    ],
)
def test_a_malformed_checkpoint_is_400(witness: Witness, note: str, says: bytes) -> None:
    answer = witness.add_checkpoint(format_add_checkpoint(0, [], note))
    assert answer.status == 400
    assert says in answer.body


def test_size_zero_must_have_the_empty_root_and_old_zero_no_proof(
    witness: Witness, log_signer: Signer
) -> None:
    empty = sign_note(Checkpoint(ORIGIN, 0, EMPTY_ROOT).body(), [log_signer])
    assert witness.add_checkpoint(format_add_checkpoint(0, [], empty)).status == 200
    wrong = sign_note(Checkpoint(ORIGIN, 0, bytes(32)).body(), [log_signer])
    answer = witness.add_checkpoint(format_add_checkpoint(0, [], wrong))
    assert (answer.status, answer.body) == (
        422,
        b"a checkpoint of size 0 must have the empty tree's root\n",
    )
    log = Log(log_signer, [b"a", b"b"])
    answer = witness.add_checkpoint(format_add_checkpoint(0, [bytes(32)], log.note()))
    assert (answer.status, answer.body) == (
        422,
        b"from old size 0 the consistency proof must be empty\n",
    )


def test_only_the_logs_own_signature_is_recorded_and_served(
    witness: Witness, log_signer: Signer, cosigner: Cosigner
) -> None:
    log = Log(log_signer, [b"a"])
    other = Cosigner.from_string(generate_cosigner_key("other.example/w")[0])
    text, _ = parse_note(log.note())
    stuffed = log.note() + other.cosign(text, 5)
    assert witness.add_checkpoint(format_add_checkpoint(0, [], stuffed)).status == 200
    served = witness.checkpoint(origin_hash(ORIGIN))
    assert served.status == 200
    _, lines = parse_note(served.body.decode())
    assert [line.name for line in lines] == [ORIGIN, "witness.example/w1"]
    assert witness.checkpoint("0" * 64).status == 404


# --- durable state ---------------------------------------------------------------------------


def test_the_record_survives_reopen(tmp_path: Path, cosigner: Cosigner, log_signer: Signer) -> None:
    directory = tmp_path / "w"
    log = Log(log_signer, [b"a", b"b", b"c"])
    state = WitnessState.open(directory)
    Witness(cosigner=cosigner, logs={ORIGIN: [log_signer.verifier]}, state=state).add_checkpoint(
        log.request(0)
    )
    state.close()
    reopened = WitnessState.open(directory)
    try:
        record = reopened.latest(ORIGIN)
        assert record is not None and (record.size, record.root) == (
            3,
            root_from_hashes(log.hashes),
        )
        assert (directory / LOGS_DIR / origin_hash(ORIGIN)).stat().st_mode & 0o777 == 0o600
        assert directory.stat().st_mode & 0o777 == 0o700
    finally:
        reopened.close()


def test_a_second_witness_on_the_same_directory_is_refused(state: WitnessState) -> None:
    with pytest.raises(WitnessStateError, match="in use by another witness"):
        WitnessState.open(state.directory)


def test_a_torn_write_leaves_the_old_record(
    tmp_path: Path, cosigner: Cosigner, log_signer: Signer
) -> None:
    directory = tmp_path / "w"
    state = WitnessState.open(directory)
    Witness(cosigner=cosigner, logs={ORIGIN: [log_signer.verifier]}, state=state).add_checkpoint(
        Log(log_signer, [b"a"]).request(0)
    )
    state.close()
    torn = directory / LOGS_DIR / ".tmp-abc123"
    torn.write_bytes(b'{"version": 1, "origin": "log.ex')  # a kill -9 mid-write
    reopened = WitnessState.open(directory)
    try:
        assert reopened.latest(ORIGIN).size == 1  # type: ignore[union-attr]
        assert not torn.exists()
    finally:
        reopened.close()


@pytest.mark.parametrize(
    "damage",
    [
        lambda data: data[: len(data) // 2],
        lambda data: data.replace(b'"size": 2', b'"size": 1'),
        lambda data: data.replace(b'"version": 1', b'"version": 9'),
        lambda data: b"[]",
    ],
)
def test_a_damaged_record_refuses_the_start(
    tmp_path: Path, cosigner: Cosigner, log_signer: Signer, damage: object
) -> None:
    directory = tmp_path / "w"
    state = WitnessState.open(directory)
    Witness(cosigner=cosigner, logs={ORIGIN: [log_signer.verifier]}, state=state).add_checkpoint(
        Log(log_signer, [b"a", b"b"]).request(0)
    )
    state.close()
    record = directory / LOGS_DIR / origin_hash(ORIGIN)
    record.write_bytes(damage(record.read_bytes()))  # type: ignore[operator]
    with pytest.raises(WitnessStateError, match="refusing to start rather than forget") as caught:
        WitnessState.open(directory)
    assert str(record) in str(caught.value)


def test_a_record_moved_to_another_logs_name_refuses_the_start(
    tmp_path: Path, cosigner: Cosigner, log_signer: Signer
) -> None:
    directory = tmp_path / "w"
    state = WitnessState.open(directory)
    Witness(cosigner=cosigner, logs={ORIGIN: [log_signer.verifier]}, state=state).add_checkpoint(
        Log(log_signer, [b"a"]).request(0)
    )
    state.close()
    record = directory / LOGS_DIR / origin_hash(ORIGIN)
    record.rename(directory / LOGS_DIR / origin_hash("another/log"))
    with pytest.raises(WitnessStateError, match="moved or copied by hand"):
        WitnessState.open(directory)


def test_a_failed_write_answers_500_and_keeps_the_record(
    witness: Witness, log_signer: Signer, monkeypatch: pytest.MonkeyPatch
) -> None:
    log = Log(log_signer, [b"a"])
    assert witness.add_checkpoint(log.request(0)).status == 200
    log.append(b"b")

    def full(*_args: object) -> None:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr("gatewayd.witness.state._write_atomically", full)
    answer = witness.add_checkpoint(log.request(1))
    assert answer.status == 500
    assert witness.state.latest(ORIGIN).size == 1  # type: ignore[union-attr]


def test_racing_requests_never_roll_the_record_back(witness: Witness, log_signer: Signer) -> None:
    """The spec's race: two requests checked against the same old size must not both
    be cosigned, or the record goes back. Every request is old=0 here: exactly one is
    cosigned, the rest get 409 with that one's size."""
    log = Log(log_signer, [f"e{n}".encode() for n in range(16)])
    bodies = [log.request(0, size) for size in range(1, 17)]
    answers: list[int] = []
    threads = [
        threading.Thread(target=lambda b=body: answers.append(witness.add_checkpoint(b).status))
        for body in bodies
    ]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert sorted(answers) == [200] + [409] * 15
    record = witness.state.latest(ORIGIN)
    assert record is not None
    on_disk = json.loads((witness.state.directory / LOGS_DIR / origin_hash(ORIGIN)).read_bytes())
    assert on_disk["size"] == record.size


def test_the_verifier_key_the_witness_prints_checks_its_cosignatures(
    witness: Witness, cosigner: Cosigner, log_signer: Signer
) -> None:
    log = Log(log_signer, [b"a"])
    answer = witness.add_checkpoint(log.request(0))
    vkey = CosignatureVerifier.from_string(cosigner.verifier.to_string())
    text, _ = parse_note(log.note())
    _, [line] = parse_note(text + "\n" + answer.body.decode())
    assert vkey.verify(text.encode(), line.signature)
    assert int.from_bytes(line.signature[:8], "big") == 1_700_000_000


def test_evidence_that_cannot_be_kept_still_refuses(
    witness: Witness, log_signer: Signer, monkeypatch: pytest.MonkeyPatch
) -> None:
    assert witness.add_checkpoint(Log(log_signer, [b"a", b"b"]).request(0)).status == 200
    rewritten = Log(log_signer, [b"a", b"X", b"c"])
    # the cap reached: nothing more is kept
    monkeypatch.setattr("gatewayd.witness.state.MAX_EVIDENCE_FILES", 0)
    assert witness.add_checkpoint(rewritten.request(2)).status == 422
    assert list((witness.state.directory / EVIDENCE_DIR).iterdir()) == []
    # the disk full: the refusal stands
    monkeypatch.setattr("gatewayd.witness.state.MAX_EVIDENCE_FILES", 10)

    def full(*_args: object) -> None:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr("gatewayd.witness.state._write_atomically", full)
    assert witness.add_checkpoint(rewritten.request(2)).status == 422
    assert witness.state.latest(ORIGIN).size == 2  # type: ignore[union-attr]
