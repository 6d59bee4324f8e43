"""Signed notes (C2SP signed-note, the format of Go's ``golang.org/x/mod/sumdb/note``).

A note is UTF-8 text ending in a newline, a blank line, then signature lines
``— <key name> base64(key id || signature)``. Keys are Ed25519 (the ``cryptography``
package does the signing): a key's id is the first four bytes of
``SHA-256(name || "\\n" || 0x01 || public key)``, and keys are written as text
exactly as Go writes them, so Go's tools and ours read each other's keys and notes:

- signer (private) key: ``PRIVATE+KEY+<name>+<id hex>+base64(0x01 || 32-byte seed)``;
- verifier key (*vkey*): ``<name>+<id hex>+base64(0x01 || 32-byte public key)``.

:func:`open_note` follows the spec (and Go): signatures by keys it does not know are
ignored (a witness's cosignature, a rotated key); a signature by a known key that
does not verify rejects the whole note; a note with no verified signature is
rejected. Other signature types (a witness's timestamped cosignatures) plug in as
any object with ``name``, ``key_id`` and ``verify(text, signature)``
(:class:`NoteVerifier`).

We write the format ourselves: no maintained Python package implements signed notes
(the reference is Go's); the cryptography is the ``cryptography`` package's. The
tests check ours against the C2SP spec's example and Go's published test vectors.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import re
import unicodedata
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Final, Protocol

if TYPE_CHECKING:
    # cryptography is imported where a key is made or used: a daemon with no checkpoint
    # key (and `gatewayd run`) never loads it.
    from cryptography.hazmat.primitives.asymmetric.ed25519 import (
        Ed25519PrivateKey,
        Ed25519PublicKey,
    )

EM_DASH: Final = "\u2014"
SIGNATURE_PREFIX: Final = EM_DASH + " "
PRIVATE_KEY_PREFIX: Final = "PRIVATE+KEY+"
ALG_ED25519: Final = 0x01
ED25519_KEY_SIZE: Final = 32
KEY_ID_SIZE: Final = 4

# Go rejects a note with more than 100 signatures; the spec asks for at least 16.
MAX_SIGNATURES: Final = 100
# A checkpoint and a few dozen signatures fit many times over (a post-quantum
# signature is about 5 kB); bounds what a forged note can make us parse.
MAX_NOTE_BYTES: Final = 1 << 20

_BASE64 = re.compile(r"[A-Za-z0-9+/]+={0,2}")


class NoteError(ValueError):
    """A malformed note or key, or a note that does not verify; the message says which."""


class NoteVerifier(Protocol):
    """Anything that checks one key's signatures: its name, key id and check."""

    @property
    def name(self) -> str: ...

    @property
    def key_id(self) -> int: ...

    def verify(self, text: bytes, signature: bytes) -> bool: ...


def is_valid_name(name: str) -> bool:
    """A key name: non-empty, no Unicode space, no ``+`` (which separates key fields),
    and no control character."""
    return (
        bool(name)
        and "+" not in name
        and not any(ch.isspace() or unicodedata.category(ch) in ("Zs", "Cc") for ch in name)
    )


def key_id(name: str, typed_key: bytes) -> int:
    """The key id: the first four bytes, big-endian, of SHA-256(name, newline, the key
    with its type byte)."""
    digest = hashlib.sha256(name.encode() + b"\n" + typed_key).digest()
    return int.from_bytes(digest[:KEY_ID_SIZE], "big")


def _b64decode(text: str, what: str) -> bytes:
    if not _BASE64.fullmatch(text):
        raise NoteError(f"{what} is not base64")
    try:
        return base64.b64decode(text, validate=True)
    except binascii.Error:
        raise NoteError(f"{what} is not base64") from None


def _split_key(text: str, fields: int, what: str) -> list[str]:
    # The base64 key material may itself hold '+': split off the first fields only.
    parts = text.split("+", fields - 1)
    if len(parts) != fields:
        raise NoteError(
            f"not a {what}: expected {fields} fields separated by '+', found {len(parts)}"
        )
    return parts


def _parse_key_fields(name: str, hex_id: str, material: str, what: str) -> tuple[int, bytes]:
    if not is_valid_name(name):
        raise NoteError(f"{what}: key name {name!r} is empty or holds a space or '+'")
    if not re.fullmatch(r"[0-9a-f]{8}", hex_id):
        raise NoteError(f"{what}: key id {hex_id!r} is not 8 lowercase hex digits")
    typed = _b64decode(material, f"{what}: the key material")
    if not typed or typed[0] != ALG_ED25519:
        raise NoteError(f"{what}: only Ed25519 keys (type 0x01) are supported")
    if len(typed) != 1 + ED25519_KEY_SIZE:
        raise NoteError(f"{what}: an Ed25519 key is {ED25519_KEY_SIZE} bytes, not {len(typed) - 1}")
    return int(hex_id, 16), typed


@dataclass(frozen=True, slots=True)
class Verifier:
    """An Ed25519 note verifier: a key name and its public key."""

    name: str
    public_key: Ed25519PublicKey

    def __post_init__(self) -> None:
        if not is_valid_name(self.name):
            raise NoteError(f"key name {self.name!r} is empty or holds a space or '+'")

    @property
    def typed_key(self) -> bytes:
        from cryptography.hazmat.primitives.serialization import Encoding, PublicFormat

        return bytes([ALG_ED25519]) + self.public_key.public_bytes(Encoding.Raw, PublicFormat.Raw)

    @property
    def key_id(self) -> int:
        return key_id(self.name, self.typed_key)

    def verify(self, text: bytes, signature: bytes) -> bool:
        from cryptography.exceptions import InvalidSignature

        try:
            self.public_key.verify(signature, text)
        except InvalidSignature:
            return False
        return True

    def to_string(self) -> str:
        """The vkey: ``name+<id hex>+base64(0x01 || public key)``."""
        encoded = base64.b64encode(self.typed_key).decode()
        return f"{self.name}+{self.key_id:08x}+{encoded}"

    @classmethod
    def from_string(cls, vkey: str) -> Verifier:
        """Parse a vkey.

        Error handling: NoteError saying which part is wrong (including a key id that
        does not match the name and key).
        """
        name, hex_id, material = _split_key(vkey.strip(), 3, "verifier key (name+id+key)")
        claimed, typed = _parse_key_fields(name, hex_id, material, "verifier key")
        if key_id(name, typed) != claimed:
            raise NoteError(f"verifier key: the key id {hex_id} does not match its name and key")
        from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PublicKey

        return cls(name, Ed25519PublicKey.from_public_bytes(typed[1:]))


@dataclass(frozen=True, slots=True)
class Signer:
    """An Ed25519 note signer: a key name and its private key."""

    name: str
    private_key: Ed25519PrivateKey

    def __post_init__(self) -> None:
        if not is_valid_name(self.name):
            raise NoteError(f"key name {self.name!r} is empty or holds a space or '+'")

    @property
    def verifier(self) -> Verifier:
        return Verifier(self.name, self.private_key.public_key())

    @property
    def key_id(self) -> int:
        return self.verifier.key_id

    def sign(self, text: bytes) -> bytes:
        return self.private_key.sign(text)

    def to_string(self) -> str:
        """The signer key: ``PRIVATE+KEY+name+<id hex>+base64(0x01 || seed)``."""
        seed = self.private_key.private_bytes_raw()
        encoded = base64.b64encode(bytes([ALG_ED25519]) + seed).decode()
        return f"{PRIVATE_KEY_PREFIX}{self.name}+{self.key_id:08x}+{encoded}"

    @classmethod
    def from_string(cls, skey: str) -> Signer:
        """Parse a signer key.

        Error handling: NoteError saying which part is wrong (never quoting the key).
        """
        text = skey.strip()
        if not text.startswith(PRIVATE_KEY_PREFIX):
            raise NoteError(f"not a signer key: it does not start with {PRIVATE_KEY_PREFIX}")
        name, hex_id, material = _split_key(
            text.removeprefix(PRIVATE_KEY_PREFIX), 3, "signer key (PRIVATE+KEY+name+id+key)"
        )
        claimed, typed = _parse_key_fields(name, hex_id, material, "signer key")
        from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

        signer = cls(name, Ed25519PrivateKey.from_private_bytes(typed[1:]))
        if signer.key_id != claimed:
            raise NoteError(f"signer key: the key id {hex_id} does not match its name and key")
        return signer


def generate_key(name: str) -> tuple[str, str]:
    """A new Ed25519 key pair for ``name``: ``(signer key, verifier key)`` as text.

    Error handling: NoteError for a name that is empty or holds a space or ``+``.
    """
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

    signer = Signer(name, Ed25519PrivateKey.generate())
    return signer.to_string(), signer.verifier.to_string()


@dataclass(frozen=True, slots=True)
class Signature:
    """One signature line: the key's name and id, and the signature bytes."""

    name: str
    key_id: int
    signature: bytes

    def line(self) -> str:
        encoded = base64.b64encode(self.key_id.to_bytes(KEY_ID_SIZE, "big") + self.signature)
        return f"{SIGNATURE_PREFIX}{self.name} {encoded.decode()}\n"


def _check_text(text: str) -> None:
    if not text.endswith("\n"):
        raise NoteError("malformed note: the text must end in a newline")
    if any(ord(ch) < 0x20 and ch != "\n" for ch in text):
        raise NoteError("malformed note: control characters other than newline")


def sign_note(text: str, signers: Iterable[Signer]) -> str:
    """``text`` followed by a blank line and one signature line per signer.

    Error handling: NoteError when the text does not end in a newline, holds control
    characters, or no signer is given.
    """
    _check_text(text)
    lines = [Signature(s.name, s.key_id, s.sign(text.encode())).line() for s in signers]
    if not lines:
        raise NoteError("a note needs at least one signer")
    return text + "\n" + "".join(lines)


def parse_note(note: str | bytes) -> tuple[str, list[Signature]]:
    """Split a note into its text and signatures without checking any signature.

    Error handling: NoteError for anything that is not a well-formed note.
    """
    if isinstance(note, bytes):
        if len(note) > MAX_NOTE_BYTES:
            raise NoteError(f"the note is {len(note)} bytes, more than {MAX_NOTE_BYTES}")
        try:
            note = note.decode()
        except UnicodeDecodeError:
            raise NoteError("malformed note: not UTF-8") from None
    if len(note) > MAX_NOTE_BYTES:
        raise NoteError(f"the note is over {MAX_NOTE_BYTES} bytes")
    try:
        # Text from JSON (a bundle, the checkpoint history) may hold lone surrogates,
        # which are no UTF-8: refuse them here, not with a UnicodeEncodeError later.
        note.encode()
    except UnicodeEncodeError:
        raise NoteError("malformed note: not UTF-8 (a lone surrogate)") from None
    if any(ord(ch) < 0x20 and ch != "\n" for ch in note):
        raise NoteError("malformed note: control characters other than newline")
    split = note.rfind("\n\n")
    if split < 0:
        raise NoteError("malformed note: no blank line before the signatures")
    text, block = note[: split + 1], note[split + 2 :]
    if not block.endswith("\n"):
        raise NoteError("malformed note: the signatures do not end in a newline")
    lines = block[:-1].split("\n")
    if len(lines) > MAX_SIGNATURES:
        raise NoteError(f"malformed note: {len(lines)} signatures, more than {MAX_SIGNATURES}")
    signatures: list[Signature] = []
    for number, line in enumerate(lines, 1):
        if not line.startswith(SIGNATURE_PREFIX):
            raise NoteError(f"malformed note: signature line {number} does not start with '— '")
        name, space, encoded = line[len(SIGNATURE_PREFIX) :].partition(" ")
        if not space or not is_valid_name(name):
            raise NoteError(f"malformed note: signature line {number} has no valid key name")
        raw = _b64decode(encoded, f"signature line {number}")
        if len(raw) <= KEY_ID_SIZE:
            raise NoteError(f"malformed note: signature line {number} is too short")
        signatures.append(
            Signature(name, int.from_bytes(raw[:KEY_ID_SIZE], "big"), raw[KEY_ID_SIZE:])
        )
    return text, signatures


def open_note(note: str | bytes, verifiers: Sequence[NoteVerifier]) -> tuple[str, list[str]]:
    """Check a note's signatures; returns its text and the names of the known keys whose
    signatures verified (each once, in the note's order).

    Signatures by keys not in ``verifiers`` (name and id) are ignored.

    Error handling: NoteError when the note is malformed, two verifiers share a name
    and id, a known key's signature does not verify (a forged or altered note), or
    no known key signed it.
    """
    text, signatures = parse_note(note)
    known: dict[tuple[str, int], NoteVerifier] = {}
    for verifier in verifiers:
        ident = (verifier.name, verifier.key_id)
        if ident in known and known[ident] is not verifier:
            raise NoteError(f"ambiguous key {verifier.name}+{verifier.key_id:08x}")
        known[ident] = verifier
    verified: list[str] = []
    seen: set[tuple[str, int]] = set()
    message = text.encode()
    for signature in signatures:
        ident = (signature.name, signature.key_id)
        found = known.get(ident)
        if found is None or ident in seen:
            continue
        if not found.verify(message, signature.signature):
            raise NoteError(
                f"invalid signature for key {signature.name}+{signature.key_id:08x}: the "
                "note was altered or not signed by that key"
            )
        seen.add(ident)
        verified.append(signature.name)
    if not verified:
        names = ", ".join(f"{n}+{i:08x}" for n, i in known) or "none given"
        raise NoteError(f"the note has no signature by a known key (known: {names})")
    return text, verified
