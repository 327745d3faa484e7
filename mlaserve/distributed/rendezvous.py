"""Joining the ranks' world through torch.distributed's own rendezvous, and this process's tp state.

`make_init_args` turns a ParallelConfig (--dist-init-addr, one node or several) into picklable
InitArgs; `init_rank` is what every rank, spawned or not, calls to join.
"""

from __future__ import annotations

import logging
import socket
import threading
from dataclasses import dataclass
from datetime import timedelta
from urllib.parse import urlparse

import torch
import torch.distributed as dist

from ..config import ParallelConfig
from ..kernel_config import KernelConfig
from . import tp
from .allreduce import AllReduceConfig, SymmMemAllReduce
from .heartbeat import start_beating
from .tp import RankInfo

log = logging.getLogger("mlaserve.distributed")
# How long a rank waits for its process group's teardown. Live CUDA graphs with NCCL kernels in them block
# ncclCommDestroy, and an abort of the communicator too (pytorch/pytorch#115388), so every rank resets its graphs
# first (ModelRunner.release_graphs). Should anything else hold the communicator, a closing engine still must not
# wait forever: it leaves the rest to process exit.
TEARDOWN_TIMEOUT_S = 15.0


@dataclass(frozen=True)
class InitArgs:
    """Everything a rank needs to join the group; picklable, built once by `make_init_args`."""

    parallel: ParallelConfig
    init_method: str  # torch.distributed rendezvous: tcp://host:port, env://, file://...
    backend: str  # "gloo" (CPU) | "nccl" (CUDA)
    timeout_s: float = 600.0  # model collectives: a peer silent this long is an error
    # The metadata (gloo) group waits for the next step while the server is idle, so its timeout is long;
    # a dead peer still ends that wait at once (gloo sees the closed connection, the watchdogs the exit).
    metadata_timeout_s: float = 365 * 24 * 3600.0
    allreduce: AllReduceConfig = AllReduceConfig()  # the engine's KernelConfig.allreduce, fixed by make_init_args


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def make_init_args(
    par: ParallelConfig, device: str = "cpu", timeout_s: float = 600.0, allreduce: AllReduceConfig | None = None
) -> InitArgs:
    """--dist-init-addr "host:port" -> tcp://host:port (a full URL is used as given); one node without it
    meets on a free local port. allreduce: default the environment's (KernelConfig.from_env().allreduce)."""
    addr = par.dist_init_addr
    if addr is None:
        method = f"tcp://127.0.0.1:{free_port()}"
    else:
        method = addr if "://" in addr else f"tcp://{addr}"
    backend = "nccl" if torch.device(device).type == "cuda" else "gloo"
    return InitArgs(
        par, method, backend, timeout_s, allreduce=allreduce or AllReduceConfig.from_kernels(KernelConfig.from_env())
    )


def init_rank(local_rank: int, init: InitArgs) -> RankInfo:
    """Join the world as node_rank * local_world + local_rank; CUDA device = local rank. Sets tp's state."""
    par = init.parallel
    if not 0 <= local_rank < par.local_world_size:
        raise ValueError(f"local_rank must be in [0, {par.local_world_size}), got {local_rank}")
    info = par.rank_info(par.global_rank(local_rank))
    device_id = None
    if init.backend == "nccl":
        torch.cuda.set_device(local_rank)
        device_id = torch.device("cuda", local_rank)
    if par.world_size == 1:
        tp.set_group(None, info)
        return info
    if dist.is_initialized():
        raise RuntimeError(
            "this process still holds a process group whose teardown did not finish (see the warning "
            "logged when the last engine closed); start the next tensor-parallel engine in a new "
            "process"
        )
    store = _join(init, info.rank, device_id)
    if store is not None and par.node_rank > 0:
        start_beating(store, info.rank)  # node 0's watchdog cannot see this machine's processes: heartbeat.py
    cpu_group = dist.new_group(backend="gloo", timeout=timedelta(seconds=init.metadata_timeout_s))
    device = device_id or torch.device("cpu")
    symm = SymmMemAllReduce.setup(init.allreduce, dist.group.WORLD, cpu_group, device, par.world_size, par.nnodes)
    tp.set_group(dist.group.WORLD, info, cpu_group, symm, store)
    return info


def _join(init: InitArgs, rank: int, device_id):
    """init_process_group -> the rendezvous store, or None. A tcp:// rendezvous (--dist-init-addr host:port, or one
    node's free port) meets through a store built here, so that nobody answering ends in a TimeoutError that says so
    after --dist-init-timeout, rather than a wait as long as the collectives' timeout and torch's message."""
    par = init.parallel
    kw = dict(world_size=par.world_size, rank=rank, timeout=timedelta(seconds=init.timeout_s), device_id=device_id)
    if not init.init_method.startswith("tcp://"):
        dist.init_process_group(init.backend, init_method=init.init_method, **kw)
        return None
    url = urlparse(init.init_method)
    wait_s = par.dist_init_timeout_s
    try:
        store = dist.TCPStore(
            url.hostname,
            url.port,
            par.world_size,
            is_master=rank == 0,
            timeout=timedelta(seconds=wait_s),
            multi_tenant=True,
        )
    except (RuntimeError, TimeoutError) as e:  # DistStoreError, DistNetworkError
        addr = par.dist_init_addr or init.init_method
        if rank == 0:
            why = (
                f"not all {par.world_size} ranks joined rank 0 at {addr} within {wait_s:g} s: is every node started "
                "with the same --dist-init-addr, --nnodes and sizes, and can it reach this address?"
            )
        else:
            why = (
                f"rank {rank}: nobody answered at --dist-init-addr {addr} within {wait_s:g} s: is node 0 started, "
                "and is that host:port reachable from this machine?"
            )
        raise TimeoutError(f"{why} (--dist-init-timeout sets the wait)") from e
    store.set_timeout(timedelta(seconds=init.timeout_s))  # from here on, the collectives' timeout
    dist.init_process_group(init.backend, store=store, **kw)
    return store


def shutdown_rank(timeout_s: float = TEARDOWN_TIMEOUT_S) -> bool:
    """Leave the group and reset tp's state (to one rank) -> whether the group's teardown finished. It runs in a
    daemon thread waited on for timeout_s (TEARDOWN_TIMEOUT_S says why); one still running is left to process exit,
    and this process cannot join another group."""
    done = True
    tp.set_group(tp.group(), tp.rank_info(), tp.cpu_group())  # the symmetric buffer goes before its group
    if dist.is_initialized():
        t = threading.Thread(target=dist.destroy_process_group, name="process-group-teardown", daemon=True)
        t.start()
        t.join(timeout_s)
        done = not t.is_alive()
        if not done:
            log.warning(
                "the process group's teardown (torch.distributed.destroy_process_group) did not finish in "
                "%.0f s; leaving it to process exit (a known NCCL hang after CUDA graphs with all-reduces)",
                timeout_s,
            )
    tp.set_group(None, RankInfo())
    return done
