"""`gatewayd audit keygen|checkpoint|prove|verify-proof`, and `audit verify --checkpoint`:
the audit log's Merkle tree, its signed checkpoints and proofs (docs/audit.md).

Every `gatewayd audit` command imports this module (`audit verify` takes its options),
so its paths are strings, made paths in the commands that use them: `audit show|verify`
start without pathlib.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import sys

from gatewayd.cli.command import EXIT_FAILED, EXIT_OK, EXIT_USAGE
from gatewayd.cli.options import whole_number

# typing's flag without importing typing: client commands start without it
TYPE_CHECKING = False
if TYPE_CHECKING:
    from collections.abc import Callable
    from pathlib import Path
    from typing import Final

    from gatewayd.audit.note import Verifier

# Commands that read no log: they run before the log is looked for.
WITHOUT_LOG: Final = frozenset({"keygen", "verify-proof"})
# A checkpoint file holds one signed note (plus perhaps a few cosignatures): far less.
MAX_CHECKPOINT_BYTES: Final = 1 << 20


def _default_key_name() -> str:
    import socket  # here: every `gatewayd audit` command imports this module

    # A key name may hold no space or '+'; a host name holds neither.
    return f"{socket.gethostname() or 'localhost'}/gatewayd-audit"


def subcommands(log_help: str) -> list[tuple[str, str, Callable[[argparse.ArgumentParser], None]]]:
    """This module's commands: each one's name, help line, and what adds its arguments
    to its parser (`gatewayd audit` makes a command's parser only once it is named)."""
    return [
        (
            "keygen",
            "make a checkpoint signing key: the private key goes to --out (mode 0600), "
            "the verifier key is printed",
            _keygen_options,
        ),
        (
            "checkpoint",
            "sign a checkpoint of the log now (also while the daemon runs)",
            functools.partial(_checkpoint_options, log_help=log_help),
        ),
        (
            "prove",
            "print a proof bundle (JSON): SEQ's inclusion in a signed checkpoint, or "
            "with --consistency OLD NEW that checkpoint NEW extends OLD",
            functools.partial(_prove_options, log_help=log_help),
        ),
        (
            "verify-proof",
            "check a proof bundle from `gatewayd audit prove` with the log's verifier "
            "key alone (no log needed)",
            _verify_proof_options,
        ),
    ]


def _keygen_options(keygen: argparse.ArgumentParser) -> None:
    keygen.add_argument(
        "--name",
        default=None,
        help="the key's name, which is also the checkpoints' origin (no spaces or '+'; "
        "default: HOSTNAME/gatewayd-audit)",
    )
    keygen.add_argument(
        "--out",
        required=True,
        help="where to write the private key; must not exist; keep it outside the audit directory",
    )


def _checkpoint_options(checkpoint: argparse.ArgumentParser, log_help: str) -> None:
    checkpoint.add_argument(
        "--key", required=True, help="the private key file (gatewayd audit keygen)"
    )
    checkpoint.add_argument("--no-fsync", action="store_true", help=argparse.SUPPRESS)  # tests only
    checkpoint.add_argument("file", help=log_help)


def _prove_options(prove: argparse.ArgumentParser, log_help: str) -> None:
    prove.add_argument(
        "--consistency",
        nargs=2,
        metavar=("OLD", "NEW"),
        help="two checkpoints: each a size of a checkpoint in the log's history or a "
        "checkpoint file",
    )
    prove.add_argument(
        "--checkpoint",
        default=None,
        help="the signed checkpoint to prove against (default: FILE.checkpoint, the latest)",
    )
    prove.add_argument(
        "--key", required=True, action="append", help="the log's verifier key (NAME+ID+KEY)"
    )
    # [SEQ] FILE as one list: an optional positional before a required one does not
    # survive options between them (`prove 7 --key K FILE`) in argparse.
    prove.add_argument(
        "operands", nargs="+", metavar="[SEQ] FILE", help=f"the entry's seq, then {log_help}"
    )


def _verify_proof_options(check: argparse.ArgumentParser) -> None:
    check.add_argument(
        "--key", required=True, action="append", help="the log's verifier key (NAME+ID+KEY)"
    )
    check.add_argument("bundle", help="the bundle file ('-': standard input)")


def add_verify_options(verify: argparse.ArgumentParser) -> None:
    """`audit verify --checkpoint FILE --key VKEY`."""
    verify.add_argument(
        "--checkpoint",
        default=None,
        help="also check that the log holds exactly the entries this signed checkpoint "
        "committed to (needs --key)",
    )
    verify.add_argument(
        "--key",
        action="append",
        default=None,
        help="the verifier key the checkpoint must be signed by (NAME+ID+KEY)",
    )


def _fail(message: str, code: int = EXIT_FAILED) -> int:
    print(f"gatewayd: {message}", file=sys.stderr)
    return code


def _verifiers(keys: list[str]) -> list[Verifier]:
    from gatewayd.audit.note import Verifier

    return [Verifier.from_string(key) for key in keys]


def _read_note(path: str | Path) -> str:
    with open(path, "rb") as file:
        data = file.read(MAX_CHECKPOINT_BYTES + 1)
    if len(data) > MAX_CHECKPOINT_BYTES:
        raise ValueError(f"{path} is over {MAX_CHECKPOINT_BYTES} bytes: not a checkpoint")
    return data.decode("utf-8")


def verify_checkpoint(args: argparse.Namespace) -> int:
    """The `--checkpoint` part of `audit verify`: prints the verdict, returns its exit."""
    from gatewayd.audit.note import NoteError
    from gatewayd.audit.proofs import verify_log_against

    if not args.key:
        return _fail("--checkpoint needs --key VKEY (the log's verifier key)", EXIT_USAGE)
    try:
        verifiers = _verifiers(args.key)
        note = _read_note(args.checkpoint)
    except NoteError as exc:
        return _fail(f"--key: {exc}", EXIT_USAGE)
    except (OSError, UnicodeDecodeError, ValueError) as exc:
        return _fail(f"cannot read the checkpoint {args.checkpoint}: {exc}")
    verdict = verify_log_against(_path(args.file), note, verifiers)
    for line in verdict.lines:
        print(line)
    return EXIT_OK if verdict.ok else EXIT_FAILED


def main(args: argparse.Namespace) -> int:
    """Run one of this module's commands."""
    return _COMMANDS[args.audit_command](args)


def _path(text: str) -> Path:
    from pathlib import Path  # here: `audit show|verify` start without it

    return Path(text)


def _keygen(args: argparse.Namespace) -> int:
    from gatewayd.audit.note import NoteError, generate_key

    name = args.name or _default_key_name()
    try:
        signer_key, verifier_key = generate_key(name)
    except NoteError as exc:
        return _fail(f"--name: {exc}", EXIT_USAGE)
    try:
        fd = os.open(
            args.out, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC | os.O_NOFOLLOW, 0o600
        )
    except FileExistsError:
        return _fail(f"{args.out} exists already; a key is never overwritten (remove it first)")
    except OSError as exc:
        return _fail(f"cannot create {args.out}: {exc.strerror}")
    try:
        os.write(fd, (signer_key + "\n").encode())
        os.fsync(fd)
    finally:
        os.close(fd)
    print(verifier_key)
    print(
        f"gatewayd: private key written to {args.out} (mode 0600); give the verifier key "
        "above to reviewers and witnesses; set audit_checkpoint_key to the file (outside "
        "the audit directory) or load it as the systemd credential audit-checkpoint-key",
        file=sys.stderr,
    )
    return EXIT_OK


def _checkpoint(args: argparse.Namespace) -> int:
    from gatewayd.audit.checkpointer import (
        CheckpointKeyError,
        CheckpointRefused,
        load_checkpoint_key,
    )
    from gatewayd.audit.ondemand import checkpoint_log

    try:
        signer = load_checkpoint_key(_path(args.key), _path(args.file))
    except CheckpointKeyError as exc:
        return _fail(str(exc))
    if signer is None:  # pragma: no cover - a path was given, so there is a key or an error
        return _fail("no checkpoint key")
    try:
        signed = checkpoint_log(_path(args.file), signer, fsync=not args.no_fsync)
    except CheckpointRefused as exc:
        return _fail(str(exc))
    sys.stdout.write(signed.note)
    return EXIT_OK


def _note_for(arg: str, log: Path) -> str:
    """A checkpoint named on the command line: a size of the history, or a file."""
    from gatewayd.audit.checkpointer import read_history

    if arg.isdigit():
        size = int(arg)
        for found, note in reversed(read_history(log)):
            if found == size:
                return note
        sizes = sorted({found for found, _ in read_history(log)})
        near = ", ".join(str(s) for s in sizes[-5:]) or "none"
        raise ValueError(
            f"no checkpoint of size {size} in the history of {log} (latest sizes: {near}); "
            "give a checkpoint file instead"
        )
    return _read_note(arg)


def _prove(args: argparse.Namespace) -> int:
    from gatewayd.audit.checkpointer import checkpoint_path
    from gatewayd.audit.proofs import consistency_bundle, inclusion_bundle

    if (len(args.operands) == 2) == (args.consistency is not None) or len(args.operands) > 2:
        return _fail("give either SEQ FILE or --consistency OLD NEW FILE", EXIT_USAGE)
    log = _path(args.file)
    try:
        args.seq = whole_number(args.operands[0]) if len(args.operands) == 2 else None
    except argparse.ArgumentTypeError as exc:
        return _fail(f"SEQ: {exc}", EXIT_USAGE)
    try:
        verifiers = _verifiers(args.key)
    except ValueError as exc:
        return _fail(f"--key: {exc}", EXIT_USAGE)
    try:
        if args.consistency is not None:
            old, new = (_note_for(arg, log) for arg in args.consistency)
            bundle = consistency_bundle(log, old, new, verifiers)
        else:
            note = _read_note(args.checkpoint or checkpoint_path(log))
            bundle = inclusion_bundle(log, args.seq, note, verifiers)
    except FileNotFoundError as exc:
        return _fail(f"no checkpoint at {exc.filename}: make one (gatewayd audit checkpoint)")
    except (ValueError, UnicodeDecodeError) as exc:
        return _fail(str(exc))
    print(json.dumps(bundle, indent=2, ensure_ascii=False))
    return EXIT_OK


def _verify_proof(args: argparse.Namespace) -> int:
    from gatewayd.audit.proofs import MAX_BUNDLE_BYTES, load_bundle, verify_bundle

    try:
        verifiers = _verifiers(args.key)
    except ValueError as exc:
        return _fail(f"--key: {exc}", EXIT_USAGE)
    try:
        source = sys.stdin.buffer if args.bundle == "-" else open(args.bundle, "rb")  # noqa: SIM115
        with source:
            data = source.read(MAX_BUNDLE_BYTES + 1)
    except OSError as exc:
        return _fail(f"cannot read {args.bundle}: {exc.strerror}")
    try:
        lines = verify_bundle(load_bundle(data), verifiers)
    except ValueError as exc:
        print(f"FAILED: the proof does not verify: {exc}")
        return EXIT_FAILED
    for line in lines:
        print(line)
    return EXIT_OK


_COMMANDS: Final = {
    "keygen": _keygen,
    "checkpoint": _checkpoint,
    "prove": _prove,
    "verify-proof": _verify_proof,
}
