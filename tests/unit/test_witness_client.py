"""gatewayd's witness client against a real witness served in this process on loopback
(the witness's own HTTP server over real sockets): resync on 409, a witness that is
ahead of the log, refusal then recovery (audited once each), a witness that cannot be
reached (retried, not audited), answers that are not cosignatures."""

from __future__ import annotations

import functools
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
import trio

from gatewayd.audit.checkpoint import Checkpoint, parse_checkpoint
from gatewayd.audit.cosignature import CosignatureVerifier, Cosigner, generate_cosigner_key
from gatewayd.audit.events import AuditEvent
from gatewayd.audit.merkle import consistency_proof, leaf_hash, leaves_source, root_from_hashes
from gatewayd.audit.note import Signer, generate_key, parse_note, sign_note
from gatewayd.audit.witness_wire import format_add_checkpoint
from gatewayd.audit.witnessing import (
    Health,
    WitnessClient,
    WitnessEndpoint,
    read_witnessed,
    witnessed_path,
)
from gatewayd.witness.server import WitnessServer
from gatewayd.witness.state import WitnessState
from gatewayd.witness.witness import Witness

ORIGIN = "client.test/log"
NAME = "client.test/w"


class Log:
    def __init__(self, signer: Signer) -> None:
        self.signer = signer
        self.hashes: list[bytes] = []

    def grow(self, count: int) -> tuple[str, Checkpoint]:
        self.hashes += [leaf_hash(f"e{len(self.hashes) + n}".encode()) for n in range(count)]
        checkpoint = Checkpoint(ORIGIN, len(self.hashes), root_from_hashes(self.hashes))
        return sign_note(checkpoint.body(), [self.signer]), checkpoint

    def prove(self, old: int, new: int) -> list[bytes]:
        return consistency_proof(old, new, leaves_source(self.hashes[:new]))


class Recorder:
    """Stands in for the audit log: keeps what would be recorded."""

    def __init__(self) -> None:
        self.entries: list[dict[str, Any]] = []

    def record(self, kind: str, **fields: Any) -> int:
        self.entries.append({"kind": kind, **fields})
        return len(self.entries)

    def events(self) -> list[tuple[str, str]]:
        return [(e["event"].value, e["detail"].get("reason", "")) for e in self.entries]


@pytest.fixture
def keys() -> tuple[Signer, Cosigner]:
    return Signer.from_string(generate_key(ORIGIN)[0]), Cosigner.from_string(
        generate_cosigner_key(NAME)[0]
    )


@pytest.fixture
async def served(
    tmp_path: Path, keys: tuple[Signer, Cosigner]
) -> AsyncIterator[tuple[Witness, str]]:
    signer, cosigner = keys
    state = WitnessState.open(tmp_path / "witness")
    witness = Witness(cosigner=cosigner, logs={ORIGIN: [signer.verifier]}, state=state)
    async with trio.open_nursery() as nursery:
        listeners = await trio.open_tcp_listeners(0, host="127.0.0.1")
        port = listeners[0].socket.getsockname()[1]
        nursery.start_soon(WitnessServer(witness).serve, listeners)
        yield witness, f"http://127.0.0.1:{port}"
        nursery.cancel_scope.cancel()
    state.close()


def client_for(
    url: str, log: Log, cosigner: Cosigner, tmp_path: Path, audit: Recorder
) -> WitnessClient:
    return WitnessClient(
        [WitnessEndpoint(NAME, url, cosigner.verifier)],
        log_path=tmp_path / "audit.jsonl",
        prove=log.prove,
        audit=audit,  # type: ignore[arg-type]
        timeout_s=5,
    )


async def settle(client: WitnessClient, want: Health, log_path: Path, size: int | None) -> None:
    with trio.fail_after(10):
        while True:
            stored = [
                parse_checkpoint(parse_note(text)[0]).size for _, text in read_witnessed(log_path)
            ]
            if client.health()[NAME] == want.value and (size is None or stored == [size]):
                return
            await trio.sleep(0.01)


async def test_it_resyncs_from_the_witness_size_and_stores_the_cosignature(
    served: tuple[Witness, str], keys: tuple[Signer, Cosigner], tmp_path: Path
) -> None:
    witness, url = served
    signer, cosigner = keys
    log = Log(signer)
    note, _ = log.grow(5)
    # the witness already cosigned size 5 (another gatewayd start, whose file is gone)
    assert witness.add_checkpoint(format_add_checkpoint(0, [], note)).status == 200
    audit = Recorder()
    client = client_for(url, log, cosigner, tmp_path, audit)
    async with trio.open_nursery() as nursery:
        nursery.start_soon(client.run)
        client.on_checkpoint(*log.grow(4))
        await settle(client, Health.OK, tmp_path / "audit.jsonl", 9)
        client.on_checkpoint(*log.grow(7))
        await settle(client, Health.OK, tmp_path / "audit.jsonl", 16)
        nursery.cancel_scope.cancel()
    stored = witnessed_path(tmp_path / "audit.jsonl", NAME).read_text()
    text, lines = parse_note(stored)
    assert [line.name for line in lines] == [ORIGIN, NAME]
    assert CosignatureVerifier.from_string(cosigner.verifier.to_string()).verify(
        text.encode(), lines[1].signature
    )
    assert audit.entries == []  # a 409 resync is routine: nothing audited


async def test_a_witness_ahead_of_the_log_is_refused_and_audited(
    served: tuple[Witness, str], keys: tuple[Signer, Cosigner], tmp_path: Path
) -> None:
    witness, url = served
    signer, cosigner = keys
    log = Log(signer)
    big, _ = Log(signer).grow(10)
    assert witness.add_checkpoint(format_add_checkpoint(0, [], big)).status == 200
    audit = Recorder()
    client = client_for(url, log, cosigner, tmp_path, audit)
    async with trio.open_nursery() as nursery:
        nursery.start_soon(client.run)
        client.on_checkpoint(*log.grow(3))
        await settle(client, Health.REFUSING, tmp_path / "audit.jsonl", None)
        nursery.cancel_scope.cancel()
    assert audit.events() == [(AuditEvent.WITNESS_REFUSED.value, "witness_ahead")]
    message = audit.entries[0]["safeMessage"]
    assert "has cosigned a tree of size 10 of this log, larger than its size now (3)" in message


async def test_a_rewrite_of_the_witness_size_is_audited_as_inconsistent(
    served: tuple[Witness, str], keys: tuple[Signer, Cosigner], tmp_path: Path
) -> None:
    """The witness cosigned size 4 of the honest history; the log (rewritten, re-signed)
    sends another tree of size 4: the witness's 409 carries no size but what differs,
    and the client audits it as an inconsistency, not a malformed answer."""
    witness, url = served
    signer, cosigner = keys
    honest, _ = Log(signer).grow(4)
    assert witness.add_checkpoint(format_add_checkpoint(0, [], honest)).status == 200
    log = Log(signer)
    log.hashes = [leaf_hash(b"rewritten")]
    note, checkpoint = log.grow(3)
    audit = Recorder()
    client = client_for(url, log, cosigner, tmp_path, audit)
    async with trio.open_nursery() as nursery:
        nursery.start_soon(client.run)
        client.on_checkpoint(note, checkpoint)
        await settle(client, Health.REFUSING, tmp_path / "audit.jsonl", None)
        nursery.cancel_scope.cancel()
    assert audit.events() == [(AuditEvent.WITNESS_REFUSED.value, "inconsistent")]
    assert audit.entries[0]["detail"]["status"] == 409
    assert "different roots" in audit.entries[0]["safeMessage"]


async def test_a_refusal_is_audited_once_then_the_recovery(
    served: tuple[Witness, str], keys: tuple[Signer, Cosigner], tmp_path: Path
) -> None:
    witness, url = served
    signer, cosigner = keys
    followed = witness.logs.pop(ORIGIN)  # the witness does not follow the log yet: 404
    log = Log(signer)
    audit = Recorder()
    client = client_for(url, log, cosigner, tmp_path, audit)
    async with trio.open_nursery() as nursery:
        nursery.start_soon(client.run)
        for _ in range(5):
            client.on_checkpoint(*log.grow(1))
            await settle(client, Health.REFUSING, tmp_path / "audit.jsonl", None)
            await trio.sleep(0.05)
        witness.logs[ORIGIN] = followed
        client.on_checkpoint(*log.grow(1))
        await settle(client, Health.OK, tmp_path / "audit.jsonl", 6)
        nursery.cancel_scope.cancel()
    assert audit.events() == [
        (AuditEvent.WITNESS_REFUSED.value, "refused"),
        (AuditEvent.WITNESS_RECOVERED.value, ""),
    ]
    assert audit.entries[0]["detail"]["status"] == 404


async def test_an_unreachable_witness_is_retried_and_not_audited(
    keys: tuple[Signer, Cosigner], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    signer, cosigner = keys
    monkeypatch.setattr("gatewayd.audit.witnessing.RETRY_FIRST_S", 0.05)
    listener = (await trio.open_tcp_listeners(0, host="127.0.0.1"))[0]
    port = listener.socket.getsockname()[1]
    await listener.aclose()  # nothing listens there now
    log = Log(signer)
    audit = Recorder()
    client = client_for(f"http://127.0.0.1:{port}", log, cosigner, tmp_path, audit)
    attempts: list[int] = []
    real_post = client._post

    def counting(*args: Any) -> tuple[int, bytes]:
        attempts.append(1)
        return real_post(*args)

    monkeypatch.setattr(client, "_post", counting)
    async with trio.open_nursery() as nursery:
        nursery.start_soon(client.run)
        client.on_checkpoint(*log.grow(2))  # one checkpoint only: retried on its own
        with trio.fail_after(10):
            while len(attempts) < 3:
                await trio.sleep(0.01)
        nursery.cancel_scope.cancel()
    assert client.health()[NAME] == Health.UNREACHABLE.value
    assert audit.entries == []


@pytest.mark.parametrize(
    ("body", "reason"),
    [
        (b"\xe2\x80\x94 client.test/w AAAAAAAA\n", "bad_cosignature"),  # another key's ID
        (b"not a signature line\n", "bad_answer"),
        (b"\xff\xfe", "bad_answer"),
    ],
)
async def test_an_answer_without_a_valid_cosignature_is_refused(
    keys: tuple[Signer, Cosigner], tmp_path: Path, body: bytes, reason: str
) -> None:
    signer, cosigner = keys
    log = Log(signer)

    async def liar(stream: trio.SocketStream) -> None:
        await stream.receive_some(65536)
        await stream.send_all(
            b"HTTP/1.1 200 OK\r\ncontent-length: %d\r\n\r\n%s" % (len(body), body)
        )

    audit = Recorder()
    async with trio.open_nursery() as nursery:
        [listener] = await nursery.start(
            functools.partial(trio.serve_tcp, liar, 0, host="127.0.0.1")
        )
        url = f"http://127.0.0.1:{listener.socket.getsockname()[1]}"
        client = client_for(url, log, cosigner, tmp_path, audit)
        nursery.start_soon(client.run)
        client.on_checkpoint(*log.grow(1))
        await settle(client, Health.REFUSING, tmp_path / "audit.jsonl", None)
        nursery.cancel_scope.cancel()
    assert audit.events() == [(AuditEvent.WITNESS_REFUSED.value, reason)]
    assert not witnessed_path(tmp_path / "audit.jsonl", NAME).exists()


async def test_trouble_of_its_own_is_retried_and_never_escapes(
    served: tuple[Witness, str],
    keys: tuple[Signer, Cosigner],
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The node store switched off (the proof cannot be made): the witness's task logs
    it and retries; nothing is raised into the daemon's nursery; once proofs work again
    the checkpoint is cosigned."""
    witness, url = served
    signer, cosigner = keys
    monkeypatch.setattr("gatewayd.audit.witnessing.RETRY_FIRST_S", 0.05)
    log = Log(signer)
    first, _ = log.grow(2)
    assert witness.add_checkpoint(format_add_checkpoint(0, [], first)).status == 200
    broken = [True]

    def prove(old: int, new: int) -> list[bytes]:
        if broken[0]:
            raise ValueError("the Merkle tree is off: writing it failed")
        return log.prove(old, new)

    audit = Recorder()
    client = WitnessClient(
        [WitnessEndpoint(NAME, url, cosigner.verifier)],
        log_path=tmp_path / "audit.jsonl",
        prove=prove,
        audit=audit,  # type: ignore[arg-type]
    )
    async with trio.open_nursery() as nursery:
        nursery.start_soon(client.run)
        client.on_checkpoint(*log.grow(3))
        await settle(client, Health.UNREACHABLE, tmp_path / "audit.jsonl", None)
        broken[0] = False
        await settle(client, Health.OK, tmp_path / "audit.jsonl", 5)
        nursery.cancel_scope.cancel()
    assert audit.entries == []


async def test_a_slow_or_idle_http_client_is_dropped(
    served: tuple[Witness, str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Slowloris: a request that does not arrive whole in time, and a keep-alive
    connection left idle, are closed; the witness goes on answering others."""
    _, url = served
    monkeypatch.setattr("gatewayd.witness.server.REQUEST_TIMEOUT_S", 0.2)
    monkeypatch.setattr("gatewayd.witness.server.IDLE_TIMEOUT_S", 0.2)
    port = int(url.rsplit(":", 1)[1])
    slow = await trio.open_tcp_stream("127.0.0.1", port)
    idle = await trio.open_tcp_stream("127.0.0.1", port)
    await slow.send_all(
        b"POST /add-checkpoint HTTP/1.1\r\nhost: x\r\ncontent-length: 100\r\n\r\nold"
    )
    with trio.fail_after(5):
        assert await slow.receive_some(1024) == b""  # closed, no answer
        assert await idle.receive_some(1024) == b""
    fresh = await trio.open_tcp_stream("127.0.0.1", port)
    await fresh.send_all(b"GET /nothing HTTP/1.1\r\nhost: x\r\n\r\n")
    with trio.fail_after(5):
        assert (await fresh.receive_some(1024)).startswith(b"HTTP/1.1 404")
    for stream in (slow, idle, fresh):
        await stream.aclose()
