"""The parsed-policy cache: an unchanged file is not parsed again; any change to it is
seen, including edits that keep its size or put its modification time back, and a file
changed too recently to tell is never served from the cache. Real files throughout."""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest

from gatewayd import policyfile
from gatewayd.policy import Policy, PolicyError
from gatewayd.policyfile import FileStamp, PolicyCache, PolicyLoader
from tests.unit.test_policy_model import FULL

# Two policies of the same size: the name differs by one letter.
POLICY_A = "version: 1\nname: aaaa\ntools: {allow: [time.now]}\n"
POLICY_B = "version: 1\nname: bbbb\ntools: {allow: [time.now]}\n"


@pytest.fixture
def parses(monkeypatch: pytest.MonkeyPatch) -> list[Path]:
    """Every file the cache parses (through load_policy), in order."""
    seen: list[Path] = []
    real = policyfile.load_policy

    def counting(path: Path) -> Policy:
        seen.append(path)
        return real(path)

    monkeypatch.setattr(policyfile, "load_policy", counting)
    return seen


@pytest.fixture
def settled_at_once(monkeypatch: pytest.MonkeyPatch) -> None:
    """No racy window: a file is cached as soon as its times lie in the past."""
    monkeypatch.setattr(policyfile, "RACY_WINDOW_NS", 0)


def test_an_unchanged_file_is_parsed_once_and_the_same_policy_returned(
    tmp_path: Path, parses: list[Path], settled_at_once: None
) -> None:
    path = tmp_path / "p.yaml"
    path.write_text(POLICY_A)
    cache = PolicyCache()
    first = cache.load(path)
    assert first.name == "aaaa"
    assert all(cache.load(path) is first for _ in range(5))
    assert parses == [path]
    assert (cache.hits, cache.misses) == (5, 1)


def test_a_changed_file_is_read_again(
    tmp_path: Path, parses: list[Path], settled_at_once: None
) -> None:
    path = tmp_path / "p.yaml"
    path.write_text(POLICY_A)
    cache = PolicyCache()
    assert cache.load(path).name == "aaaa"
    path.write_text(FULL)  # another size
    assert cache.load(path).name == "full"
    assert cache.load(path).name == "full"
    assert parses == [path, path]


def test_a_same_size_edit_with_its_modification_time_put_back_is_seen(
    tmp_path: Path, parses: list[Path], settled_at_once: None
) -> None:
    path = tmp_path / "p.yaml"
    path.write_text(POLICY_A)
    before = os.stat(path)
    cache = PolicyCache()
    assert cache.load(path).name == "aaaa"
    path.write_text(POLICY_B)
    os.utime(path, ns=(before.st_atime_ns, before.st_mtime_ns))  # `touch -d` the old time
    after = os.stat(path)
    assert (after.st_size, after.st_mtime_ns) == (before.st_size, before.st_mtime_ns)
    # Only the change time, which no process can set back, tells the versions apart.
    assert after.st_ctime_ns != before.st_ctime_ns or after.st_ino != before.st_ino
    assert cache.load(path).name == "bbbb"
    assert len(parses) == 2


def test_a_same_size_edit_within_one_clock_tick_is_seen(tmp_path: Path, parses: list[Path]) -> None:
    # The real racy window: a file this fresh is never served from the cache, so a
    # second write in the same tick of the file system's clock (same size, same times)
    # is read like any other.
    path = tmp_path / "p.yaml"
    path.write_text(POLICY_A)
    cache = PolicyCache()
    assert cache.load(path).name == "aaaa"
    stamp = FileStamp.of(path)
    path.write_text(POLICY_B)
    if FileStamp.of(path) == stamp:  # the case the cache's key cannot see
        print("the two writes left the same stamp: the racy window alone caught it")
    assert cache.load(path).name == "bbbb"
    assert cache.load(path).name == "bbbb"
    assert len(parses) == 3  # each use of a fresh file parses it


def test_a_file_becomes_cacheable_once_older_than_the_racy_window(
    tmp_path: Path, parses: list[Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    path = tmp_path / "p.yaml"
    path.write_text(POLICY_A)
    stamp = FileStamp.of(path)
    assert stamp is not None
    assert not stamp.settled(time.time_ns())
    assert stamp.settled(max(stamp.mtime_ns, stamp.ctime_ns) + policyfile.RACY_WINDOW_NS + 1)
    later = max(stamp.mtime_ns, stamp.ctime_ns) + policyfile.RACY_WINDOW_NS + 1
    monkeypatch.setattr(time, "time_ns", lambda: later)
    cache = PolicyCache()
    cache.load(path)
    cache.load(path)
    assert len(parses) == 1


def test_a_file_replaced_by_a_rename_is_read_again(
    tmp_path: Path, parses: list[Path], settled_at_once: None
) -> None:
    path = tmp_path / "p.yaml"
    path.write_text(POLICY_A)
    cache = PolicyCache()
    assert cache.load(path).name == "aaaa"
    staged = tmp_path / "staged.yaml"
    staged.write_text(POLICY_B)
    os.utime(staged, ns=(os.stat(path).st_atime_ns, os.stat(path).st_mtime_ns))
    os.rename(staged, path)  # an editor's save: a new inode, same size and mtime
    assert cache.load(path).name == "bbbb"


def test_a_file_that_does_not_load_is_never_cached_and_fails_every_time(
    tmp_path: Path, parses: list[Path], settled_at_once: None
) -> None:
    path = tmp_path / "p.yaml"
    path.write_text("version: 1\nname: p\ntools: {allow: [Bad]}\n")
    cache = PolicyCache()
    for _ in range(2):
        with pytest.raises(PolicyError, match="is neither") as info:
            cache.load(path)
        assert info.value.source == str(path)
    assert len(parses) == 2
    with pytest.raises(PolicyError, match="No such file"):
        cache.load(tmp_path / "gone.yaml")


def test_a_fifo_is_refused_without_blocking_and_not_cached(
    tmp_path: Path, settled_at_once: None
) -> None:
    fifo = tmp_path / "p.yaml"
    os.mkfifo(fifo)
    assert FileStamp.of(fifo) is None
    with pytest.raises(PolicyError, match="must be a regular file, not a FIFO"):
        PolicyCache().load(fifo)


def test_the_cache_holds_at_most_its_bound_dropping_the_oldest(
    tmp_path: Path, parses: list[Path], settled_at_once: None
) -> None:
    cache = PolicyCache(max_entries=2)
    paths = []
    for i in range(3):
        path = tmp_path / f"p{i}.yaml"
        path.write_text(POLICY_A)
        paths.append(path)
        cache.load(path)
    cache.load(paths[2])
    cache.load(paths[1])
    assert len(parses) == 3  # the two newest were kept
    cache.load(paths[0])
    assert len(parses) == 4  # the oldest was dropped


def test_the_loader_serves_names_and_paths_from_its_cache(
    tmp_path: Path, parses: list[Path], settled_at_once: None
) -> None:
    (tmp_path / "aaaa.yaml").write_text(POLICY_A)
    loader = PolicyLoader((tmp_path,))
    by_name, source = loader.by_name("aaaa")
    assert source == str((tmp_path / "aaaa.yaml").resolve())
    assert loader.by_name("aaaa")[0] is by_name
    assert loader(str(tmp_path / "aaaa.yaml"))[0].name == "aaaa"
    assert loader.cache.hits == 2  # the same file by its name and by its path: one entry
    (tmp_path / "aaaa.yaml").write_text(POLICY_B)
    assert loader.by_name("aaaa")[0].name == "bbbb"
