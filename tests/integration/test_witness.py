"""`gatewayd witness` as a real process on loopback, and gatewayd sending it its audit
log's checkpoints: it cosigns a growing log, refuses a rewritten history and an older
checkpoint, keeps its state across a restart and a kill -9 in the middle of its writes;
the daemon's witness client stores the cosignatures, audits a refusal once, and never
holds a call up; `gatewayd audit verify --witness ... --quorum K` counts them and fails
on a log rewritten (with its head) after the witnesses saw it."""

from __future__ import annotations

import contextlib
import functools
import hashlib
import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import msgspec
import pytest
import trio

from gatewayd.audit.checkpoint import Checkpoint
from gatewayd.audit.cosignature import CosignatureVerifier, Cosigner, generate_cosigner_key
from gatewayd.audit.entry import AuditEntry
from gatewayd.audit.head import HeadRecord, encode_head, head_path
from gatewayd.audit.line import GENESIS_HASH, seal, unseal
from gatewayd.audit.merkle import consistency_proof, leaf_hash, leaves_source, root_from_hashes
from gatewayd.audit.note import Signer, generate_key, parse_note, sign_note
from gatewayd.audit.witness_wire import format_add_checkpoint
from gatewayd.audit.witnessing import witnessed_dir, witnessed_path
from gatewayd.cli import main as gatewayd_main
from gatewayd.config import AuditWitness
from gatewayd.witness.state import EVIDENCE_DIR
from tests.conftest import make_gateway

ROOT = Path(__file__).resolve().parents[2]
STARTUP_TIMEOUT_S = 20.0
LOG_NAME = "gw.test/audit"
WITNESS_NAME = "witness.test/w1"


@dataclass(frozen=True)
class Keys:
    dir: Path
    log_signer: Signer
    log_key_file: Path
    witness_key_file: Path
    witness_vkey: str

    @property
    def log_vkey(self) -> str:
        return self.log_signer.verifier.to_string()


@pytest.fixture(scope="module")
def keys(tmp_path_factory: pytest.TempPathFactory) -> Keys:
    base = tmp_path_factory.mktemp("witness-keys")
    skey, _ = generate_key(LOG_NAME)
    log_key_file = base / "audit.key"
    log_key_file.write_text(skey + "\n")
    log_key_file.chmod(0o600)
    witness_key_file = base / "witness.key"
    result = run_cli("witness", "keygen", WITNESS_NAME, "--key-file", str(witness_key_file))
    assert result.returncode == 0, result.stderr
    return Keys(
        base, Signer.from_string(skey), log_key_file, witness_key_file, result.stdout.strip()
    )


def cli(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, str, str]:
    """`gatewayd ARGS` in this process (for commands that refuse before serving)."""
    code = gatewayd_main(list(args))
    out, err = capsys.readouterr()
    return code, out, err


def run_cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "gatewayd.cli", *args],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=ROOT,
    )


class WitnessProcess:
    """A `gatewayd witness serve` process on a free loopback port."""

    def __init__(
        self,
        keys: Keys,
        state_dir: Path,
        *,
        logs: list[str] | None = None,
        key_file: Path | None = None,
    ) -> None:
        self.keys = keys
        self.key_file = key_file or keys.witness_key_file
        self.state_dir = state_dir
        self.logs = logs if logs is not None else [keys.log_vkey]
        self.process: subprocess.Popen[str] | None = None
        self.address = ""
        self.lines: list[dict[str, Any]] = []

    def start(self) -> WitnessProcess:
        command = [
            sys.executable,
            "-m",
            "gatewayd.cli",
            "witness",
            "serve",
            "--key-file",
            str(self.key_file),
            "--state-dir",
            str(self.state_dir),
            "--listen",
            "127.0.0.1:0",
        ]
        for vkey in self.logs:
            command += ["--log", vkey]
        self.process = subprocess.Popen(
            command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT
        )
        deadline = time.monotonic() + STARTUP_TIMEOUT_S
        assert self.process.stdout is not None
        while time.monotonic() < deadline:
            line = self.process.stdout.readline()
            if not line:
                raise AssertionError(f"the witness exited: {self.process.communicate()[1]}")
            event = json.loads(line)
            if event.get("event") == "witness_listening":
                self.address = event["addresses"][0]
                threading.Thread(target=self._drain, daemon=True).start()
                return self
        raise AssertionError("the witness did not start listening")

    def _drain(self) -> None:
        assert self.process is not None and self.process.stdout is not None
        for line in self.process.stdout:
            with contextlib.suppress(ValueError):
                self.lines.append(json.loads(line))

    @property
    def url(self) -> str:
        return f"http://{self.address}"

    def add(self, body: bytes) -> httpx.Response:
        return httpx.post(f"{self.url}/add-checkpoint", content=body, timeout=10)

    def stop(self) -> int:
        assert self.process is not None
        self.process.send_signal(signal.SIGTERM)
        return self.process.wait(timeout=20)

    def kill9(self) -> None:
        assert self.process is not None
        self.process.kill()
        self.process.wait(timeout=20)


@pytest.fixture
def witness(keys: Keys, tmp_path: Path) -> Iterator[WitnessProcess]:
    process = WitnessProcess(keys, tmp_path / "witness-state").start()
    try:
        yield process
    finally:
        if process.process is not None and process.process.poll() is None:
            process.kill9()


class Log:
    """A log in memory, signed with the test log's key."""

    def __init__(self, signer: Signer, entries: list[bytes]) -> None:
        self.signer = signer
        self.hashes = [leaf_hash(e) for e in entries]

    def note(self, size: int | None = None) -> str:
        size = len(self.hashes) if size is None else size
        checkpoint = Checkpoint(self.signer.name, size, root_from_hashes(self.hashes[:size]))
        return sign_note(checkpoint.body(), [self.signer])

    def request(self, old: int, size: int | None = None) -> bytes:
        size = len(self.hashes) if size is None else size
        proof = [] if old in (0, size) else consistency_proof(old, size, leaves_source(self.hashes))
        return format_add_checkpoint(old, proof, self.note(size))


def witness_size(witness: WitnessProcess) -> int:
    """The size of the latest checkpoint of the test log the witness cosigned (0: none),
    from its monitoring route."""
    answer = httpx.get(f"{witness.url}/{hashlib.sha256(LOG_NAME.encode()).hexdigest()}/checkpoint")
    if answer.status_code == 404:
        return 0
    assert answer.status_code == 200, answer.text
    return int(answer.text.split("\n")[1])


# --- the witness process -------------------------------------------------------------------


def test_it_cosigns_a_growing_log_and_serves_the_latest(
    witness: WitnessProcess, keys: Keys
) -> None:
    verifier = CosignatureVerifier.from_string(keys.witness_vkey)
    entries = [f"entry {n}".encode() for n in range(40)]
    old = 0
    with httpx.Client(timeout=10) as client:  # one keep-alive connection for them all
        for size in (1, 2, 3, 7, 8, 9, 16, 17, 40):
            log = Log(keys.log_signer, entries[:size])
            answer = client.post(f"{witness.url}/add-checkpoint", content=log.request(old))
            assert answer.status_code == 200, answer.text
            text, _ = parse_note(log.note())
            _, [line] = parse_note(text + "\n" + answer.text)
            assert verifier.verify(text.encode(), line.signature)
            old = size
    served = httpx.get(f"{witness.url}/{hashlib.sha256(LOG_NAME.encode()).hexdigest()}/checkpoint")
    assert served.status_code == 200
    assert served.text.startswith(f"{LOG_NAME}\n40\n")


def test_it_refuses_a_rewritten_history(witness: WitnessProcess, keys: Keys) -> None:
    honest = Log(keys.log_signer, [b"a", b"b", b"c", b"d"])
    assert witness.add(honest.request(0)).status_code == 200
    # Root rewrote entry 2 and re-signed (the key is root's too): a tree the witness
    # never saw grow from the one it cosigned.
    rewritten = Log(keys.log_signer, [b"a", b"EDITED", b"c", b"d", b"e", b"f"])
    answer = witness.add(rewritten.request(4))
    assert answer.status_code == 422
    assert "not consistent with the checkpoint of size 4 this witness cosigned" in answer.text
    # reordering two entries, dropping one: each a different history
    for entries in ([b"b", b"a", b"c", b"d", b"e"], [b"a", b"c", b"d", b"e", b"f"]):
        assert witness.add(Log(keys.log_signer, entries).request(4)).status_code == 422
    assert witness_size(witness) == 4
    assert len(list((witness.state_dir / EVIDENCE_DIR).iterdir())) == 3
    time.sleep(0.2)
    assert any(line.get("event") == "witness_refused_inconsistent" for line in witness.lines)


def test_it_refuses_an_older_checkpoint_and_a_replayed_one(
    witness: WitnessProcess, keys: Keys
) -> None:
    log = Log(keys.log_signer, [f"{n}".encode() for n in range(10)])
    assert witness.add(log.request(0, 6)).status_code == 200
    assert witness.add(log.request(6, 10)).status_code == 200
    replay = witness.add(log.request(0, 6))  # the old checkpoint, as first sent
    assert (replay.status_code, replay.text) == (409, "10\n")
    assert replay.headers["content-type"] == "text/x.tlog.size"
    older = witness.add(format_add_checkpoint(10, [], log.note(6)))
    assert older.status_code == 400
    assert "old size 10 is larger than the checkpoint's size 6" in older.text
    assert witness_size(witness) == 10


def test_a_restart_keeps_its_state(witness: WitnessProcess, keys: Keys) -> None:
    log = Log(keys.log_signer, [b"a", b"b", b"c"])
    assert witness.add(log.request(0)).status_code == 200
    assert witness.stop() == 0
    again = WitnessProcess(keys, witness.state_dir).start()
    try:
        assert witness_size(again) == 3
        rewritten = Log(keys.log_signer, [b"a", b"X", b"c", b"d"])
        assert again.add(rewritten.request(3)).status_code == 422
        log.hashes.append(leaf_hash(b"d"))
        assert again.add(log.request(3)).status_code == 200
    finally:
        again.kill9()


def stream_checkpoints(
    url: str, log: Log, start: int, stop: threading.Event, sent: list[int], cosigned: list[int]
) -> None:
    """Send checkpoints one entry larger each, from ``start``, until stopped or refused."""
    old = start
    with httpx.Client(timeout=5) as client:
        while not stop.is_set() and old < len(log.hashes):
            size = old + 1
            sent.append(size)
            try:
                answer = client.post(f"{url}/add-checkpoint", content=log.request(old, size))
            except httpx.HTTPError:
                return
            if answer.status_code != 200:
                return
            cosigned.append(size)
            old = size


def test_kill_9_in_the_middle_of_its_writes_keeps_its_state(keys: Keys, tmp_path: Path) -> None:
    """Checkpoints stream in; the witness is killed at arbitrary moments. After each
    restart its record is whole (it starts), and it is at least the largest size it
    cosigned before the kill (durable before answering), at most the largest sent."""
    state = tmp_path / "state"
    entries = [f"e{n}".encode() for n in range(400)]
    log = Log(keys.log_signer, entries)
    known = 0
    for round_ in range(2):
        witness = WitnessProcess(keys, state).start()
        cosigned: list[int] = []
        sent: list[int] = [known]
        stop = threading.Event()

        thread = threading.Thread(
            target=stream_checkpoints, args=(witness.url, log, known, stop, sent, cosigned)
        )
        thread.start()
        time.sleep(0.15 + 0.1 * round_)
        witness.kill9()
        stop.set()
        thread.join(timeout=10)
        assert cosigned, "no checkpoint was cosigned before the kill"
        restarted = WitnessProcess(keys, state).start()
        try:
            size = witness_size(restarted)
        finally:
            restarted.kill9()
        assert max(cosigned) <= size <= max(sent)
        known = size


@pytest.mark.parametrize(
    ("args", "says"),
    [
        (["--log", "not-a-key"], "--log 'not-a-key'"),
        (["--listen", "localhost"], "expected HOST:PORT"),
    ],
)
def test_a_bad_option_refuses_the_start(
    keys: Keys, tmp_path: Path, capsys: pytest.CaptureFixture[str], args: list[str], says: str
) -> None:
    base = [
        "witness",
        "serve",
        "--key-file",
        str(keys.witness_key_file),
        "--state-dir",
        str(tmp_path),
    ]
    if "--log" not in args:
        base += ["--log", keys.log_vkey]
    code, _, err = cli(capsys, *base, *args)
    assert code == 1
    assert "gatewayd witness: refused to start:" in err and says in err


def test_a_key_others_can_read_or_no_key_refuses_the_start(
    keys: Keys, tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("CREDENTIALS_DIRECTORY", raising=False)
    loose = tmp_path / "loose.key"
    loose.write_text(keys.witness_key_file.read_text())
    loose.chmod(0o644)
    common = ["--state-dir", str(tmp_path / "s"), "--log", keys.log_vkey]
    code, _, err = cli(capsys, "witness", "serve", "--key-file", str(loose), *common)
    assert code == 1 and "(mode 0644): chmod 600 it" in err
    code, _, err = cli(capsys, "witness", "serve", *common)
    assert code == 1 and "no systemd credential witness-key" in err
    link = tmp_path / "link.key"
    link.symlink_to(keys.witness_key_file)
    code, _, err = cli(capsys, "witness", "serve", "--key-file", str(link), *common)
    assert code == 1 and "cannot open the witness key" in err
    not_a_key = tmp_path / "bad.key"
    not_a_key.write_text(keys.log_key_file.read_text().replace("PRIVATE+KEY+", "PRIVATE+KAY+"))
    not_a_key.chmod(0o600)
    code, _, err = cli(capsys, "witness", "serve", "--key-file", str(not_a_key), *common)
    assert code == 1 and "does not start with PRIVATE+KEY+" in err
    # the systemd credential, when no --key-file is given
    credentials = tmp_path / "credentials"
    credentials.mkdir()
    (credentials / "witness-key").write_text("PRIVATE+KEY+x+00000000+AAAA")
    (credentials / "witness-key").chmod(0o600)
    monkeypatch.setenv("CREDENTIALS_DIRECTORY", str(credentials))
    code, _, err = cli(capsys, "witness", "serve", *common)
    assert code == 1 and str(credentials / "witness-key") in err and "not an Ed25519" in err


def test_a_second_witness_on_the_same_state_is_refused(
    witness: WitnessProcess, keys: Keys, capsys: pytest.CaptureFixture[str]
) -> None:
    code, _, err = cli(
        capsys, "witness", "serve", "--key-file", str(keys.witness_key_file),
        "--state-dir", str(witness.state_dir), "--log", keys.log_vkey, "--listen", "127.0.0.1:0",
    )  # fmt: skip
    assert code == 1
    assert "in use by another witness" in err


def test_keygen_never_overwrites_a_key(keys: Keys, capsys: pytest.CaptureFixture[str]) -> None:
    before = keys.witness_key_file.read_text()
    code, _, err = cli(
        capsys, "witness", "keygen", WITNESS_NAME, "--key-file", str(keys.witness_key_file)
    )
    assert code == 1 and "never overwritten" in err
    assert keys.witness_key_file.read_text() == before
    assert keys.witness_key_file.stat().st_mode & 0o777 == 0o600
    code, _, err = cli(
        capsys, "witness", "keygen", "bad name", "--key-file", str(keys.dir / "x.key")
    )
    assert code == 2 and "holds a space" in err


def test_a_malformed_or_flooding_http_client_does_not_stop_it(
    witness: WitnessProcess, keys: Keys
) -> None:
    import socket

    with socket.create_connection(("127.0.0.1", int(witness.address.rsplit(":", 1)[1]))) as sock:
        sock.sendall(b"NOT HTTP AT ALL\r\n\r\n")
        assert sock.recv(1024).startswith(b"HTTP/1.1 400")
    big = httpx.post(f"{witness.url}/add-checkpoint", content=b"old 0\n\n" + b"x" * (200 * 1024))
    assert big.status_code == 413
    # idle connections held open do not keep others out
    idle = [
        socket.create_connection(("127.0.0.1", int(witness.address.rsplit(":", 1)[1])))
        for _ in range(20)
    ]
    try:
        assert witness.add(Log(keys.log_signer, [b"a"]).request(0)).status_code == 200
    finally:
        for sock in idle:
            sock.close()


# --- gatewayd's witness client and audit verify --witness --------------------------------------


def rewrite_log(log_path: Path, seq: int) -> None:
    """Edit entry ``seq`` and re-seal the chain and the head after it, as root would."""
    prev = GENESIS_HASH
    out = bytearray()
    count = 0
    for raw in log_path.read_bytes().splitlines():
        body, _ = unseal(raw)
        entry = msgspec.json.decode(body, type=AuditEntry)  # the writer's schema
        changes: dict[str, Any] = {"prev": prev}
        if entry.seq == seq:
            changes["detail"] = {"rewritten": True}
        line, prev = seal(msgspec.json.encode(msgspec.structs.replace(entry, **changes)))
        out += line
        count += 1
    log_path.write_bytes(bytes(out))
    head_path(log_path).write_bytes(encode_head(HeadRecord(count, prev, len(out), count)))


def stored_size(log_path: Path, name: str) -> int:
    """The size of the checkpoint a witness's stored cosigned note holds (0: none)."""
    path = witnessed_path(log_path, name)
    return int(path.read_text().split("\n")[1]) if path.exists() else 0


async def wait_for(path: Path, *, timeout_s: float = 15.0) -> None:
    with trio.fail_after(timeout_s):
        while not path.exists():
            await trio.sleep(0.05)


def verify(
    capsys: pytest.CaptureFixture[str], log_path: Path, keys: Keys, *extra: str
) -> tuple[int, str]:
    """`gatewayd audit verify --key LOG_KEY EXTRA LOG` (in this process): status, stdout."""
    code, out, _ = cli(capsys, "audit", "verify", "--key", keys.log_vkey, *extra, str(log_path))
    return code, out


async def test_the_daemon_sends_checkpoints_and_verify_counts_the_quorum(
    witness: WitnessProcess,
    keys: Keys,
    short_tmp: Path,
    workspace: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    # A second witness with its own key.
    second_key = short_tmp / "w2.key"
    skey, second_vkey = generate_cosigner_key("witness.test/w2")
    second_key.write_text(skey)
    second_key.chmod(0o600)
    second = WitnessProcess(keys, short_tmp / "w2-state", key_file=second_key).start()
    try:
        witnesses = (
            AuditWitness(name=WITNESS_NAME, url=witness.url, verifier_key=keys.witness_vkey),
            AuditWitness(name="witness.test/w2", url=second.url, verifier_key=second_vkey),
        )
        async with make_gateway(
            short_tmp, audit_checkpoint_key=keys.log_key_file, audit_witnesses=witnesses
        ) as gateway:
            log_path = gateway.audit_path
            await wait_for(witnessed_path(log_path, WITNESS_NAME))
            await wait_for(witnessed_path(log_path, "witness.test/w2"))
            run = await gateway.create_run(workspace)
            await gateway.daemon.runs.end(run.run_id, reason="test")
            # the run's end makes a checkpoint; both witnesses cosign it
            checkpointer = gateway.daemon.checkpointer
            assert checkpointer is not None
            with trio.fail_after(15):
                while True:
                    latest = checkpointer.latest
                    assert latest is not None
                    sizes = {
                        stored_size(log_path, name) for name in (WITNESS_NAME, "witness.test/w2")
                    }
                    if sizes == {latest.checkpoint.size} and latest.checkpoint.size > 3:
                        break
                    await trio.sleep(0.05)
        both = [f"--witness={keys.witness_vkey}", f"--witness={second_vkey}"]
        code, out = verify(capsys, log_path, keys, *both, "--quorum", "2")
        assert code == 0, out
        assert "OK: 2 of 2 witnesses cosigned a checkpoint the log matches (quorum 2)" in out
        # A witness whose cosignature is missing: 1 of 2 meets a quorum of 1, not of 2.
        (witnessed_dir(log_path) / witnessed_path(log_path, "witness.test/w2").name).unlink()
        assert verify(capsys, log_path, keys, *both, "--quorum", "1")[0] == 0
        code, out = verify(capsys, log_path, keys, *both, "--quorum", "2")
        assert code == 1
        assert "no valid cosignature matching the log from: witness.test/w2" in out
        # Root rewrites entry 3 and the head: the chain verifies, the witnesses do not.
        rewrite_log(log_path, 3)
        code, out = verify(capsys, log_path, keys, *both, "--quorum", "1")
        assert code == 1
        assert "the log does not match the checkpoint of size" in out
        assert f"that {WITNESS_NAME} cosigned" in out
        # and the witness refuses to cosign the rewritten history, re-signed by root
        entries = [line for line in log_path.read_bytes().splitlines()]
        forged = Log(keys.log_signer, entries)
        stored = witness_size(witness)
        proof = (
            consistency_proof(stored, len(entries), leaves_source(forged.hashes))
            if stored < len(entries)
            else []
        )
        answer = witness.add(format_add_checkpoint(stored, proof, forged.note()))
        # a longer rewrite fails its consistency proof (422); one of the witness's own
        # size has another root (409, C2SP tlog-witness)
        assert answer.status_code == (422 if stored < len(entries) else 409)
    finally:
        second.kill9()


async def test_a_tampered_stored_cosignature_fails_verify(
    witness: WitnessProcess, keys: Keys, short_tmp: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    witnesses = (AuditWitness(name=WITNESS_NAME, url=witness.url, verifier_key=keys.witness_vkey),)
    async with make_gateway(
        short_tmp, audit_checkpoint_key=keys.log_key_file, audit_witnesses=witnesses
    ) as gateway:
        log_path = gateway.audit_path
        await wait_for(witnessed_path(log_path, WITNESS_NAME))
    path = witnessed_path(log_path, WITNESS_NAME)
    text = path.read_text()
    signature = text.rstrip("\n").rsplit(" ", 1)[1]
    flipped = signature[:20] + ("A" if signature[20] != "A" else "B") + signature[21:]
    path.write_text(text.replace(signature, flipped))
    code, out = verify(capsys, log_path, keys, f"--witness={keys.witness_vkey}")
    assert code == 1
    assert "invalid signature for key witness.test/w1" in out


def test_verify_witness_usage_errors_say_what_to_do(
    keys: Keys, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    log_path = tmp_path / "audit.jsonl"
    log_path.write_bytes(b"")
    verify_ = ["audit", "verify", "--key", keys.log_vkey]
    code, _, err = cli(capsys, "audit", "verify", f"--witness={keys.witness_vkey}", str(log_path))
    assert code == 1 and "--witness needs --key VKEY" in err
    code, _, err = cli(
        capsys, *verify_, f"--witness={keys.witness_vkey}", "--quorum", "2", str(log_path)
    )
    assert "--quorum 2: must be between 1 and the number of --witness keys (1)" in err
    code, _, err = cli(capsys, *verify_, "--witness=nope", str(log_path))
    assert "--witness: witness verifier key: expected NAME+KEYID+BASE64" in err
    code, _, err = cli(
        capsys,
        *verify_,
        f"--witness={keys.witness_vkey}",
        f"--witness={keys.witness_vkey}",
        str(log_path),
    )
    assert "two keys of one witness name" in err
    renamed = CosignatureVerifier(
        "witness.test/alias", CosignatureVerifier.from_string(keys.witness_vkey).public_key
    ).to_string()
    code, _, err = cli(
        capsys,
        *verify_,
        f"--witness={keys.witness_vkey}",
        f"--witness={renamed}",
        "--quorum",
        "2",
        str(log_path),
    )
    assert code == 1
    assert "two names with one public key; that is one witness" in err


async def test_a_refusing_witness_is_audited_once_and_calls_never_wait(
    keys: Keys, short_tmp: Path
) -> None:
    """Three witnesses: one that does not follow this log (404), one whose configured
    key is not its key (its cosignatures do not verify), one that accepts connections
    and never answers. Entries keep flowing at full speed; each refusal is audited once
    however many checkpoints follow."""
    stranger = WitnessProcess(
        keys, short_tmp / "stranger", logs=[generate_key("other/log")[1]]
    ).start()
    hang_port: list[int] = []

    async def hang(stream: trio.SocketStream) -> None:
        await trio.sleep_forever()

    try:
        _, wrong_vkey = generate_cosigner_key(WITNESS_NAME)
        liar = WitnessProcess(keys, short_tmp / "liar").start()
        try:
            async with trio.open_nursery() as nursery:
                listeners = await nursery.start(
                    functools.partial(trio.serve_tcp, hang, 0, host="127.0.0.1")
                )
                hang_port.append(listeners[0].socket.getsockname()[1])
                witnesses = (
                    AuditWitness(
                        name="other.test/w",
                        url=stranger.url,
                        verifier_key=generate_cosigner_key("other.test/w")[1],
                    ),
                    AuditWitness(name=WITNESS_NAME, url=liar.url, verifier_key=wrong_vkey),
                    AuditWitness(
                        name="hang.test/w",
                        url=f"http://127.0.0.1:{hang_port[0]}",
                        verifier_key=generate_cosigner_key("hang.test/w")[1],
                    ),
                )
                async with make_gateway(
                    short_tmp, audit_checkpoint_key=keys.log_key_file, audit_witnesses=witnesses
                ) as gateway:
                    audit = gateway.daemon.audit
                    started = time.monotonic()
                    for _ in range(15):
                        await audit.append("event", event="config_reload_failed", safeMessage="t")
                        await trio.sleep(0.1)  # several checkpoints
                    elapsed = time.monotonic() - started
                    entries = await gateway.audit_entries()
                nursery.cancel_scope.cancel()
        finally:
            liar.kill9()
    finally:
        stranger.kill9()
    # 15 x 0.1 s of sleeping; waiting on the hanging witness would take its 10 s timeout
    assert elapsed < 6.0
    refused = [e for e in entries if e.get("event") == "witness_refused"]
    by_witness = {e["detail"]["witness"]: e for e in refused}
    assert len(refused) == 2, refused
    assert by_witness["other.test/w"]["detail"]["status"] == 404
    assert "unknown log" in by_witness["other.test/w"]["safeMessage"]
    assert by_witness[WITNESS_NAME]["detail"]["reason"] == "bad_cosignature"
    assert not witnessed_path(gateway.audit_path, WITNESS_NAME).exists()
    assert not os.path.exists(witnessed_path(gateway.audit_path, "hang.test/w"))


def test_cosigner_repr_hides_the_key(keys: Keys) -> None:
    cosigner = Cosigner.from_string(keys.witness_key_file.read_text())
    assert keys.witness_key_file.read_text().strip().rsplit("+", 1)[1] not in repr(cosigner)
