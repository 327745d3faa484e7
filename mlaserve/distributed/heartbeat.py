"""Ranks on other machines are not node 0's child processes, so its watchdog cannot see them exit: each of them beats
on the rendezvous store, and node 0 reports a rank whose beat stops (its process died, or its machine did).

A beat is a counter bumped every BEAT_S seconds (no clocks compared across machines); node 0 declares a rank dead
once its counter has not moved for DEAD_AFTER_S seconds of node 0's clock.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

log = logging.getLogger("mlaserve.distributed")

BEAT_S = 2.0
DEAD_AFTER_S = 20.0  # well inside the 30 s a dead rank may go unnoticed; far above a beat thread's GIL waits


def _key(rank: int) -> str:
    return f"mlaserve/beat/{rank}"


def start_beating(store, rank: int) -> threading.Thread:
    """This rank beats until the store goes away (its group's teardown, or node 0's exit)."""

    def run():
        while True:
            try:
                store.add(_key(rank), 1)
            except Exception:  # noqa: BLE001 - the store is gone: nobody is watching any more
                return
            time.sleep(BEAT_S)

    t = threading.Thread(target=run, daemon=True, name=f"heartbeat-{rank}")
    t.start()
    return t


def watch_beats(
    store, ranks: list[int], on_dead: Callable[[int, float], None], stop: threading.Event
) -> threading.Thread:
    """Node 0: call on_dead(rank, seconds silent) once, for the first of `ranks` whose beat stops; until `stop`."""

    def run():
        seen = {r: (-1, time.monotonic()) for r in ranks}
        while not stop.wait(BEAT_S):
            now = time.monotonic()
            for r in ranks:
                try:
                    count = store.add(_key(r), 0)  # reads the counter without waiting for it to exist
                except Exception:  # noqa: BLE001 - the store is gone: this process is leaving the group
                    return
                last, since = seen[r]
                if count != last:
                    seen[r] = (count, now)
                elif now - since > DEAD_AFTER_S:
                    on_dead(r, now - since)
                    return

    t = threading.Thread(target=run, daemon=True, name="heartbeat-watch")
    t.start()
    return t
