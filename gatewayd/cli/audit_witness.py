"""`gatewayd audit verify --witness VKEY ... --quorum K`: at least K of the named
witnesses cosigned a checkpoint of the log that the log still matches (docs/audit.md,
"Witnesses")."""

from __future__ import annotations

import argparse
import functools
import sys

from gatewayd.cli.command import EXIT_FAILED, EXIT_OK, EXIT_USAGE
from gatewayd.cli.options import whole_number

# typing's flag without importing typing: client commands start without it
TYPE_CHECKING = False
if TYPE_CHECKING:
    from typing import Final

# A cosigned checkpoint is a few hundred bytes; the cap keeps a wrong file from being
# read whole.
MAX_NOTE_BYTES: Final = 1 << 20


def add_verify_options(verify: argparse.ArgumentParser) -> None:
    verify.add_argument(
        "--witness",
        action="append",
        default=None,
        metavar="VKEY",
        help="a witness's verifier key (NAME+ID+KEY, repeatable): check its cosignatures, "
        "kept beside the log (FILE.witnessed/) and in --checkpoint (needs --key)",
    )
    verify.add_argument(
        "--quorum",
        type=whole_number,
        default=None,
        metavar="K",
        help="how many of the --witness keys must have cosigned a checkpoint the log "
        "matches (default: all of them)",
    )


def _fail(message: str, code: int = EXIT_FAILED) -> int:
    print(f"gatewayd: {message}", file=sys.stderr)
    return code


def verify_witnesses(args: argparse.Namespace) -> int:
    """The `--witness` part of `audit verify`: prints the verdict, returns its exit."""
    from pathlib import Path  # here: a plain `audit verify` starts without it

    from gatewayd.audit.cosignature import CosignatureError, CosignatureVerifier
    from gatewayd.audit.note import NoteError, Verifier
    from gatewayd.audit.proofs import authenticated_leaves, log_leaves
    from gatewayd.audit.quorum import check_quorum
    from gatewayd.audit.witnessing import read_witnessed

    if not args.key:
        return _fail(
            "--witness needs --key VKEY (the log's verifier key: a cosigned checkpoint "
            "counts only if the log signed it)",
            EXIT_USAGE,
        )
    try:
        log_keys = [Verifier.from_string(key) for key in args.key]
    except NoteError as exc:
        return _fail(f"--key: {exc}", EXIT_USAGE)
    try:
        witnesses = [CosignatureVerifier.from_string(key) for key in args.witness]
    except CosignatureError as exc:
        return _fail(f"--witness: {exc}", EXIT_USAGE)
    if len({w.name for w in witnesses}) != len(witnesses):
        return _fail("--witness: two keys of one witness name; name each witness once", EXIT_USAGE)
    # One key under two names is one witness (whoever holds it can cosign as both):
    # counting it twice would let one witness make a quorum of two.
    if len({w.typed_key for w in witnesses}) != len(witnesses):
        return _fail(
            "--witness: two names with one public key; that is one witness, give it once",
            EXIT_USAGE,
        )
    quorum = len(witnesses) if args.quorum is None else args.quorum
    if not 1 <= quorum <= len(witnesses):
        return _fail(
            f"--quorum {quorum}: must be between 1 and the number of --witness keys "
            f"({len(witnesses)})",
            EXIT_USAGE,
        )
    log = Path(args.file)
    notes = [(str(path), text) for path, text in read_witnessed(log)]
    if args.checkpoint is not None:
        try:
            with open(args.checkpoint, "rb") as file:
                data = file.read(MAX_NOTE_BYTES + 1)
            if len(data) > MAX_NOTE_BYTES:
                raise ValueError(f"over {MAX_NOTE_BYTES} bytes: not a checkpoint")
            notes.append((str(args.checkpoint), data.decode()))
        except (OSError, UnicodeDecodeError, ValueError) as exc:
            return _fail(f"cannot read the checkpoint {args.checkpoint}: {exc}")
    read = log_leaves(log, partial=True)
    verdict = check_quorum(
        read.leaves,
        notes,
        log_keys,
        witnesses,
        quorum,
        first_seq=read.first_seq,
        stored=functools.partial(authenticated_leaves, log),
    )
    for line in verdict.lines:
        print(line)
    return EXIT_OK if verdict.ok else EXIT_FAILED
