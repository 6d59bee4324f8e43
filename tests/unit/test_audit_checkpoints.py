"""Signed checkpoints of the audit tree: the key's rules, when the checkpointer signs,
and the attacks a reviewer with a checkpoint catches offline (`gatewayd audit verify
--checkpoint`, `prove`, `verify-proof`): a log rewritten together with its head file
(the attack the hash chain cannot see), truncated, reordered, missing a segment, an old
checkpoint replayed, one byte flipped in a signature or a proof."""

from __future__ import annotations

import base64
import functools
import json
import os
import subprocess
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import trio

from gatewayd.audit import AuditEvent, open_audit_log
from gatewayd.audit.checkpoint import Checkpoint
from gatewayd.audit.checkpointer import (
    CREDENTIAL_NAME,
    Checkpointer,
    CheckpointKeyError,
    checkpoint_path,
    history_path,
    load_checkpoint_key,
    read_history,
)
from gatewayd.audit.cosignature import Cosigner, generate_cosigner_key
from gatewayd.audit.head import HeadRecord, encode_head, head_path
from gatewayd.audit.line import seal, unseal
from gatewayd.audit.merkle import leaf_hash
from gatewayd.audit.note import Signer, generate_key, open_note, parse_note, sign_note
from gatewayd.audit.segments import list_segments, log_files
from gatewayd.audit.treestore import tree_dir
from gatewayd.audit.witnessing import witnessed_path
from gatewayd.cli import main as cli_main

SEGMENT_BYTES = 2048
MARK = AuditEvent.EGRESS
# Long enough that only what a test asks for makes a checkpoint.
NEVER_S = 3600.0


@pytest.fixture(scope="module")
def keys() -> tuple[str, str]:
    return generate_key("test.example/audit")


def key_file(directory: Path, skey: str) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / "checkpoint.key"
    path.write_text(skey + "\n")
    path.chmod(0o600)
    return path


async def write_with_checkpoints(
    path: Path, signer: Signer, batches: list[int], *, max_bytes: int = SEGMENT_BYTES
) -> list[Checkpoint]:
    """Write ``batches`` of test entries, a checkpoint after each; returns them."""
    made: list[Checkpoint] = []
    async with open_audit_log(path, fsync=False, max_bytes=max_bytes) as log:
        checkpointer = Checkpointer(log, signer, fsync=False, delay_s=NEVER_S)
        for count in batches:
            for i in range(count):
                log.record("event", event=MARK, detail={"i": i})
            await log.durable(log.last_seq)
            await checkpointer._tree_reaches(log.last_seq)
            signed = await checkpointer.checkpoint()
            assert signed is not None
            made.append(signed.checkpoint)
    return made


@pytest.fixture
def log(tmp_path: Path, keys: tuple[str, str]) -> Path:
    """A rotated log of ~95 entries with checkpoints at sizes ~22, ~52, ~97 (the last
    one at close, after audit_close)."""
    path = tmp_path / "audit" / "audit.jsonl"
    trio.run(write_with_checkpoints, path, Signer.from_string(keys[0]), [20, 30, 40])
    return path


def cli(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    code = cli_main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


# -- rewriting the log as root would -------------------------------------------------------


def _reseal(raw: bytes, prev: str, change: Callable[[dict[str, Any]], None] | None) -> bytes:
    body, _ = unseal(raw)
    entry = json.loads(body)
    if change is not None:
        change(entry)
    if entry.get("event") == "segment_open":
        entry["detail"]["previousHash"] = prev
    entry["prev"] = prev
    line, _ = seal(json.dumps(entry, separators=(",", ":"), ensure_ascii=False).encode())
    return line


def rewrite(path: Path, transform: Callable[[list[bytes]], list[bytes]]) -> None:
    """Rewrite every file of the log as ``transform`` says (over all lines, seq order),
    renumber, re-chain and re-seal every entry, then write a matching head file: a
    history that `gatewayd audit verify` (the chain) finds intact."""
    files = log_files(path)
    per_file = [f.read_bytes().splitlines() for f in files]
    counts = [len(lines) for lines in per_file]
    lines = transform([line for lines in per_file for line in lines])
    prev = "0" * 64
    out: list[bytes] = []
    for seq, raw in enumerate(lines, 1):

        def renumber(entry: dict[str, Any], seq: int = seq) -> None:
            entry["seq"] = seq

        sealed = _reseal(raw, prev, renumber)
        prev = unseal(sealed[:-1])[1]
        out.append(sealed)
    # the same number of lines per file, the last file taking what is left
    start = 0
    for number, (file, count) in enumerate(zip(files, counts, strict=True)):
        end = len(out) if number == len(files) - 1 else start + count
        file.write_bytes(b"".join(out[start:end]))
        start = end
    active = files[-1]
    head = HeadRecord(
        seq=len(out), hash=prev, end=active.stat().st_size, lines=len(out[start - count :])
    )
    head_path(path).write_bytes(encode_head(head))


def change_detail(seq: int) -> Callable[[list[bytes]], list[bytes]]:
    def transform(lines: list[bytes]) -> list[bytes]:
        body, _ = unseal(lines[seq - 1])
        entry = json.loads(body)
        entry["detail"] = {"i": "forged"}
        lines[seq - 1] = json.dumps(entry, separators=(",", ":")).encode()[:-1] + (
            b',"hash":"' + b"0" * 64 + b'"}'
        )
        return lines

    return transform


# -- the key ------------------------------------------------------------------------------


def test_a_key_inside_the_audit_directory_is_refused(tmp_path: Path, keys: tuple[str, str]) -> None:
    audit = tmp_path / "audit" / "audit.jsonl"
    inside = key_file(tmp_path / "audit", keys[0])
    with pytest.raises(CheckpointKeyError, match="inside the audit directory") as caught:
        load_checkpoint_key(inside, audit)
    assert "keep it elsewhere" in str(caught.value)
    assert keys[0] not in str(caught.value)
    # through a symbolic link from outside
    link = tmp_path / "elsewhere.key"
    link.symlink_to(inside)
    with pytest.raises(CheckpointKeyError, match="inside the audit directory"):
        load_checkpoint_key(link, audit)
    # through a path that names the audit directory by another way
    (tmp_path / "alias").symlink_to(tmp_path / "audit")
    with pytest.raises(CheckpointKeyError, match="inside the audit directory"):
        load_checkpoint_key(tmp_path / "alias" / "checkpoint.key", audit)
    # deeper inside
    deeper = key_file(tmp_path / "audit" / "sub", keys[0])
    with pytest.raises(CheckpointKeyError, match="inside the audit directory"):
        load_checkpoint_key(deeper, audit)


def test_a_key_inside_the_audit_directory_through_a_bind_mount_is_refused(
    tmp_path: Path, keys: tuple[str, str]
) -> None:
    """The same directory under another name the path cannot show: a bind mount."""
    audit = tmp_path / "audit" / "audit.jsonl"
    key_file(tmp_path / "audit", keys[0])
    mirror = tmp_path / "mirror"
    mirror.mkdir()
    if subprocess.run(["mount", "--bind", str(audit.parent), str(mirror)], check=False).returncode:
        pytest.skip("bind mounts need CAP_SYS_ADMIN")
    try:
        with pytest.raises(CheckpointKeyError, match="inside the audit directory"):
            load_checkpoint_key(mirror / "checkpoint.key", audit)
    finally:
        subprocess.run(["umount", str(mirror)], check=True)


def test_a_credential_inside_the_audit_directory_is_refused(
    tmp_path: Path, keys: tuple[str, str]
) -> None:
    audit = tmp_path / "audit" / "audit.jsonl"
    creds = tmp_path / "audit" / "creds"
    creds.mkdir(parents=True)
    (creds / CREDENTIAL_NAME).write_text(keys[0])
    (creds / CREDENTIAL_NAME).chmod(0o600)
    with pytest.raises(CheckpointKeyError, match=f"the credential {CREDENTIAL_NAME}"):
        load_checkpoint_key(None, audit, {"CREDENTIALS_DIRECTORY": str(creds)})


def test_the_systemd_credential_is_read(tmp_path: Path, keys: tuple[str, str]) -> None:
    audit = tmp_path / "audit" / "audit.jsonl"
    creds = tmp_path / "creds"
    creds.mkdir()
    (creds / CREDENTIAL_NAME).write_text(keys[0] + "\n")
    (creds / CREDENTIAL_NAME).chmod(0o400)
    signer = load_checkpoint_key(None, audit, {"CREDENTIALS_DIRECTORY": str(creds)})
    assert signer is not None
    assert signer.verifier.to_string() == keys[1]
    assert load_checkpoint_key(None, audit, {}) is None
    assert load_checkpoint_key(None, audit, {"CREDENTIALS_DIRECTORY": str(tmp_path)}) is None


@pytest.mark.parametrize(
    ("setup", "message"),
    [
        ("group-readable", "can be read or written by group or others .mode 0640.; chmod 600"),
        ("not a key", "not a signer key made by `gatewayd audit keygen`"),
        ("a verifier key", "does not start with PRIVATE\\+KEY\\+"),
        ("a directory", "not a regular file"),
        ("missing", "cannot open the checkpoint key"),
        ("huge", "is over 4096 bytes"),
    ],
)
def test_unusable_keys_are_refused_with_the_reason(
    tmp_path: Path, keys: tuple[str, str], setup: str, message: str
) -> None:
    audit = tmp_path / "audit" / "audit.jsonl"
    path = key_file(tmp_path / "keys", keys[0])
    if setup == "group-readable":
        path.chmod(0o640)
    elif setup == "not a key":
        path.write_text("hello")
    elif setup == "a verifier key":
        path.write_text(keys[1])
    elif setup == "a directory":
        path.unlink()
        path.mkdir(mode=0o700)
    elif setup == "missing":
        path.unlink()
    elif setup == "huge":
        path.write_text("x" * 5000)
    with pytest.raises(CheckpointKeyError, match=message):
        load_checkpoint_key(path, audit)


# -- when checkpoints are made ----------------------------------------------------------------


def _latest(path: Path, vkey: str) -> Checkpoint:
    from gatewayd.audit.checkpoint import parse_checkpoint
    from gatewayd.audit.note import Verifier

    text, _ = open_note(checkpoint_path(path).read_text(), [Verifier.from_string(vkey)])
    return parse_checkpoint(text)


def test_checkpoints_at_start_after_new_entries_at_run_end_and_at_close(
    tmp_path: Path, keys: tuple[str, str]
) -> None:
    path = tmp_path / "audit" / "audit.jsonl"
    signer = Signer.from_string(keys[0])
    seen: list[tuple[str, Checkpoint]] = []

    async def main() -> None:
        async with open_audit_log(path, fsync=False) as log, trio.open_nursery() as nursery:
            checkpointer = Checkpointer(log, signer, fsync=False, delay_s=0.2)
            checkpointer.on_checkpoint.append(lambda note, cp: seen.append((note, cp)))
            await nursery.start(checkpointer.run, pytest.fail)
            assert _latest(path, keys[1]).size == log.durable_seq  # at start
            # within the delay after a new entry
            seq = await log.append("event", event=MARK, detail={"i": 1})
            started = time.monotonic()
            while _latest(path, keys[1]).size < seq:
                assert time.monotonic() - started < 1.0, "no checkpoint within a second"
                await trio.sleep(0.01)
            # at once after a run's end, even with a long delay
            checkpointer._delay_s = NEVER_S
            await trio.sleep(0.3)  # the loop is waiting again, now for an hour
            seq = await log.append("event", event=AuditEvent.RUN_ENDED, runId="r1")
            started = time.monotonic()
            while _latest(path, keys[1]).size < seq:
                assert time.monotonic() - started < 1.0, "no checkpoint at the run's end"
                await trio.sleep(0.01)
            nursery.cancel_scope.cancel()
        return None

    trio.run(main)
    # at close: the final checkpoint covers audit_close
    final = _latest(path, keys[1])
    last = json.loads(path.read_bytes().splitlines()[-1])
    assert last["event"] == "audit_close"
    assert final.size == last["seq"]
    # the hooks were told of each (on the trio thread; the close one is not a hook's)
    assert [cp.size for _, cp in seen] == sorted({cp.size for _, cp in seen})
    assert len(seen) >= 3
    # every checkpoint is in the history, each signed
    history = read_history(path)
    assert [size for size, _ in history][-1] == final.size
    for _, note in history:
        assert parse_note(note)[1][0].name == "test.example/audit"


def test_nothing_new_signs_nothing(log: Path, keys: tuple[str, str]) -> None:
    before = history_path(log).read_bytes()
    signer = Signer.from_string(keys[0])

    async def main() -> None:
        async with open_audit_log(log, fsync=False) as opened:
            checkpointer = Checkpointer(opened, signer, fsync=False, delay_s=NEVER_S)
            await checkpointer._tree_reaches(opened.durable_seq)
            assert await checkpointer.checkpoint() is not None  # audit_open is new
            assert await checkpointer.checkpoint() is None

    trio.run(main)
    assert history_path(log).read_bytes().startswith(before)


def test_the_checkpointer_refuses_to_sign_a_rewritten_history(
    log: Path, keys: tuple[str, str]
) -> None:
    old = _latest(log, keys[1])
    rewrite(log, change_detail(10))
    reports: list[str] = []

    async def main() -> None:
        async with open_audit_log(log, fsync=False) as opened, trio.open_nursery() as nursery:
            checkpointer = Checkpointer(opened, Signer.from_string(keys[0]), fsync=False)
            await nursery.start(checkpointer.run, reports.append)
            assert checkpointer.refused is not None
            await opened.append("event", event=MARK, detail={"i": "still logged"})
            nursery.cancel_scope.cancel()

    trio.run(main)
    assert len(reports) == 1
    assert "refusing to sign a checkpoint" in reports[0]
    assert f"not an extension of checkpoint {old.size}" in reports[0]
    assert _latest(log, keys[1]) == old  # nothing signed over the forgery


@pytest.mark.parametrize("latest", ["deleted", "an older one", "another key's"])
def test_the_refusal_does_not_hinge_on_the_latest_file(
    log: Path, keys: tuple[str, str], latest: str
) -> None:
    """Root rewrites an entry past the first checkpoint, then deletes the latest file,
    swaps in the first (older, validly signed) checkpoint, or one of another key: the
    history's records still hold the latest this key signed, and the daemon refuses."""
    history = read_history(log)
    first_size, first_note = history[0]
    newest = history[-1][0]
    rewrite(log, change_detail(first_size + 5))
    if latest == "deleted":
        checkpoint_path(log).unlink()
    elif latest == "an older one":
        checkpoint_path(log).write_text(first_note)
    else:
        other = Signer.from_string(generate_key("test.example/audit")[0])
        checkpoint_path(log).write_text(
            sign_note(Checkpoint(other.name, 1, b"\0" * 32).body(), [other])
        )
    reports: list[str] = []

    async def main() -> None:
        async with open_audit_log(log, fsync=False) as opened, trio.open_nursery() as nursery:
            checkpointer = Checkpointer(opened, Signer.from_string(keys[0]), fsync=False)
            await nursery.start(checkpointer.run, reports.append)
            nursery.cancel_scope.cancel()

    trio.run(main)
    assert len(reports) == 1, reports
    assert f"not an extension of checkpoint {newest}" in reports[0]
    assert max(size for size, _ in read_history(log)) == newest  # nothing signed since


# -- attacks, caught offline ----------------------------------------------------------------


def verify(
    capsys: pytest.CaptureFixture[str], log: Path, vkey: str, checkpoint: Path | None = None
) -> tuple[int, str]:
    code, out, err = cli(
        capsys,
        "audit",
        "verify",
        "--checkpoint",
        str(checkpoint or checkpoint_path(log)),
        "--key",
        vkey,
        str(log),
    )
    return code, out + err


def test_an_untouched_log_matches_its_checkpoint(
    log: Path, keys: tuple[str, str], capsys: pytest.CaptureFixture[str]
) -> None:
    code, out = verify(capsys, log, keys[1])
    assert code == 0, out
    assert "OK: the log's first" in out


def test_a_log_rewritten_with_its_head_is_caught_naming_the_first_diverging_entry(
    log: Path, keys: tuple[str, str], capsys: pytest.CaptureFixture[str]
) -> None:
    rewrite(log, change_detail(37))
    code, out, _ = cli(capsys, "audit", "verify", str(log))
    assert code == 0, "the chain alone cannot see this rewrite: " + out
    code, out = verify(capsys, log, keys[1])
    assert code == 1
    assert "FAILED: the log does not match checkpoint test.example/audit" in out
    assert "first diverging entry: seq 37 (audit.jsonl.0000" in out
    assert "the history was rewritten from there" in out


def test_a_rewrite_of_the_log_head_and_tree_is_still_caught(
    log: Path, keys: tuple[str, str], capsys: pytest.CaptureFixture[str]
) -> None:
    sizes = [size for size, _ in read_history(log)]
    rewrite(log, change_detail(sizes[1] + 3))
    for child in tree_dir(log).iterdir():
        child.unlink()  # root rebuilds the tree from the forged log
    trio.run(functools.partial(_reopen, log))
    code, out = verify(capsys, log, keys[1])
    assert code == 1
    assert f"the log still matches the signed checkpoint of size {sizes[1]}" in out
    assert f"between seq {sizes[1] + 1} and seq {sizes[2]}" in out


async def _reopen(path: Path) -> None:
    async with open_audit_log(path, fsync=False):
        pass


def test_a_truncated_log_is_caught(
    log: Path, keys: tuple[str, str], capsys: pytest.CaptureFixture[str]
) -> None:
    rewrite(log, lambda lines: lines[:-5])
    code, out = verify(capsys, log, keys[1])
    assert code == 1
    size = _latest(log, keys[1]).size
    assert f"first diverging entry: seq {size - 4}: the log ends at seq {size - 5}" in out
    assert "entries were cut off" in out


def test_reordered_entries_are_caught(
    log: Path, keys: tuple[str, str], capsys: pytest.CaptureFixture[str]
) -> None:
    def swap(lines: list[bytes]) -> list[bytes]:
        lines[29], lines[30] = lines[30], lines[29]
        return lines

    rewrite(log, swap)
    code, out = verify(capsys, log, keys[1])
    assert code == 1
    assert "first diverging entry: seq 30 " in out


def test_a_dropped_segment_is_caught(
    log: Path, keys: tuple[str, str], capsys: pytest.CaptureFixture[str]
) -> None:
    segments = list_segments(log)
    segments[1][1].unlink()
    code, out = verify(capsys, log, keys[1])
    assert code == 1
    assert "the log's entries are not whole" in out
    assert "are not in the log" in out
    assert "first diverging entry: seq" in out


def test_a_log_whose_oldest_segment_was_deleted_is_checked_from_the_store(
    log: Path, keys: tuple[str, str], capsys: pytest.CaptureFixture[str]
) -> None:
    """Retention deletes the oldest segments; the node store still holds their hashes,
    and the signed root authenticates it."""
    oldest = list_segments(log)[0][1]
    oldest.unlink()
    code, out = verify(capsys, log, keys[1])
    assert code == 3, out  # the chain's PARTIAL; the checkpoint matched
    assert "OK (partial): the log starts at seq" in out
    rewrite_from = int(json.loads(list_segments(log)[0][1].read_bytes().splitlines()[2])["seq"])

    def forge(lines: list[bytes]) -> list[bytes]:
        body, _ = unseal(lines[2])
        lines[2] = seal(body.replace(b'"i":', b'"j":'))[0][:-1]
        return lines

    segment = list_segments(log)[0][1]
    raw = segment.read_bytes().splitlines()
    raw = forge(raw)
    segment.write_bytes(b"\n".join(raw) + b"\n")
    code, out = verify(capsys, log, keys[1])
    assert code == 1
    assert f"first diverging entry: seq {rewrite_from} (" in out
    # without the store, the deleted part cannot be vouched for
    for child in tree_dir(log).iterdir():
        child.unlink()
    code, out = verify(capsys, log, keys[1])
    assert code == 1
    assert "does not hold the tree" in out


def test_a_doctored_store_cannot_vouch_for_a_rewrite_once_the_oldest_segment_is_gone(
    log: Path, keys: tuple[str, str], capsys: pytest.CaptureFixture[str]
) -> None:
    """Root deletes the oldest segment (so the check leans on the node store), rewrites
    an entry and re-chains everything after it, and writes the forged entry's hash
    into the store's leaves, leaving the upper levels (whose root the checkpoint
    signed) as they were. The store's leaves must be checked against the signed root
    themselves, not only the store's upper nodes."""
    list_segments(log)[0][1].unlink()
    files = log_files(log)
    per_file = [f.read_bytes().splitlines() for f in files]
    lines = [line for lines in per_file for line in lines]
    target = 2
    seq = int(json.loads(unseal(lines[target])[0])["seq"])
    prev = unseal(lines[target - 1])[1]
    out = [line + b"\n" for line in lines[:target]]

    def forge(entry: dict[str, Any]) -> None:
        entry["detail"] = {"i": "forged"}

    for number, raw in enumerate(lines[target:]):
        sealed = _reseal(raw, prev, forge if number == 0 else None)
        prev = unseal(sealed[:-1])[1]
        out.append(sealed)
    start = 0
    for file, count in zip(files, [len(one) for one in per_file], strict=True):
        file.write_bytes(b"".join(out[start : start + count]))
        start += count
    head = HeadRecord(
        seq=int(json.loads(unseal(out[-1][:-1])[0])["seq"]),
        hash=prev,
        end=files[-1].stat().st_size,
        lines=len(per_file[-1]),
    )
    head_path(log).write_bytes(encode_head(head))
    leaves = tree_dir(log) / "level-00"
    with leaves.open("r+b") as store:
        store.seek((seq - 1) * 32)
        store.write(b"".join(leaf_hash(line[:-1]) for line in out[target:]))
    code, text = verify(capsys, log, keys[1])
    assert "OK (partial)" not in text
    assert code == 1, text
    assert "does not hold the tree checkpoint test.example/audit size" in text


def test_witness_cosignatures_are_checked_on_a_log_whose_oldest_segment_was_deleted(
    log: Path, keys: tuple[str, str], capsys: pytest.CaptureFixture[str]
) -> None:
    """Retention deletes the oldest segment: a witness's cosigned checkpoint still
    matches (through the store's authenticated leaves), and a rewrite after that is
    still caught; not "the log holds 0 entries" for every retained log."""
    skey, wkey = generate_cosigner_key("witness.test/w")
    note = checkpoint_path(log).read_text()
    text, _ = parse_note(note)
    stored = witnessed_path(log, "witness.test/w")
    stored.parent.mkdir()
    stored.write_text(note + Cosigner.from_string(skey).cosign(text, 1_700_000_000))
    list_segments(log)[0][1].unlink()
    argv = ["audit", "verify", "--key", keys[1], "--witness", wkey, str(log)]
    code, out, err = cli(capsys, *argv)
    assert "OK: 1 of 1 witnesses cosigned a checkpoint the log matches (quorum 1)" in out, out + err
    segment = list_segments(log)[0][1]
    raw = segment.read_bytes().splitlines()
    body, _ = unseal(raw[2])
    raw[2] = seal(body.replace(b'"i":', b'"j":'))[0][:-1]
    segment.write_bytes(b"\n".join(raw) + b"\n")
    code, out, err = cli(capsys, *argv)
    assert code == 1
    assert "FAILED: 0 of 1 witnesses cosigned a checkpoint the log matches" in out
    assert "the log starts at seq" in out


def test_a_flipped_signature_byte_is_caught(
    log: Path, keys: tuple[str, str], capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    note = checkpoint_path(log).read_text()
    text, sigs = parse_note(note)
    raw = bytearray(sigs[0].signature)
    raw[7] ^= 0x01
    forged = tmp_path / "forged.checkpoint"
    forged.write_text(text + "\n" + type(sigs[0])(sigs[0].name, sigs[0].key_id, bytes(raw)).line())
    code, out = verify(capsys, log, keys[1], forged)
    assert code == 1
    assert "FAILED: the checkpoint does not verify: invalid signature for key" in out
    # a checkpoint signed by another key proves nothing
    code, out = verify(capsys, log, generate_key("test.example/audit")[1])
    assert code == 1
    assert "no signature by a known key" in out


def test_a_single_entry_with_its_proof_proves_the_call_without_the_log(
    log: Path, keys: tuple[str, str], capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    code, out, err = cli(capsys, "audit", "prove", "--key", keys[1], "12", str(log))
    assert code == 0, err
    bundle = tmp_path / "entry12.json"
    bundle.write_text(out)
    for file in log_files(log):
        file.unlink()  # the one who checks has no log
    code, out, _ = cli(capsys, "audit", "verify-proof", "--key", keys[1], str(bundle))
    assert code == 0, out
    assert "OK: entry seq 12 is in the log test.example/audit" in out
    assert '"seq":12' in out
    # flip one byte of a proof hash
    data = json.loads(bundle.read_text())
    proof0 = bytearray(base64.b64decode(data["proof"][0]))
    proof0[0] ^= 0x01
    data["proof"][0] = base64.b64encode(bytes(proof0)).decode()
    bundle.write_text(json.dumps(data))
    code, out, _ = cli(capsys, "audit", "verify-proof", "--key", keys[1], str(bundle))
    assert code == 1
    assert "FAILED: the proof does not verify: the inclusion proof of leaf 11 leads to root" in out


def test_an_entry_edited_in_a_bundle_is_caught(
    log: Path, keys: tuple[str, str], capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    code, out, _ = cli(capsys, "audit", "prove", "--key", keys[1], "5", str(log))
    data = json.loads(out)
    # a re-sealed edit: its own hash matches, so only the tree catches it
    body, _ = unseal(data["entry"].encode())
    data["entry"] = seal(body.replace(b'"i":', b'"j":'))[0][:-1].decode()
    bundle = tmp_path / "b.json"
    bundle.write_text(json.dumps(data))
    code, out, _ = cli(capsys, "audit", "verify-proof", "--key", keys[1], str(bundle))
    assert code == 1
    assert "leads to root" in out


def test_consistency_between_checkpoints_and_a_replayed_old_one(
    log: Path, keys: tuple[str, str], capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    sizes = [size for size, _ in read_history(log)]
    old, new = str(sizes[0]), str(sizes[-1])
    code, out, err = cli(
        capsys, "audit", "prove", "--key", keys[1], "--consistency", old, new, str(log)
    )
    assert code == 0, err
    bundle = tmp_path / "c.json"
    bundle.write_text(out)
    code, out, _ = cli(capsys, "audit", "verify-proof", "--key", keys[1], str(bundle))
    assert code == 0, out
    assert f"extends its checkpoint of size {old}" in out
    # the old checkpoint replayed as the newer one: refused both ways
    code, _, err = cli(
        capsys, "audit", "prove", "--key", keys[1], "--consistency", new, old, str(log)
    )
    assert code == 1
    assert f"from size {new} to size {old}" in err
    data = json.loads(bundle.read_text())
    data["old"], data["new"] = data["new"], data["old"]
    bundle.write_text(json.dumps(data))
    code, out, _ = cli(capsys, "audit", "verify-proof", "--key", keys[1], str(bundle))
    assert code == 1
    assert "a log never shrinks" in out
    # a flipped proof byte
    data["old"], data["new"] = data["new"], data["old"]
    proof = bytearray(base64.b64decode(data["proof"][-1]))
    proof[3] ^= 0x80
    data["proof"][-1] = base64.b64encode(bytes(proof)).decode()
    bundle.write_text(json.dumps(data))
    code, out, _ = cli(capsys, "audit", "verify-proof", "--key", keys[1], str(bundle))
    assert code == 1
    assert "the consistency proof does not lead to the" in out


# -- the commands' other errors ---------------------------------------------------------------


def test_keygen_writes_a_private_key_and_prints_the_verifier(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out_file = tmp_path / "k"
    code, out, err = cli(capsys, "audit", "keygen", "--name", "h.example/a", "--out", str(out_file))
    assert code == 0, err
    assert out.startswith("h.example/a+")
    assert os.stat(out_file).st_mode & 0o777 == 0o600
    signer = Signer.from_string(out_file.read_text())
    assert signer.verifier.to_string() == out.strip()
    code, _, err = cli(capsys, "audit", "keygen", "--out", str(out_file))
    assert code == 1
    assert "exists already; a key is never overwritten" in err
    code, _, err = cli(capsys, "audit", "keygen", "--name", "a b", "--out", str(tmp_path / "x"))
    assert code == 2
    assert "--name: key name 'a b' is empty or holds a space" in err


def test_checkpoint_on_demand_and_its_refusals(
    log: Path, keys: tuple[str, str], capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    key = key_file(tmp_path / "keys", keys[0])
    trio.run(functools.partial(_reopen, log))  # a few entries past the last checkpoint
    code, out, err = cli(capsys, "audit", "checkpoint", "--no-fsync", "--key", str(key), str(log))
    assert code == 0, err
    assert out == checkpoint_path(log).read_text()
    assert _latest(log, keys[1]).size == len(log_files_lines(log))
    # the daemon's checkpointer signs the same note for the same size
    assert read_history(log)[-1][1] == out
    inside = key_file(log.parent / "k", keys[0])
    code, _, err = cli(capsys, "audit", "checkpoint", "--key", str(inside), str(log))
    assert code == 1
    assert "inside the audit directory" in err
    rewrite(log, change_detail(3))
    code, _, err = cli(capsys, "audit", "checkpoint", "--no-fsync", "--key", str(key), str(log))
    assert code == 1
    assert "is not an extension of the checkpoint of size" in err


def log_files_lines(log: Path) -> list[bytes]:
    return [line for f in log_files(log) for line in f.read_bytes().splitlines()]


def test_prove_and_verify_errors_say_what_to_do(
    log: Path, keys: tuple[str, str], capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    size = _latest(log, keys[1]).size
    code, _, err = cli(capsys, "audit", "prove", "--key", keys[1], str(size + 1), str(log))
    assert code == 1
    assert f"seq {size + 1} is not covered by the checkpoint" in err
    code, _, err = cli(capsys, "audit", "prove", "--key", "garbage", "1", str(log))
    assert code == 2
    assert "--key: not a verifier key" in err
    code, _, err = cli(capsys, "audit", "prove", "--key", keys[1], str(log))
    assert code == 2
    assert "give either SEQ FILE or --consistency OLD NEW FILE" in err
    code, _, err = cli(
        capsys, "audit", "prove", "--key", keys[1], "--consistency", "1", "2", str(log)
    )
    assert code == 1
    assert "no checkpoint of size 1 in the history" in err
    checkpoint_path(log).unlink()
    code, _, err = cli(capsys, "audit", "prove", "--key", keys[1], "1", str(log))
    assert code == 1
    assert "no checkpoint at" in err
    assert "gatewayd audit checkpoint" in err
    code, _, err = cli(capsys, "audit", "verify", "--checkpoint", str(tmp_path / "x"), str(log))
    assert code == 2
    assert "--checkpoint needs --key" in err
    code, out = verify(capsys, log, keys[1], tmp_path / "missing")
    assert code == 1
    assert "cannot read the checkpoint" in out
    garbage = tmp_path / "g.json"
    for content, message in (
        ("not json", "the bundle is not JSON"),
        ("[]", "not a JSON object"),
        ('{"format": "x"}', "not a proof bundle"),
        ("x" * (1 << 21), "more than"),
    ):
        garbage.write_text(content)
        code, out, _ = cli(capsys, "audit", "verify-proof", "--key", keys[1], str(garbage))
        assert code == 1
        assert message in out


def test_a_failing_hook_or_a_foreign_checkpoint_stops_nothing(
    log: Path, keys: tuple[str, str]
) -> None:
    """A hook's bug is reported and checkpoints go on; a latest checkpoint signed by
    another key (a rotated key, or planted) is not this key's series: ignored."""
    other = Signer.from_string(generate_key("test.example/audit")[0])
    checkpoint_path(log).write_text(
        sign_note(Checkpoint(other.name, 1, b"\x00" * 32).body(), [other])
    )
    reports: list[str] = []

    def broken_hook(note: str, checkpoint: Checkpoint) -> None:
        raise RuntimeError("witness client bug")

    async def main() -> None:
        async with open_audit_log(log, fsync=False) as opened, trio.open_nursery() as nursery:
            checkpointer = Checkpointer(
                opened, Signer.from_string(keys[0]), fsync=False, delay_s=0.05
            )
            # the foreign note is ignored; this key's series goes on from its history
            assert checkpointer.latest is not None
            assert checkpointer.latest.note == read_history(log)[-1][1]
            checkpointer.on_checkpoint.append(broken_hook)
            await nursery.start(checkpointer.run, reports.append)
            seq = await opened.append("event", event=MARK, detail={"i": "after"})
            with trio.fail_after(5):
                while _latest(log, keys[1]).size < seq:
                    await trio.sleep(0.01)
            nursery.cancel_scope.cancel()

    trio.run(main)
    assert reports
    assert all("a checkpoint hook failed: RuntimeError('witness client bug')" in r for r in reports)


def test_a_tree_switched_off_under_the_checkpointer_stops_checkpoints_not_the_daemon(
    tmp_path: Path, keys: tuple[str, str]
) -> None:
    path = tmp_path / "audit" / "audit.jsonl"
    reports: list[str] = []

    async def main() -> None:
        async with open_audit_log(path, fsync=False) as opened, trio.open_nursery() as nursery:
            checkpointer = Checkpointer(
                opened, Signer.from_string(keys[0]), fsync=False, delay_s=0.02
            )
            await nursery.start(checkpointer.run, reports.append)
            tree = opened.tree
            assert tree is not None
            for fd in tree._fds:
                os.close(fd)
            tree._fds[:] = [os.open("/dev/null", os.O_RDONLY) for _ in tree._fds]
            for i in range(3):
                await opened.append("event", event=MARK, detail={"i": i})
                await trio.sleep(0.05)  # the checkpointer looks meanwhile
            assert opened.tree_failure is not None
            nursery.cancel_scope.cancel()

    trio.run(main)
    assert all("failed" in r for r in reports)
