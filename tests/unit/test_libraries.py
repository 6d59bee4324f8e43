"""gatewayd.libraries: the heavy libraries some tools use are imported in a worker thread,
once (what each list names is checked against the real libraries in
tests/integration/test_libraries_first_use.py).

The threads are checked with throwaway modules written to a temporary directory, each
recording the thread that executed it.
"""

from __future__ import annotations

import sys
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Final

import pytest
import trio

from gatewayd import libraries

# Executes slowly enough that a second importer arrives while the first is inside, and
# records every thread that executed it.
SLOW_MODULE: Final = """
import threading, time
EXECUTED_BY = []
EXECUTED_BY.append(threading.get_ident())
time.sleep(0.2)
"""


@pytest.fixture
def module_dir(tmp_path: Path) -> Iterator[Path]:
    """A directory on sys.path for throwaway modules; they leave sys.modules after."""
    sys.path.insert(0, str(tmp_path))
    before = set(sys.modules)
    try:
        yield tmp_path
    finally:
        sys.path.remove(str(tmp_path))
        for name in set(sys.modules) - before:
            if name.startswith("cg_lib_"):
                del sys.modules[name]
                libraries._loaded.discard(name)


def test_load_off_loop_imports_in_a_worker_thread_never_the_loop_s(module_dir: Path) -> None:
    (module_dir / "cg_lib_worker.py").write_text(SLOW_MODULE)
    loop_thread: list[int] = []

    async def main() -> None:
        loop_thread.append(threading.get_ident())
        await libraries.load_off_loop(["cg_lib_worker"])

    trio.run(main)
    executed_by = sys.modules["cg_lib_worker"].EXECUTED_BY
    assert len(executed_by) == 1
    assert executed_by[0] != loop_thread[0]
    assert libraries.loaded(["cg_lib_worker"])


def test_callers_that_meet_during_an_import_both_wait_for_its_one_execution(
    module_dir: Path,
) -> None:
    # A daemon's start loads a library while a first call already asks for it: the
    # call waits (in a worker thread of its own) for the one import under way.
    (module_dir / "cg_lib_shared.py").write_text(SLOW_MODULE)
    seen: list[bool] = []

    async def caller() -> None:
        await libraries.load_off_loop(["cg_lib_shared"])
        seen.append(libraries.loaded(["cg_lib_shared"]))

    async def main() -> None:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(caller)
            nursery.start_soon(caller)

    trio.run(main)
    assert seen == [True, True]
    assert len(sys.modules["cg_lib_shared"].EXECUTED_BY) == 1


def test_a_loaded_library_costs_no_thread_hop(
    module_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    (module_dir / "cg_lib_once.py").write_text("")
    libraries.load(["cg_lib_once"])

    def no_thread(*_args: object, **_kwargs: object) -> None:
        raise AssertionError("a loaded library went to a worker thread")

    monkeypatch.setattr(trio.to_thread, "run_sync", no_thread)
    trio.run(libraries.load_off_loop, ["cg_lib_once"])


def test_a_library_that_is_missing_raises_naming_it_and_is_not_taken_as_loaded(
    module_dir: Path,
) -> None:
    with pytest.raises(ModuleNotFoundError, match="No module named 'cg_lib_absent'"):
        trio.run(libraries.load_off_loop, ["cg_lib_absent"])
    assert not libraries.loaded(["cg_lib_absent"])


def test_a_library_that_fails_as_it_executes_raises_its_error_and_is_tried_again(
    module_dir: Path,
) -> None:
    # The names before it stay loaded; the failed one is imported anew next time (Python
    # drops a module whose execution raised), so a fixed library loads then.
    (module_dir / "cg_lib_good.py").write_text("")
    broken = module_dir / "cg_lib_broken.py"
    broken.write_text("raise RuntimeError('cg_lib_broken cannot start: no libfoo.so')\n")
    with pytest.raises(RuntimeError, match=r"cannot start: no libfoo\.so"):
        libraries.load(["cg_lib_good", "cg_lib_broken"])
    assert libraries.loaded(["cg_lib_good"])
    assert not libraries.loaded(["cg_lib_broken"])
    broken.write_text("")
    sys.path_importer_cache.clear()
    libraries.load(["cg_lib_broken"])
    assert libraries.loaded(["cg_lib_broken"])
