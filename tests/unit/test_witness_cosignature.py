"""Witness cosignatures (C2SP tlog-cosignature/v1, Ed25519): checked against the C2SP
specs' examples and the keys of an independent implementation
(github.com/transparency-dev/witness and transparency-dev/formats, Go), and by
flipping bytes in every part of a cosigned checkpoint."""

from __future__ import annotations

import base64
import hashlib

import pytest

from gatewayd.audit.cosignature import (
    ALG_COSIGNATURE_V1,
    CosignatureError,
    CosignatureVerifier,
    Cosigner,
    cosignature_timestamp,
    cosigned_message,
    generate_cosigner_key,
    open_witnessed,
)
from gatewayd.audit.note import NoteError, Signer, Verifier, generate_key, parse_note, sign_note


def generate_key_for(name: str) -> str:
    return generate_key(name)[0]


# --- the C2SP examples -------------------------------------------------------------------

# c2sp.org/tlog-cosignature, "Ed25519 signed message": the message, literally.
SPEC_MESSAGE = (
    b"cosignature/v1\n"
    b"time 1679315147\n"
    b"example.com/behind-the-sofa\n"
    b"20852163\n"
    b"CsUYapGGPo4dkMgIAUqom/Xajj7h2fB2MPA3j2jxq2I=\n"
)
SPEC_CHECKPOINT = (
    "example.com/behind-the-sofa\n20852163\nCsUYapGGPo4dkMgIAUqom/Xajj7h2fB2MPA3j2jxq2I=\n"
)
# Its example cosignature line (the witness's key is not published, so only its layout
# can be checked: key ID, then the timestamp of the message above, then 64 bytes).
SPEC_COSIGNATURE = (
    "\u2014 witness.example.com/w1 jWbPPwAAAABkGFDLEZMHwSRaJNiIDoe9DYn/zXcrtPHeolMI5OWXEhZ"
    "CB9dlrDJsX3b2oyin1nPZqhf5nNo0xUe+mbIUBkBIfZ+qnA==\n"
)
# c2sp.org/signed-note, "Verifier keys": an Ed25519 note key (type 0x01).
SPEC_NOTE_VKEY = "example.com/foo+530d903a+AekyeRrm56hApGFkyQR4ZCbV54Id2LKaANYcrnKv3U2k"

# --- github.com/transparency-dev/witness, witness/witness_test.go ----------------------
# A log ("monkeys") and a witness key, both plain Ed25519 note keys (type 0x01), which
# transparency-dev/formats' NewSignerForCosignatureV1 reads as cosignature keys.
TD_LOG_VKEY = "monkeys+db4d9f7e+AULaJMvTtDLHPUcUrjdDad9vDlh/PTfC2VV60JUtCfWT"
TD_WITNESS_SKEY = "PRIVATE+KEY+witness+f13a86db+AaLa/dfyBhyo/m0Z7WCi98ENVZWtrP8pxgRNrx7tIWiA"
TD_WITNESS_VKEY = "witness+f13a86db+AdYV1Ztajd9BvyjP2HgpwrqYL6TjOwIjGMOq8Bu42xbN"
# Another of its keys, whose base64 holds '+' (a key parser must cut at the first two).
TD_BANANAS_SKEY = "PRIVATE+KEY+bananas+cf639f13+AdjzytHoXdvn+1vG2UXXqFR3LZ+kvnmQZFretRaKfTIu"
TD_BANANAS_VKEY = "bananas+cf639f13+AaPjhFnPCQnid/Ql32KWhmh+uk72FVRfK+2DLmO3BI3M"
# The log's signed checkpoint of size 5 from the same file.
TD_INIT = (
    "monkeys\n5\n41smjBUiAU70EtKlT6lIOIYtRTYxYXsDB+XHfcvu/BE=\n\n"
    "\u2014 monkeys 202fftzGl3LVoqjXfwCFZZXs8I+5G22+Ek2K0AOyBuSJ/8/CZawNF+6fNlTKOCd622pbzJ"
    "NkkJFWuw9DbicZCkEx9AY=\n"
)


def test_the_signed_message_is_the_specs_example_byte_for_byte() -> None:
    assert cosigned_message(SPEC_CHECKPOINT, 1679315147) == SPEC_MESSAGE


def test_the_specs_example_cosignature_carries_the_examples_timestamp() -> None:
    _, [line] = parse_note(SPEC_CHECKPOINT + "\n" + SPEC_COSIGNATURE)
    assert line.name == "witness.example.com/w1"
    assert len(line.signature) == 8 + 64
    assert cosignature_timestamp(line) == 1679315147


def test_a_note_key_reads_as_a_cosignature_key_with_the_type_0x04_key_id() -> None:
    """As transparency-dev/formats' VKeyToCosignatureV1: the same name and public key,
    the key ID recomputed over type byte 0x04."""
    note_key = Verifier.from_string(SPEC_NOTE_VKEY)
    cosig = CosignatureVerifier.from_string(SPEC_NOTE_VKEY)
    raw = base64.b64decode("AekyeRrm56hApGFkyQR4ZCbV54Id2LKaANYcrnKv3U2k")[1:]
    expected = hashlib.sha256(b"example.com/foo\n\x04" + raw).digest()[:4]
    assert cosig.key_id == int.from_bytes(expected, "big") != note_key.key_id
    assert cosig.to_string().startswith(f"example.com/foo+{expected.hex()}+BO")
    # and back: the 0x04 string is read as itself
    assert CosignatureVerifier.from_string(cosig.to_string()) == cosig


@pytest.mark.parametrize(
    ("skey", "vkey"), [(TD_WITNESS_SKEY, TD_WITNESS_VKEY), (TD_BANANAS_SKEY, TD_BANANAS_VKEY)]
)
def test_an_independent_implementations_keys_sign_and_verify(skey: str, vkey: str) -> None:
    cosigner = Cosigner.from_string(skey)
    verifier = CosignatureVerifier.from_string(vkey)
    assert cosigner.verifier.to_string() == verifier.to_string()
    line = cosigner.cosign(SPEC_CHECKPOINT, 1679315147)
    # Ed25519 is deterministic: the signature is the key's over the spec's message.
    _, [parsed] = parse_note(SPEC_CHECKPOINT + "\n" + line)
    assert parsed.key_id == verifier.key_id
    verifier.public_key.verify(parsed.signature[8:], SPEC_MESSAGE)
    assert verifier.verify(SPEC_CHECKPOINT.encode(), parsed.signature)


def test_an_independent_logs_checkpoint_opens_with_its_cosignature() -> None:
    witness = Cosigner.from_string(TD_WITNESS_SKEY)
    text, _ = parse_note(TD_INIT)
    note = TD_INIT + witness.cosign(text, 1_700_000_000)
    opened = open_witnessed(
        note,
        [Verifier.from_string(TD_LOG_VKEY)],
        [CosignatureVerifier.from_string(TD_WITNESS_VKEY)],
    )
    assert opened.text == text
    assert opened.log_verified == ("monkeys",)
    assert opened.cosigned == {"witness": 1_700_000_000}


# --- keys ------------------------------------------------------------------------------


def test_generated_keys_round_trip_as_type_0x04() -> None:
    for number in range(20):  # enough that some base64 holds '+' and '/'
        skey, vkey = generate_cosigner_key(f"w.example/{number}")
        cosigner = Cosigner.from_string(skey)
        verifier = CosignatureVerifier.from_string(vkey)
        assert cosigner.to_string() == skey
        assert cosigner.verifier == verifier
        assert base64.b64decode(vkey.split("+", 2)[2])[0] == ALG_COSIGNATURE_V1
        assert "PRIVATE" not in repr(cosigner) and skey.split("+", 4)[4] not in repr(cosigner)


@pytest.mark.parametrize(
    ("vkey", "says"),
    [
        ("w.example", "expected NAME+KEYID+BASE64"),
        ("w.example+1234", "expected NAME+KEYID+BASE64"),
        ("w ex+12345678+AAAA", "holds a space or '+'"),
        ("+12345678+AAAA", "is empty"),
        ("w.example+1234567G+AAAA", "not 8 lowercase hex digits"),
        ("w.example+ABCDEF01+AAAA", "not 8 lowercase hex digits"),
        ("w.example+12345678+!!!!", "not base64"),
        ("w.example+12345678+AQID", "not an Ed25519 witness key"),
        ("w.example+12345678+" + base64.b64encode(b"\x02" + bytes(32)).decode(), "type byte"),
    ],
)
def test_a_malformed_verifier_key_is_refused_saying_what_is_wrong(vkey: str, says: str) -> None:
    with pytest.raises(CosignatureError, match="witness verifier key") as caught:
        CosignatureVerifier.from_string(vkey)
    assert says in str(caught.value)


def test_an_edited_verifier_key_is_refused_by_its_key_id() -> None:
    _, vkey = generate_cosigner_key("w.example/1")
    name, hex_id, material = vkey.split("+", 2)
    other = f"{int(hex_id, 16) ^ 1:08x}"
    with pytest.raises(CosignatureError, match="does not match its name and key"):
        CosignatureVerifier.from_string(f"{name}+{other}+{material}")
    with pytest.raises(CosignatureError, match="does not match"):
        CosignatureVerifier.from_string(f"w.example/2+{hex_id}+{material}")


@pytest.mark.parametrize(
    ("skey", "says"),
    [
        ("w.example+12345678+AAAA", "does not start with PRIVATE+KEY+"),
        ("PRIVATE+KEY+w.example+12345678", "expected NAME+KEYID+BASE64"),
        ("PRIVATE+KEY+w.example+12345678+AQID", "not an Ed25519 witness key"),
    ],
)
def test_a_malformed_signing_key_is_refused(skey: str, says: str) -> None:
    with pytest.raises(CosignatureError) as caught:
        Cosigner.from_string(skey)
    assert says in str(caught.value)


def test_a_signing_key_whose_id_does_not_match_is_refused_without_quoting_it() -> None:
    skey, _ = generate_cosigner_key("w.example/1")
    # The fields from the left: the key material is base64 and may itself hold '+'.
    private, key, name, key_id, material = skey.split("+", 4)
    assert key_id != "00000000"
    bad = "+".join((private, key, name, "00000000", material))
    with pytest.raises(CosignatureError, match="does not match") as caught:
        Cosigner.from_string(bad)
    assert material not in str(caught.value)


def test_a_zero_or_out_of_range_timestamp_is_refused() -> None:
    cosigner = Cosigner.from_string(generate_cosigner_key("w.example/1")[0])
    with pytest.raises(CosignatureError, match="non-zero timestamp"):
        cosigner.cosign(SPEC_CHECKPOINT, 0)
    with pytest.raises(CosignatureError, match="outside"):
        cosigned_message(SPEC_CHECKPOINT, 2**63)
    with pytest.raises(CosignatureError, match="origin, size and root hash"):
        cosigned_message("only\ntwo\n", 1)


# --- tampering: every byte of the cosigned checkpoint ------------------------------------


@pytest.fixture(scope="module")
def cosigned() -> tuple[str, Verifier, CosignatureVerifier]:
    log_signer = Signer.from_string(
        "PRIVATE+KEY+monkeys+db4d9f7e+ATWIAF3yVBG+Hv1rZFQoNt/BaURkLPtOFMAM2HrEeIr6"
    )
    witness = Cosigner.from_string(TD_WITNESS_SKEY)
    text = SPEC_CHECKPOINT.replace("example.com/behind-the-sofa", "monkeys")
    note = sign_note(text, [log_signer]) + witness.cosign(text, 1_700_000_123)
    return note, log_signer.verifier, witness.verifier


def test_the_cosigned_checkpoint_opens(cosigned: tuple[str, Verifier, CosignatureVerifier]) -> None:
    note, log_key, witness = cosigned
    assert open_witnessed(note, [log_key], [witness]).cosigned == {"witness": 1_700_000_123}


def test_flipping_any_byte_of_the_cosignature_fails_the_note(
    cosigned: tuple[str, Verifier, CosignatureVerifier],
) -> None:
    note, log_key, witness = cosigned
    head, line = note[: note.rindex("\u2014")], note[note.rindex("\u2014") :]
    _, [parsed] = parse_note("x\n\n" + line)
    raw = parsed.key_id.to_bytes(4, "big") + parsed.signature
    for index in range(4, len(raw)):  # the key ID's bytes make it another (unknown) key
        flipped = bytearray(raw)
        flipped[index] ^= 0x01
        tampered = head + f"\u2014 witness {base64.b64encode(bytes(flipped)).decode()}\n"
        with pytest.raises(NoteError, match="invalid signature for key witness"):
            open_witnessed(tampered, [log_key], [witness])


def test_flipping_the_key_id_makes_it_an_unknown_key_that_does_not_count(
    cosigned: tuple[str, Verifier, CosignatureVerifier],
) -> None:
    note, log_key, witness = cosigned
    head, line = note[: note.rindex("\u2014")], note[note.rindex("\u2014") :]
    _, [parsed] = parse_note("x\n\n" + line)
    raw = bytearray(parsed.key_id.to_bytes(4, "big") + parsed.signature)
    raw[0] ^= 0x01
    tampered = head + f"\u2014 witness {base64.b64encode(bytes(raw)).decode()}\n"
    assert open_witnessed(tampered, [log_key], [witness]).cosigned == {}


@pytest.mark.parametrize("line", [0, 1, 2])
def test_changing_the_checkpoint_fails_both_signatures(
    cosigned: tuple[str, Verifier, CosignatureVerifier], line: int
) -> None:
    note, log_key, witness = cosigned
    lines = note.split("\n")
    lines[line] = lines[line][:-2] + ("AA" if lines[line][-2:] != "AA" else "BB")
    with pytest.raises(NoteError, match="invalid signature"):
        open_witnessed("\n".join(lines), [log_key], [witness])
    # the witness's cosignature alone does not verify over the changed text either
    text, signatures = parse_note("\n".join(lines))
    assert not witness.verify(text.encode(), signatures[-1].signature)


def test_a_note_the_log_did_not_sign_is_refused_even_when_cosigned(
    cosigned: tuple[str, Verifier, CosignatureVerifier],
) -> None:
    note, _, witness = cosigned
    # Only the witness's key given: its cosignature verifies, but no log key signed.
    with pytest.raises(NoteError, match="not signed by the log's key"):
        open_witnessed(note, [], [witness])
    # Another log's key of the same name: its signature is unknown, so none verifies.
    with pytest.raises(NoteError, match="no signature by a known key"):
        open_witnessed(note, [Signer.from_string(generate_key_for("monkeys")).verifier], [])


def test_a_cosignature_of_the_wrong_length_does_not_verify(
    cosigned: tuple[str, Verifier, CosignatureVerifier],
) -> None:
    _, _, witness = cosigned
    assert not witness.verify(SPEC_CHECKPOINT.encode(), bytes(8 + 63))
    assert not witness.verify(b"\xff\xfe", bytes(8 + 64))


def test_a_witness_named_like_the_log_does_not_stand_in_for_the_logs_signature() -> None:
    """The log's key and a witness's key are told apart by key, not by name: a
    cosignature by a witness that shares the log key's name is no log signature."""
    log_signer = Signer.from_string(generate_key_for("monkeys"))
    witness = Cosigner.from_string(generate_cosigner_key("monkeys")[0])
    text = SPEC_CHECKPOINT.replace("example.com/behind-the-sofa", "monkeys")
    only_cosigned = text + "\n" + witness.cosign(text, 1_700_000_123)
    with pytest.raises(NoteError, match="not signed by the log's key"):
        open_witnessed(only_cosigned, [log_signer.verifier], [witness.verifier])
    both = sign_note(text, [log_signer]) + witness.cosign(text, 1_700_000_123)
    opened = open_witnessed(both, [log_signer.verifier], [witness.verifier])
    assert opened.log_verified == ("monkeys",)
    assert opened.cosigned == {"monkeys": 1_700_000_123}
