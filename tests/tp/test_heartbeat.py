"""Ranks on another machine beat on the rendezvous store; node 0 reports one whose beat stops (here: node 1 is a
subprocess, its rank killed with SIGKILL) well within 30 s, and never while it beats."""

import os
import re
import signal
import subprocess
import sys
import time

from mlaserve.config import ParallelConfig
from mlaserve.distributed import heartbeat, tp
from mlaserve.distributed.launch import Workers
from mlaserve.distributed.rendezvous import free_port, init_rank, make_init_args, shutdown_rank

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
NODE1 = """
import logging, sys
logging.basicConfig(level=logging.INFO)
from mlaserve.config import ParallelConfig
from mlaserve.distributed.launch import launch
from tests.tp import ranks
if __name__ == "__main__":
    par = ParallelConfig(2, 2, 1, nnodes=2, node_rank=1, dist_init_addr=sys.argv[1])
    launch(par, ranks.park, timeout_s=120)
"""


def test_a_silent_rank_on_another_machine_is_reported(monkeypatch, tmp_path):
    monkeypatch.setattr(heartbeat, "DEAD_AFTER_S", 5.0)  # node 0's side; node 1 beats every BEAT_S (2 s)
    addr = f"127.0.0.1:{free_port()}"
    script, log = tmp_path / "node1.py", tmp_path / "node1.log"
    script.write_text(NODE1)
    with open(log, "w") as out:
        node1 = subprocess.Popen(
            [sys.executable, str(script), addr],
            stdout=out,
            stderr=subprocess.STDOUT,
            cwd=REPO,
            env={**os.environ, "PYTHONPATH": REPO},
        )
    par = ParallelConfig(2, 2, 1, nnodes=2, node_rank=0, dist_init_addr=addr, dist_init_timeout_s=120)
    workers = Workers(make_init_args(par), {}, {}, [])  # node 0 of this layout has no other local rank
    failures = []
    workers.on_failure = failures.append
    try:
        init_rank(0, make_init_args(par))
        workers.watch_remote(tp.store(), [1])
        time.sleep(8)  # longer than DEAD_AFTER_S: a beating rank is never reported
        assert failures == []
        pid = int(re.search(r"started rank 1 as pid (\d+)", log.read_text()).group(1))
        os.kill(pid, signal.SIGKILL)
        t0 = time.monotonic()
        while not failures and time.monotonic() - t0 < 30:
            time.sleep(0.1)
        assert time.monotonic() - t0 < heartbeat.DEAD_AFTER_S + 3 * heartbeat.BEAT_S
        assert [str(f) for f in failures] == [str(workers.failure)]
        assert re.fullmatch(
            r"rank 1 \(on another machine\) stopped answering: no heartbeat for \d+ s", str(failures[0])
        )
    finally:
        workers.close(timeout=0)
        shutdown_rank(2.0)
        node1.kill()
        node1.wait()
