"""Signed notes and checkpoints against the published examples: the C2SP signed-note
and tlog-checkpoint specs' examples, and Go's golang.org/x/mod/sumdb/note test
vectors (note_test.go), byte for byte."""

from __future__ import annotations

import base64

import pytest

from gatewayd.audit.checkpoint import Checkpoint, CheckpointError, parse_checkpoint
from gatewayd.audit.note import (
    MAX_SIGNATURES,
    NoteError,
    Signer,
    Verifier,
    generate_key,
    key_id,
    open_note,
    parse_note,
    sign_note,
)

# golang.org/x/mod/sumdb/note, note_test.go
GO_SKEY = "PRIVATE+KEY+PeterNeumann+c74f20a3+AYEKFALVFGyNhPJEMzD1QIDr+Y7hfZx09iUvxdXHKDFz"
GO_VKEY = "PeterNeumann+c74f20a3+ARpc2QcUPDhMQegwxbzhKqiBfsVkmqq/LDE4izWy10TW"
ENOCH_VKEY = "EnochRoot+af0cfe78+ATtqJ7zOtqQtYqOo0CpvDXNlMhV3HeJDpjrASKGLWdop"
GO_TEXT = (
    "If you think cryptography is the answer to your problem,\n"
    "then you don't know what your problem is.\n"
)
PETER_SIG = "— PeterNeumann x08go/ZJkuBS9UG/SffcvIAQxVBtiFupLLr8pAcElZInNIuGUgYN1FFYC2pZSNXgKvqfqdngotpRZb6KE6RyyBwJnAM=\n"
ENOCH_SIG = "— EnochRoot rwz+eBzmZa0SO3NbfRGzPCpDckykFXSdeX+MNtCOXm2/5n2tiOHp+vAF1aGrQ5ovTG01oOTGwnWLox33WWd1RvMc+QQ=\n"
# c2sp.org/signed-note, "Example"
SPEC_VKEY = "example.com/foo+530d903a+AekyeRrm56hApGFkyQR4ZCbV54Id2LKaANYcrnKv3U2k"
SPEC_NOTE = (
    "This is an example message.\n\n"
    "— example.com/foo Uw2QOkn8srV1yJGh2VYRlL1Tnagv1YEq6TfXppzi2ONncAlTgK7Ztg1ERYNZXsYjOBH3mFXmRKuwHjG1Yu72IneyaQM=\n"
)
# c2sp.org/tlog-checkpoint's example body
SPEC_CHECKPOINT = (
    "example.com/behind-the-sofa\n20852163\nCsUYapGGPo4dkMgIAUqom/Xajj7h2fB2MPA3j2jxq2I=\n"
)


def test_go_signing_vector_is_reproduced_byte_for_byte() -> None:
    signer = Signer.from_string(GO_SKEY)
    assert signer.name == "PeterNeumann"
    assert signer.key_id == 0xC74F20A3
    assert signer.to_string() == GO_SKEY
    assert signer.verifier.to_string() == GO_VKEY
    assert sign_note(GO_TEXT, [signer]) == GO_TEXT + "\n" + PETER_SIG


def test_the_key_id_is_sha256_of_name_newline_type_and_key() -> None:
    verifier = Verifier.from_string(GO_VKEY)
    typed = base64.b64decode(GO_VKEY.split("+", 2)[2])
    assert key_id("PeterNeumann", typed) == 0xC74F20A3 == verifier.key_id


def test_the_spec_example_note_verifies() -> None:
    text, names = open_note(SPEC_NOTE, [Verifier.from_string(SPEC_VKEY)])
    assert text == "This is an example message.\n"
    assert names == ["example.com/foo"]


def test_go_open_vectors() -> None:
    peter, enoch = Verifier.from_string(GO_VKEY), Verifier.from_string(ENOCH_VKEY)
    note = GO_TEXT + "\n" + PETER_SIG + ENOCH_SIG
    # one known key: the other's signature is ignored
    assert open_note(note, [peter]) == (GO_TEXT, ["PeterNeumann"])
    assert open_note(note, [peter, enoch]) == (GO_TEXT, ["PeterNeumann", "EnochRoot"])
    with pytest.raises(NoteError, match="no signature by a known key"):
        open_note(note, [])
    # a duplicated verifier object is fine; two different ones with one name and id are not
    assert open_note(GO_TEXT + "\n" + PETER_SIG, [enoch, peter, enoch])[1] == ["PeterNeumann"]
    twin = Verifier(enoch.name, enoch.public_key)
    with pytest.raises(NoteError, match="ambiguous key EnochRoot\\+af0cfe78"):
        open_note(GO_TEXT + "\n" + ENOCH_SIG, [enoch, twin])
    # an altered signature of a known key rejects the whole note
    bad = PETER_SIG[:60] + "ABCD" + PETER_SIG[60:]
    with pytest.raises(NoteError, match="invalid signature for key PeterNeumann\\+c74f20a3"):
        open_note(GO_TEXT + "\n" + bad, [peter])
    # duplicated signatures count once; an unknown key's bad signature is ignored
    enoch_bad = ENOCH_SIG[:60] + "ABCD" + ENOCH_SIG[60:]
    many = GO_TEXT + "\n" + PETER_SIG + PETER_SIG + ENOCH_SIG + ENOCH_SIG + enoch_bad
    assert open_note(many, [peter]) == (GO_TEXT, ["PeterNeumann"])


@pytest.mark.parametrize(
    "message",
    [
        GO_TEXT,
        GO_TEXT + "\n",
        GO_TEXT + "\n" + PETER_SIG[:-1],
        "\x01" + GO_TEXT + "\n" + PETER_SIG,
        GO_TEXT
        + "\n— Bad Name x08go/ZJkuBS9UG/SffcvIAQxVBtiFupLLr8pAcElZInNIuGUgYN1FFYC2pZSNXgKvqfqdngotpRZb6KE6RyyBwJnAM=",
        GO_TEXT + "\n" + PETER_SIG + "Unexpected line.\n",
        GO_TEXT + "\n" + PETER_SIG * (MAX_SIGNATURES + 1),
    ],
)
def test_go_malformed_notes_are_refused(message: str) -> None:
    with pytest.raises(NoteError, match="malformed note"):
        open_note(message, [Verifier.from_string(GO_VKEY)])


def test_invalid_utf8_is_refused() -> None:
    with pytest.raises(NoteError, match="not UTF-8"):
        open_note(b"\xff" + (GO_TEXT + "\n" + PETER_SIG).encode(), [Verifier.from_string(GO_VKEY)])


def test_text_with_a_lone_surrogate_is_refused_as_malformed() -> None:
    """JSON (a bundle, the checkpoint history) can carry "\\ud800", which no UTF-8 holds:
    a NoteError, not a UnicodeEncodeError out of the signature check."""
    with pytest.raises(NoteError, match="not UTF-8"):
        open_note("x\ud800\n\n" + PETER_SIG, [Verifier.from_string(GO_VKEY)])


def test_mangled_verifier_and_signer_keys_are_refused() -> None:
    """Go's test: every strict substring, and every byte incremented, is refused."""
    for key, parse in ((GO_VKEY, Verifier.from_string), (GO_SKEY, Signer.from_string)):
        raw = key.encode()
        for start in range(len(raw) + 1):
            for end in range(start + 1, len(raw) + 1):
                if (start, end) == (0, len(raw)):
                    continue
                piece = raw[start:end].decode()
                if piece.strip() == key:
                    continue  # our parser strips surrounding whitespace, nothing else
                with pytest.raises(NoteError):
                    parse(piece)
        for index in range(len(raw)):
            mangled = bytearray(raw)
            mangled[index] += 1
            with pytest.raises((NoteError, UnicodeDecodeError)):
                parse(mangled.decode())
    with pytest.raises(NoteError, match="Ed25519 key is 32 bytes"):
        Verifier.from_string(
            "PeterNeumann+cc469956+ARpc2QcUPDhMQegwxbzhKqiBfsVkmqq/LDE4izWy10TWBADKEY=="
        )
    with pytest.raises(NoteError, match="only Ed25519"):
        Verifier.from_string("PeterNeumann+173116ae+ZRpc2QcUPDhMQegwxbzhKqiBfsVkmqq/LDE4izWy10TW")


def test_key_errors_never_quote_the_private_key() -> None:
    with pytest.raises(NoteError) as caught:
        Signer.from_string(GO_SKEY.replace("c74f20a3", "c74f20a4"))
    assert "AYEKFALV" not in str(caught.value)
    assert "does not match its name and key" in str(caught.value)


def test_generated_keys_round_trip() -> None:
    skey, vkey = generate_key("gw.example/audit")
    signer, verifier = Signer.from_string(skey), Verifier.from_string(vkey)
    assert signer.verifier.to_string() == vkey
    note = sign_note("hello\n", [signer])
    assert open_note(note, [verifier]) == ("hello\n", ["gw.example/audit"])
    for name in ("", "a b", "a+b", "tab\there"):
        with pytest.raises(NoteError, match="empty or holds a space"):
            generate_key(name)


def test_signing_refuses_text_a_note_cannot_hold() -> None:
    signer = Signer.from_string(GO_SKEY)
    with pytest.raises(NoteError, match="end in a newline"):
        sign_note("abc", [signer])
    with pytest.raises(NoteError, match="control characters"):
        sign_note("a\x00b\n", [signer])
    with pytest.raises(NoteError, match="at least one signer"):
        sign_note("abc\n", [])


def test_flipping_any_byte_of_a_signature_is_caught() -> None:
    signer = Signer.from_string(GO_SKEY)
    verifier = signer.verifier
    text, sigs = parse_note(sign_note(GO_TEXT, [signer]))
    raw = sigs[0].signature
    for index in range(len(raw)):
        flipped = raw[:index] + bytes([raw[index] ^ 1]) + raw[index + 1 :]
        note = text + "\n" + type(sigs[0])(sigs[0].name, sigs[0].key_id, flipped).line()
        with pytest.raises(NoteError, match="invalid signature"):
            open_note(note, [verifier])


def test_the_spec_checkpoint_round_trips() -> None:
    checkpoint = parse_checkpoint(SPEC_CHECKPOINT)
    assert checkpoint.origin == "example.com/behind-the-sofa"
    assert checkpoint.size == 20852163
    assert checkpoint.body() == SPEC_CHECKPOINT
    with_ext = Checkpoint(checkpoint.origin, 5, checkpoint.root, ("ext one",))
    assert parse_checkpoint(with_ext.body()) == with_ext


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("o\n1\n", "at least 3 lines"),
        ("\n1\nCsUYapGGPo4dkMgIAUqom/Xajj7h2fB2MPA3j2jxq2I=\n", "origin"),
        ("o\n01\nCsUYapGGPo4dkMgIAUqom/Xajj7h2fB2MPA3j2jxq2I=\n", "tree size"),
        ("o\n-1\nCsUYapGGPo4dkMgIAUqom/Xajj7h2fB2MPA3j2jxq2I=\n", "tree size"),
        ("o\n1\nnot base64!\n", "root hash"),
        ("o\n1\nAAAA\n", "32-byte hash"),
        ("o\n1\nCsUYapGGPo4dkMgIAUqom/Xajj7h2fB2MPA3j2jxq2I=", "ends in a newline"),
        ("o\n1\nCsUYapGGPo4dkMgIAUqom/Xajj7h2fB2MPA3j2jxq2I=\n\n", "extension line is empty"),
        ("o\n99999999999999999999\nCsUYapGGPo4dkMgIAUqom/Xajj7h2fB2MPA3j2jxq2I=\n", "size"),
    ],
)
def test_malformed_checkpoints_name_the_line(text: str, message: str) -> None:
    with pytest.raises(CheckpointError, match=message):
        parse_checkpoint(text)
