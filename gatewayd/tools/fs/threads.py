"""How a file tool's blocking work runs in a worker thread (the daemon serves every run
on one trio loop): a call that changes nothing is abandoned on cancel, a write runs to
its end."""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

import trio

from gatewayd.errors import ToolFailed


def check_stop(stop: threading.Event | None) -> None:
    """End an abandoned read or list at its next step (nobody waits for the result)."""
    if stop is not None and stop.is_set():
        raise ToolFailed("the call was stopped (timed out or cancelled) before it finished")


async def in_thread_abandoned_on_cancel(
    call: Callable[[threading.Event], dict[str, Any]],
) -> dict[str, Any]:
    """Run a call that changes nothing (fs.read, fs.list, fs.stat) in a worker thread.

    A cancel (the run's call_timeout_s, the run ending) answers at once: the thread is
    abandoned (a thread cannot be interrupted), ``stop`` is set, and the read or list
    loop ends at its next chunk or entry; its result is dropped.
    """
    stop = threading.Event()
    try:
        return await trio.to_thread.run_sync(call, stop, abandon_on_cancel=True)
    finally:
        stop.set()


async def in_thread_to_completion(call: Callable[[], dict[str, Any]]) -> dict[str, Any]:
    """Run a call that writes (fs.write, fs.edit) in a worker thread, to its end.

    Not abandoned on cancel: a write that went on after the caller was told "stopped"
    would be an effect nobody knows of. A cancel that arrives once the thread has
    started waits for it, and the write's own result comes back, late (each write is
    bounded by the tool's size limits).
    """
    return await trio.to_thread.run_sync(call)
