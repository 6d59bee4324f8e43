"""The uid pool's own records: no /proc scan per acquire or release, uids held by a
process at start skipped until a scan finds them free, a uid given back unchecked
looked at again before it is lent, and the records right under concurrent use."""

from __future__ import annotations

import os
import random
import threading

import pytest

from gatewayd.sandbox import uids as uids_module
from gatewayd.sandbox.limits import HostUser
from gatewayd.sandbox.uids import UidPool, UidPoolExhausted, UidRange, pids_of_uid

BASE = 1_690_500_000


class FakeScan:
    """Stands in for the /proc scan: reports ``busy``, counts its calls."""

    def __init__(self) -> None:
        self.busy: set[int] = set()
        self.count = 0

    def __call__(self) -> frozenset[int]:
        self.count += 1
        return frozenset(self.busy)


@pytest.fixture
def scans(monkeypatch: pytest.MonkeyPatch) -> FakeScan:
    fake = FakeScan()
    monkeypatch.setattr(uids_module, "uids_with_processes", fake)
    return fake


def test_acquire_and_release_scan_nothing_after_the_start_up_scan(
    scans: FakeScan,
) -> None:
    pool = UidPool(UidRange(BASE, 4))
    assert scans.count == 1  # the start-up scan
    for _ in range(100):
        pool.release(pool.acquire())
    users = [pool.acquire() for _ in range(4)]
    assert sorted(u.uid for u in users) == [BASE, BASE + 1, BASE + 2, BASE + 3]
    assert pool.in_use == 4
    for user in users:
        pool.release(user)
    assert scans.count == 1
    assert pool.scans == 0 and pool.in_use == 0


def test_uids_held_at_start_are_skipped_and_scanned_again_only_when_none_else_is_free(
    scans: FakeScan,
) -> None:
    scans.busy = {BASE, BASE + 2, 0}  # a crashed daemon's leftovers (and root)
    pool = UidPool(UidRange(BASE, 3))
    assert pool.held == {BASE, BASE + 2}
    only = pool.acquire()
    assert only.uid == BASE + 1 and pool.scans == 0
    # The leftover of BASE is gone by now (the start-up sweep killed it); BASE + 2's not.
    scans.busy = {BASE + 2}
    assert pool.acquire().uid == BASE  # the one scan, made once nothing else was free
    assert pool.scans == 1 and pool.held == {BASE + 2}
    with pytest.raises(UidPoolExhausted, match=rf"all 3 sandbox uids \({BASE}..{BASE + 2}\)"):
        pool.acquire()
    assert pool.scans == 2


def test_a_uid_given_back_unchecked_is_looked_at_before_it_is_lent_again(
    scans: FakeScan,
) -> None:
    pool = UidPool(UidRange(BASE, 1))
    probe = pool.acquire()
    pool.release(probe, processes_gone=False)  # its bwrap just exited
    scans.busy = {BASE}  # something of it is still dying
    with pytest.raises(UidPoolExhausted, match="in use by live runs or their processes"):
        pool.acquire()
    scans.busy = set()
    assert pool.acquire().uid == BASE
    assert pool.scans == 2


def test_a_lease_given_back_twice_never_frees_the_uid_lent_again_in_between(
    scans: FakeScan,
) -> None:
    # A failed start where two owners each give the uid back (the run manager as it
    # closes the sandbox, the agent loop in its own cleanup), with a third run taking the
    # uid between the two: the second release must not free the third's live lease.
    pool = UidPool(UidRange(BASE, 1))
    first = pool.acquire()
    pool.release(first)
    live = pool.acquire()
    assert live.uid == first.uid and live is not first
    pool.release(first)  # the stale second release
    assert pool.in_use == 1
    with pytest.raises(UidPoolExhausted):  # not lent to a second live run
        pool.acquire()
    # An equal but different object is not the lease either.
    pool.release(HostUser(uid=live.uid, gid=live.gid))
    assert pool.in_use == 1
    pool.release(live)
    assert pool.in_use == 0


def test_the_records_stay_right_under_concurrent_acquires_and_releases(
    scans: FakeScan,
) -> None:
    pool = UidPool(UidRange(BASE, 16))
    lent: set[int] = set()
    guard = threading.Lock()
    errors: list[str] = []

    def worker(seed: int) -> None:
        rng = random.Random(seed)
        mine: list[HostUser] = []
        for _ in range(2000):
            if mine and (rng.random() < 0.5 or len(mine) > 3):
                user = mine.pop(rng.randrange(len(mine)))
                with guard:
                    lent.discard(user.uid)
                pool.release(user)
                continue
            try:
                user = pool.acquire()
            except UidPoolExhausted:
                continue
            with guard:
                if user.uid in lent:
                    errors.append(f"uid {user.uid} lent twice")
                lent.add(user.uid)
            mine.append(user)
        for user in mine:
            with guard:
                lent.discard(user.uid)
            pool.release(user)

    threads = [threading.Thread(target=worker, args=(seed,)) for seed in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert errors == []
    assert pool.in_use == 0 and lent == set()
    assert scans.count == 1  # nothing held: exhaustion never needed a scan


def test_the_scan_finds_this_process_by_each_of_its_ids() -> None:
    # The real /proc: this process holds root (uid and gid 0); a uid nobody holds is empty.
    assert os.getpid() in pids_of_uid(os.getuid())
    assert os.getpid() in pids_of_uid(os.getgid())
    assert pids_of_uid(BASE + 12_345) == []
    assert 0 in uids_module.uids_with_processes()


@pytest.mark.parametrize(
    ("status", "expected"),
    [
        (
            b"Name:\tx\nState:\tS (sleeping)\nUid:\t1\t2\t3\t4\nGid:\t5\t6\t7\t8\nFDSize:\t64\n",
            {1, 2, 3, 4, 5, 6, 7, 8},
        ),
        (b"Name:\tx\nState:\tZ (zombie)\nUid:\t1\t1\t1\t1\nGid:\t1\t1\t1\t1\n", None),
        (b"Name:\tx\nState:\tR (running)\nUid:\t1\t1\t1\t1\n", None),  # cut short: ending
        (b"Name:\tx\nState:\tS (sleeping)\nUid:\tx\t1\t1\t1\nGid:\t1\t1\t1\t1\n", None),
    ],
)
def test_a_status_file_is_read_for_its_ids_and_zombies_left_out(
    status: bytes, expected: set[int] | None
) -> None:
    got = uids_module._ids_of(status)
    assert (None if got is None else set(got)) == expected


_STATUS = b"Name:\tx\nState:\tS (sleeping)\nTgid:\t77\nUid:\t10\t11\t12\t13\nGid:\t20\t21\t22\t23\nFDSize:\t64\n"


@pytest.mark.parametrize(
    ("status", "uid", "held"),
    [
        *((_STATUS, uid, True) for uid in (10, 11, 12, 13, 20, 21, 22, 23)),  # each id
        (_STATUS, 1, False),  # a prefix of an id
        (_STATUS, 0, False),  # a suffix of one
        (_STATUS, 77, False),  # another line's number
        (_STATUS, 64, False),
        (_STATUS.replace(b"S (sleeping)", b"Z (zombie)"), 10, False),
        (_STATUS[: _STATUS.index(b"\nGid:")], 10, False),  # cut short: ending
    ],
)
def test_the_ends_scan_finds_a_uid_only_as_a_whole_id_of_a_live_process(
    status: bytes, uid: int, held: bool
) -> None:
    assert uids_module._holds(status, (b"\t%d\t" % uid, b"\t%d\n" % uid)) is held


def test_the_ends_scan_agrees_with_the_parsed_ids_on_every_real_process() -> None:
    for _, status in uids_module._statuses():
        ids = uids_module._ids_of(status)
        for uid in {*(ids or ()), 1, 7, 65534, BASE + 12_345}:
            fields = (b"\t%d\t" % uid, b"\t%d\n" % uid)
            assert uids_module._holds(status, fields) is (ids is not None and uid in ids)


def test_the_ends_scan_agrees_with_the_parsed_ids_at_every_cut_and_digit_prefix() -> None:
    # A status file cut short at any byte (its process ending), and ids whose digits
    # are a prefix, a suffix or an extension of the uid's: held exactly as the full
    # parse says (a uid only as the saved or filesystem uid, or as a gid, included).
    status = (
        b"Name:\tx\nUmask:\t0022\nState:\tS (sleeping)\nTgid:\t1000\nPid:\t10000\n"
        b"Uid:\t0\t10000\t0\t100000\nGid:\t0\t0\t1000\t0\nFDSize:\t64\nGroups:\t1000 10000\n"
    )
    for cut in range(len(status) + 1):
        ids = uids_module._ids_of(status[:cut])
        for uid in (0, 1, 10, 100, 1000, 10000, 100000, 1000000):
            fields = (b"\t%d\t" % uid, b"\t%d\n" % uid)
            held = ids is not None and uid in ids
            assert uids_module._holds(status[:cut], fields) is held, (cut, uid)


def test_a_system_users_tree_is_no_sandboxs_without_reading_the_daemons_registry(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Most bases are root's: whether a sandbox owns one is known without the registry,
    # since no daemon's range may start below the system users. Above them it is read.
    from gatewayd.sandbox import session
    from gatewayd.sandbox.uids import below_every_range

    other = UidRange(5_000_000, 10)
    reads: list[str] = []

    def registry() -> list[UidRange]:
        reads.append("read")
        return [other]

    monkeypatch.setattr(session, "sandbox_uid_ranges", registry)
    with pytest.raises(ValueError, match="not usable"):
        UidRange(999, 1)
    assert below_every_range(999) and not below_every_range(1000)
    # The one check the session's lease and the overlay's base loan (BaseLender) share.
    asks = session.sandbox_owned(UidRange(BASE, 4))
    assert not asks(0) and not asks(999)
    assert reads == []
    assert asks(5_000_003) and not asks(1000) and asks(BASE + 3)
    assert reads == ["read"]  # once per lease, at the first uid above the system users
