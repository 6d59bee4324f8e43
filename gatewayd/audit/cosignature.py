"""Witness cosignatures: C2SP tlog-cosignature/v1 with Ed25519 (signature type 0x04).

A cosignature is a signed-note signature line ``— <name> base64(key ID || timestamp ||
signature)`` on a checkpoint: the witness's statement that, at ``timestamp`` (POSIX
seconds, 8 bytes big-endian), this is the largest tree it has seen for the log and it is
consistent with every earlier one. The signed message is ``cosignature/v1\\n``, then
``time <timestamp>\\n``, then the checkpoint's note text (extension lines included). The
key ID is ``SHA-256(name || "\\n" || 0x04 || public key)[:4]``. Keys are written as Go's
``golang.org/x/mod/sumdb/note`` writes them: ``PRIVATE+KEY+<name>+<hex ID>+base64(type
|| seed)`` and ``<name>+<hex ID>+base64(type || public key)``; a plain Ed25519 note key
(type 0x01) is read as the same key under type 0x04, as github.com/transparency-dev/
formats reads it.

Our own code, not a library's: no maintained Python package implements cosignature/v1;
it is a few lines on top of ``cryptography``'s Ed25519 and our signed-note module
(:mod:`gatewayd.audit.note`, whose ``open_note`` takes these verifiers beside the log's),
checked in the tests against the C2SP examples and the keys and checkpoints of an
independent implementation. The witness (which signs) and ``gatewayd audit verify
--witness`` (which checks) both use it, so it sits in the audit package, below both.
"""

from __future__ import annotations

import base64
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Final

from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey
from cryptography.hazmat.primitives.serialization import Encoding, PublicFormat

from gatewayd.audit.note import (
    ALG_ED25519,
    ED25519_KEY_SIZE,
    PRIVATE_KEY_PREFIX,
    NoteError,
    NoteVerifier,
    Signature,
    is_valid_name,
    key_id,
    open_note,
    parse_note,
)

# Signature type byte of timestamped Ed25519 cosignatures (c2sp.org/signed-note).
ALG_COSIGNATURE_V1: Final = 0x04
TIMESTAMP_SIZE: Final = 8
ED25519_SIGNATURE_SIZE: Final = 64
# What follows the key ID in a cosignature line: timestamp || Ed25519 signature.
COSIGNATURE_SIZE: Final = TIMESTAMP_SIZE + ED25519_SIGNATURE_SIZE
# The spec caps the timestamp at 2^63 - 1.
MAX_TIMESTAMP: Final = 2**63 - 1
HEADER: Final = "cosignature/v1\n"
# A checkpoint's note text has at least origin, size and root hash lines.
MIN_CHECKPOINT_LINES: Final = 3


class CosignatureError(ValueError):
    """A malformed witness key, or a cosignature that does not verify."""


def cosigned_message(note_text: str, timestamp: int) -> bytes:
    """What a cosignature/v1 signs for the checkpoint whose note text is ``note_text``
    (its lines, the last newline included, no signature lines).

    Error handling: CosignatureError for a timestamp outside 0..2^63-1 or a text that
    is not at least three newline-terminated lines.
    """
    if not 0 <= timestamp <= MAX_TIMESTAMP:
        raise CosignatureError(f"timestamp {timestamp} is outside 0..2^63-1")
    if not note_text.endswith("\n") or note_text.count("\n") < MIN_CHECKPOINT_LINES:
        raise CosignatureError(
            "a cosigned text is a checkpoint: origin, size and root hash lines, each "
            "ending in a newline"
        )
    return f"{HEADER}time {timestamp}\n{note_text}".encode()


def _typed_ed25519(encoded: str, what: str) -> bytes:
    """The raw 32-byte key of ``base64(0x01 or 0x04 || key)``."""
    try:
        typed = base64.b64decode(encoded, validate=True)
    except ValueError:
        raise CosignatureError(f"{what}: the key material is not base64") from None
    if len(typed) != 1 + ED25519_KEY_SIZE or typed[0] not in (ALG_ED25519, ALG_COSIGNATURE_V1):
        raise CosignatureError(
            f"{what}: not an Ed25519 witness key (type byte 0x04, or 0x01, then "
            f"{ED25519_KEY_SIZE} key bytes)"
        )
    return typed


def _split(text: str, what: str) -> tuple[str, int, str]:
    # The key material is base64, which may hold '+': only the first two separate fields.
    parts = text.split("+", 2)
    if len(parts) != 3:
        raise CosignatureError(
            f"{what}: expected NAME+KEYID+BASE64 (3 fields separated by '+'), found "
            f"{len(parts)}; `gatewayd witness keygen` prints one"
        )
    name, hex_id, encoded = parts
    if not is_valid_name(name):
        raise CosignatureError(f"{what}: key name {name!r} is empty or holds a space or '+'")
    if len(hex_id) != 8 or hex_id.strip("0123456789abcdef"):
        raise CosignatureError(f"{what}: key ID {hex_id!r} is not 8 lowercase hex digits")
    return name, int(hex_id, 16), encoded


def _public_bytes(key: Ed25519PublicKey) -> bytes:
    return key.public_bytes(Encoding.Raw, PublicFormat.Raw)


@dataclass(frozen=True, slots=True)
class CosignatureVerifier:
    """A witness's public key: checks its cosignatures. It is a
    :class:`~gatewayd.audit.note.NoteVerifier`, so ``open_note`` takes it."""

    name: str
    public_key: Ed25519PublicKey

    def __post_init__(self) -> None:
        if not is_valid_name(self.name):
            raise CosignatureError(f"key name {self.name!r} is empty or holds a space or '+'")

    @classmethod
    def from_string(cls, vkey: str) -> CosignatureVerifier:
        """Parse a witness's verifier key (type 0x04, or a 0x01 note key read as 0x04).

        Error handling: CosignatureError naming the part that is wrong, including a
        key ID that does not match the name and key (an edited or truncated string).
        """
        name, claimed, encoded = _split(vkey.strip(), "witness verifier key")
        typed = _typed_ed25519(encoded, "witness verifier key")
        if key_id(name, typed) != claimed:
            raise CosignatureError(
                f"witness verifier key: the key ID {claimed:08x} does not match its name and "
                "key (the string was edited or truncated)"
            )
        return cls(name, Ed25519PublicKey.from_public_bytes(typed[1:]))

    @property
    def typed_key(self) -> bytes:
        return bytes([ALG_COSIGNATURE_V1]) + _public_bytes(self.public_key)

    @property
    def key_id(self) -> int:
        return key_id(self.name, self.typed_key)

    def to_string(self) -> str:
        """The vkey: ``name+<hex ID>+base64(0x04 || public key)``."""
        return f"{self.name}+{self.key_id:08x}+{base64.b64encode(self.typed_key).decode()}"

    def verify(self, text: bytes, signature: bytes) -> bool:
        """Whether ``signature`` (timestamp || Ed25519 signature, the key ID removed) is
        this witness's cosignature on the checkpoint note text ``text``."""
        if len(signature) != COSIGNATURE_SIZE:
            return False
        timestamp = int.from_bytes(signature[:TIMESTAMP_SIZE], "big")
        try:
            message = cosigned_message(text.decode(), timestamp)
        except (CosignatureError, UnicodeDecodeError):
            return False
        try:
            self.public_key.verify(signature[TIMESTAMP_SIZE:], message)
        except InvalidSignature:
            return False
        return True


@dataclass(frozen=True, slots=True, repr=False)
class Cosigner:
    """A witness's private key: makes cosignatures. Its repr never shows the key."""

    name: str
    private_key: Ed25519PrivateKey

    def __post_init__(self) -> None:
        if not is_valid_name(self.name):
            raise CosignatureError(f"key name {self.name!r} is empty or holds a space or '+'")

    def __repr__(self) -> str:
        return f"Cosigner(name={self.name!r})"

    @classmethod
    def from_string(cls, skey: str) -> Cosigner:
        """Parse ``PRIVATE+KEY+name+<hex ID>+base64(type || seed)`` (type 0x04 or 0x01;
        the ID is checked against the key read under that type).

        Error handling: CosignatureError naming the part that is wrong (never the key).
        """
        text = skey.strip()
        if not text.startswith(PRIVATE_KEY_PREFIX):
            raise CosignatureError(
                f"not a witness signing key: it does not start with {PRIVATE_KEY_PREFIX}; "
                "`gatewayd witness keygen` makes one"
            )
        name, claimed, encoded = _split(text.removeprefix(PRIVATE_KEY_PREFIX), "signing key")
        typed = _typed_ed25519(encoded, "witness signing key")
        cosigner = cls(name, Ed25519PrivateKey.from_private_bytes(typed[1:]))
        public = bytes([typed[0]]) + _public_bytes(cosigner.private_key.public_key())
        if key_id(name, public) != claimed:
            raise CosignatureError(
                f"witness signing key: the key ID {claimed:08x} does not match its name and key"
            )
        return cosigner

    def to_string(self) -> str:
        """The signing key: ``PRIVATE+KEY+name+<hex ID>+base64(0x04 || seed)``."""
        seed = bytes([ALG_COSIGNATURE_V1]) + self.private_key.private_bytes_raw()
        return (
            f"{PRIVATE_KEY_PREFIX}{self.name}+{self.verifier.key_id:08x}+"
            f"{base64.b64encode(seed).decode()}"
        )

    @property
    def verifier(self) -> CosignatureVerifier:
        return CosignatureVerifier(self.name, self.private_key.public_key())

    def cosign(self, note_text: str, timestamp: int) -> str:
        """The signature line (newline-terminated) cosigning the checkpoint note text
        ``note_text`` at ``timestamp``.

        Error handling: CosignatureError for a timestamp that is zero (a witness's
        cosignature MUST carry one) or out of range, or a text that is no checkpoint.
        """
        if timestamp <= 0:
            raise CosignatureError("a witness's cosignature carries a non-zero timestamp")
        signature = self.private_key.sign(cosigned_message(note_text, timestamp))
        blob = timestamp.to_bytes(TIMESTAMP_SIZE, "big") + signature
        return Signature(self.name, self.verifier.key_id, blob).line()


def generate_cosigner_key(name: str) -> tuple[str, str]:
    """A new witness key pair for ``name``: ``(signing key, verifier key)`` as text.

    Error handling: CosignatureError for a name that is empty or holds a space or ``+``.
    """
    cosigner = Cosigner(name, Ed25519PrivateKey.generate())
    return cosigner.to_string(), cosigner.verifier.to_string()


def cosignature_timestamp(signature: Signature) -> int:
    """The timestamp a cosignature line carries (not verified: verify it first)."""
    return int.from_bytes(signature.signature[:TIMESTAMP_SIZE], "big")


@dataclass(frozen=True, slots=True)
class Witnessed:
    """A checkpoint note opened with the log's key and witnesses' keys."""

    text: str
    log_verified: tuple[str, ...]
    # Witness name -> the timestamp of its verified cosignature.
    cosigned: dict[str, int]


def open_witnessed(
    note: str,
    log_verifiers: Sequence[NoteVerifier],
    witnesses: Sequence[CosignatureVerifier],
) -> Witnessed:
    """Open a checkpoint note signed by the log and cosigned by zero or more witnesses.

    Signatures by unknown keys are ignored; a signature by a known key (the log's or a
    witness's) that does not verify rejects the whole note, so a tampered cosignature is
    never silently dropped.

    Error handling: NoteError when the note is malformed, a known key's signature fails,
    or no log key signed it.
    """
    text, _ = open_note(note, [*log_verifiers, *witnesses])
    # open_note verified the first signature of every known key the note holds (or
    # raised), so a known key's presence is its verification. Keys are told apart by
    # name *and* key ID: a witness that shares the log key's name must not pass for it.
    log_idents = {(v.name, v.key_id) for v in log_verifiers}
    by_ident = {(w.name, w.key_id): w for w in witnesses}
    log_verified: dict[str, None] = {}
    cosigned: dict[str, int] = {}
    for signature in parse_note(note)[1]:
        ident = (signature.name, signature.key_id)
        if ident in log_idents:
            log_verified.setdefault(signature.name)
        witness = by_ident.get(ident)
        if witness is not None:
            cosigned.setdefault(witness.name, cosignature_timestamp(signature))
    if not log_verified:
        names = ", ".join(sorted({v.name for v in log_verifiers})) or "none given"
        raise NoteError(f"the checkpoint is not signed by the log's key ({names})")
    return Witnessed(text=text, log_verified=tuple(log_verified), cosigned=cosigned)
