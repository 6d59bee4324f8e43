"""`gatewayd witness serve|keygen`: a transparency-log witness (C2SP tlog-witness) of its
own, with its own key and state, for gatewayd's audit log or any log that signs C2SP
checkpoints with Ed25519 (docs/witness.md)."""

from __future__ import annotations

import argparse
import logging
import os
import signal
import stat
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Final

from gatewayd.cli.command import EXIT_FAILED, EXIT_OK, EXIT_USAGE

if TYPE_CHECKING:
    from gatewayd.audit.cosignature import Cosigner
    from gatewayd.audit.note import Verifier
    from gatewayd.cli.command import Subparsers

# The systemd credential the key is read from when --key-file is not given
# (LoadCredential=witness-key:/etc/gatewayd-witness/key in the unit).
KEY_CREDENTIAL: Final = "witness-key"
DEFAULT_LISTEN: Final = "127.0.0.1:7380"
# A key file is a line; anything bigger is not one (and is not read whole).
MAX_KEY_FILE_BYTES: Final = 4096


def add_parsers(sub: Subparsers) -> None:
    witness = sub.add_parser(
        "witness", help="run a transparency-log witness that cosigns consistent checkpoints"
    ).add_subparsers(dest="witness_command", required=True)
    serve = witness.add_parser(
        "serve", help="serve C2SP tlog-witness over HTTP (POST /add-checkpoint)"
    )
    serve.add_argument(
        "--key-file",
        type=Path,
        default=None,
        help=f"the witness's signing key (from `gatewayd witness keygen`); default: the "
        f"systemd credential {KEY_CREDENTIAL}",
    )
    serve.add_argument(
        "--state-dir",
        type=Path,
        required=True,
        help="where the latest cosigned checkpoint of each log is kept (one witness per directory)",
    )
    serve.add_argument(
        "--listen",
        action="append",
        default=None,
        help=f"HOST:PORT to listen on (repeatable; default {DEFAULT_LISTEN}; port 0 picks one)",
    )
    serve.add_argument(
        "--log",
        action="append",
        required=True,
        metavar="VKEY",
        help="a log to witness: its verifier key NAME+ID+KEY (the name is the log's "
        "origin, as `gatewayd audit keygen` prints it); repeat for more logs or keys",
    )
    keygen = witness.add_parser(
        "keygen", help="make a witness key pair; write the signing key, print the verifier key"
    )
    keygen.add_argument("name", help="the witness's name, e.g. witness.example.com/w1")
    keygen.add_argument(
        "--key-file",
        type=Path,
        required=True,
        help="where to write the signing key (created with mode 0600; never overwritten)",
    )


def main(args: argparse.Namespace) -> int:
    if args.witness_command == "keygen":
        return _keygen(args)
    return _serve(args)


def _keygen(args: argparse.Namespace) -> int:
    from gatewayd.audit.cosignature import CosignatureError, generate_cosigner_key

    try:
        skey, vkey = generate_cosigner_key(args.name)
    except CosignatureError as exc:
        print(f"gatewayd witness keygen: {exc}", file=sys.stderr)
        return EXIT_USAGE
    try:
        fd = os.open(args.key_file, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
    except OSError as exc:
        print(
            f"gatewayd witness keygen: cannot create {args.key_file}: {exc.strerror} (an "
            "existing key is never overwritten)",
            file=sys.stderr,
        )
        return EXIT_FAILED
    with os.fdopen(fd, "w") as out:
        out.write(skey + "\n")
        out.flush()
        os.fsync(out.fileno())
    print(vkey)
    return EXIT_OK


class WitnessStartRefused(Exception):
    """The witness cannot start; the message says why and what to do."""


def read_key(path: Path | None, environ: dict[str, str] | None = None) -> Cosigner:
    """The witness's signing key from ``path`` or the systemd credential.

    Error handling: WitnessStartRefused when there is none, it is readable by group or others, or
    it is not a witness key.
    """
    from gatewayd.audit.cosignature import CosignatureError, Cosigner

    env = os.environ if environ is None else environ
    if path is None:
        credentials = env.get("CREDENTIALS_DIRECTORY")
        if not credentials:
            raise WitnessStartRefused(
                f"no --key-file and no systemd credential {KEY_CREDENTIAL}; make a key with "
                "`gatewayd witness keygen NAME --key-file FILE`"
            )
        path = Path(credentials) / KEY_CREDENTIAL
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError as exc:
        raise WitnessStartRefused(f"cannot open the witness key {path}: {exc.strerror}") from None
    with os.fdopen(fd, "rb") as file:
        mode = os.fstat(file.fileno()).st_mode
        if not stat.S_ISREG(mode):
            raise WitnessStartRefused(f"the witness key {path} is not a regular file")
        if mode & 0o077:
            raise WitnessStartRefused(
                f"the witness key {path} is readable or writable by group or others (mode "
                f"{stat.S_IMODE(mode):04o}): chmod 600 it"
            )
        data = file.read(MAX_KEY_FILE_BYTES + 1)
    if len(data) > MAX_KEY_FILE_BYTES:
        raise WitnessStartRefused(
            f"the witness key {path} is over {MAX_KEY_FILE_BYTES} bytes: not a key"
        )
    try:
        return Cosigner.from_string(data.decode())
    except (CosignatureError, UnicodeDecodeError) as exc:
        raise WitnessStartRefused(f"the witness key {path}: {exc}") from None


def parse_logs(vkeys: list[str]) -> dict[str, list[Verifier]]:
    """Origin -> the log's trusted keys, from ``--log`` verifier keys.

    Error handling: WitnessStartRefused naming the key that is not one.
    """
    from gatewayd.audit.note import NoteError, Verifier

    logs: dict[str, list[Verifier]] = {}
    for vkey in vkeys:
        try:
            verifier = Verifier.from_string(vkey)
        except NoteError as exc:
            raise WitnessStartRefused(f"--log {vkey[:60]!r}: {exc}") from None
        logs.setdefault(verifier.name, []).append(verifier)
    return logs


def parse_listen(text: str) -> tuple[str, int]:
    """``HOST:PORT`` or ``[IPv6]:PORT``.

    Error handling: WitnessStartRefused saying the expected form.
    """
    host, colon, port = text.rpartition(":")
    host = host.removeprefix("[").removesuffix("]")
    if not colon or not host or not port.isdigit() or int(port) > 65535:
        raise WitnessStartRefused(f"--listen {text!r}: expected HOST:PORT, e.g. {DEFAULT_LISTEN}")
    return host, int(port)


def _serve(args: argparse.Namespace) -> int:
    import structlog
    import trio

    from gatewayd.logs import configure_logging
    from gatewayd.sdnotify import notify
    from gatewayd.witness.server import WitnessServer
    from gatewayd.witness.state import WitnessState, WitnessStateError
    from gatewayd.witness.witness import Witness

    try:
        cosigner = read_key(args.key_file)
        logs = parse_logs(args.log)
        addresses = [parse_listen(one) for one in (args.listen or [DEFAULT_LISTEN])]
        state = WitnessState.open(args.state_dir)
    except (WitnessStartRefused, WitnessStateError) as exc:
        print(f"gatewayd witness: refused to start: {exc}", file=sys.stderr)
        return EXIT_FAILED
    # JSON lines on stdout (journald's under systemd), as `gatewayd serve`.
    configure_logging(logging.INFO, stream=sys.stdout)
    log = structlog.get_logger("gatewayd.witness")
    witness = Witness(cosigner=cosigner, logs=logs, state=state)

    async def serve() -> None:
        listeners: list[trio.SocketListener] = []
        for host, port in addresses:
            listeners += await trio.open_tcp_listeners(port, host=host)
        bound = ["{}:{}".format(*listener.socket.getsockname()[:2]) for listener in listeners]
        async with trio.open_nursery() as nursery:
            nursery.start_soon(WitnessServer(witness).serve, listeners)
            log.info(
                "witness_listening",
                addresses=bound,
                witness=cosigner.verifier.to_string(),
                logs=sorted(logs),
                state_dir=str(args.state_dir),
            )
            with trio.open_signal_receiver(signal.SIGTERM, signal.SIGINT) as signals:
                notify(f"READY=1\nSTATUS=witnessing {len(logs)} log(s) on {', '.join(bound)}")
                async for _ in signals:
                    break
            notify("STOPPING=1")
            nursery.cancel_scope.cancel()

    try:
        trio.run(serve)
    except OSError as exc:
        print(f"gatewayd witness: refused to start: cannot listen: {exc}", file=sys.stderr)
        return EXIT_FAILED
    finally:
        state.close()
    return EXIT_OK
