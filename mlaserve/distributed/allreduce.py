"""Decode-sized all-reduce over NVLink: one-shot and two-shot over torch's symmetric memory (each rank loads its peers'
buffers directly; no NVLink multicast), NCCL for large messages and wherever symmetric memory cannot run.

One-shot: each rank copies its input into its symmetric buffer, meets the others at a signal-pad barrier and sums
every rank's buffer itself (one kernel; (W-1) x the message read over NVLink per rank): the fewest steps, for small
messages. Two-shot: each rank sums its 1/W slice of every buffer (reduce-scatter), then loads the others' sums
(all-gather): less traffic per rank, one more barrier, for mid-sized messages. Both add in rank order on every rank,
so all ranks get the same bits (the next layer's inputs must not drift apart between ranks). Both run inside CUDA
graph capture: the barriers reset their own flags, and the buffer's peer pointers are fixed at start.

`select` picks the path from message size, world size, dtype and layout: a pure function, pinned down by the CPU
tests. Every rank must pick the same path for the same call (different collectives deadlock), so everything it reads
is the same on every rank, and whether symmetric memory runs at all is agreed at start (`setup`).
"""

from __future__ import annotations

import logging
import warnings
from dataclasses import dataclass

import torch
import torch.distributed as dist

from ..kernel_config import ALLREDUCE_BACKENDS, KernelConfig

log = logging.getLogger("mlaserve.distributed")

KiB, MiB = 1 << 10, 1 << 20
BACKENDS = ALLREDUCE_BACKENDS
DTYPES = (torch.bfloat16, torch.float32)  # what torch's symmetric-memory reductions dispatch on
TWO_SHOT_WORLDS = (2, 4, 8)  # torch's two-shot kernel is instantiated for these world sizes only
ALIGN = 16  # bytes: the input's offset and size; the one-shot op needs the input and its buffer aligned alike


def _bytes(table: tuple[tuple[int, int], ...], world: int) -> int:
    return dict(table).get(world, 0)


@dataclass(frozen=True)
class AllReduceConfig:
    """Which all-reduce runs for which message, fixed at start (KernelConfig.allreduce: MLASERVE_ALLREDUCE, for A/B
    timing).

    The thresholds, bytes per world size, are public H100 measurements until benchmarks/allreduce_bench.py re-measures
    them on H200s: vLLM's custom all-reduce runs one-shot below 512 KB on up to 4 GPUs and below 256 KB on 8, two-shot
    above it, within its 8 MB buffer. A world size missing from a table never takes that path."""

    backend: str = "auto"  # auto: by the tables; nccl: NCCL only; one_shot / two_shot: that path up to the buffer
    one_shot_max_bytes: tuple[tuple[int, int], ...] = ((2, 512 * KiB), (4, 512 * KiB), (8, 256 * KiB))
    two_shot_max_bytes: tuple[tuple[int, int], ...] = ((2, 8 * MiB), (4, 8 * MiB), (8, 8 * MiB))
    eager: bool = True  # False: the symmetric-memory paths only inside CUDA graph capture

    def __post_init__(self):
        if self.backend not in BACKENDS:
            raise ValueError(f"all-reduce backend: must be one of {', '.join(BACKENDS)}, got {self.backend!r}")
        for name in ("one_shot_max_bytes", "two_shot_max_bytes"):
            for world, limit in getattr(self, name):
                if world < 2 or limit < 0:
                    raise ValueError(f"all-reduce {name}: ({world}, {limit}) needs a world >= 2 and bytes >= 0")

    @classmethod
    def from_kernels(cls, kernels: KernelConfig) -> AllReduceConfig:
        """The backend the kernel config names (MLASERVE_ALLREDUCE=auto|nccl|one_shot|two_shot, default auto)."""
        return cls(backend=kernels.allreduce)

    def buffer_bytes(self, world: int) -> int:
        """The symmetric buffer each rank allocates: the largest message a symmetric-memory path takes."""
        return max(_bytes(self.one_shot_max_bytes, world), _bytes(self.two_shot_max_bytes, world))

    def describe(self, world: int) -> str:
        one, two = _bytes(self.one_shot_max_bytes, world), _bytes(self.two_shot_max_bytes, world)
        if self.backend == "nccl" or not (one or two):
            return f"NCCL only (backend {self.backend}, world {world})"
        if self.backend != "auto":
            return f"{self.backend} up to {self.buffer_bytes(world) // KiB} KiB, NCCL above (world {world})"
        parts = [f"one-shot <= {one // KiB} KiB"] if one else []
        if two > one and world in TWO_SHOT_WORLDS:
            parts.append(f"two-shot <= {two // KiB} KiB")
        eager = "" if self.eager else ", inside CUDA graphs only"
        return f"{', '.join(parts)}, NCCL above (world {world}{eager})"


def select(
    cfg: AllReduceConfig,
    nbytes: int,
    world: int,
    dtype: torch.dtype,
    *,
    symm_ready: bool,
    aligned: bool,
    capturing: bool,
) -> str:
    """-> "one_shot" | "two_shot" | "nccl" (the process group's own all_reduce: NCCL, or gloo on the CPU).

    symm_ready: symmetric memory was set up on every rank (`setup`); aligned: the input is contiguous with its offset
    and size multiples of ALIGN bytes; capturing: a CUDA graph is being captured."""
    if not symm_ready or cfg.backend == "nccl" or world < 2 or (not capturing and not cfg.eager):
        return "nccl"
    if dtype not in DTYPES or not aligned or nbytes > cfg.buffer_bytes(world):
        return "nccl"
    two_ok = world in TWO_SHOT_WORLDS
    if cfg.backend == "one_shot":
        return "one_shot"
    if cfg.backend == "two_shot":
        return "two_shot" if two_ok else "nccl"
    if nbytes <= _bytes(cfg.one_shot_max_bytes, world):
        return "one_shot"
    if two_ok and nbytes <= _bytes(cfg.two_shot_max_bytes, world):
        return "two_shot"
    return "nccl"


def is_aligned(x: torch.Tensor) -> bool:
    size = x.element_size()
    return x.is_contiguous() and (x.storage_offset() * size) % ALIGN == 0 and (x.numel() * size) % ALIGN == 0


def agree(ok: bool, cpu_group) -> bool:
    """True only if every rank says ok (a MIN over the host group): all ranks take the same path or none does."""
    t = torch.tensor([int(ok)], dtype=torch.int32)
    dist.all_reduce(t, op=dist.ReduceOp.MIN, group=cpu_group)
    return bool(t.item())


def unavailable(cfg: AllReduceConfig, device: torch.device, world: int, nnodes: int) -> str | None:
    """Why this rank cannot run the symmetric-memory paths, or None."""
    if cfg.backend == "nccl":
        return "MLASERVE_ALLREDUCE=nccl"
    if not cfg.buffer_bytes(world):
        return f"no threshold for world size {world}"
    if nnodes > 1:
        return f"{nnodes} nodes: peers on other machines are not reachable by loads"
    if device.type != "cuda":
        return f"device {device.type}"
    if torch.cuda.get_device_capability(device) < (8, 0):
        return f"compute capability {torch.cuda.get_device_capability(device)} < (8, 0)"
    ops = getattr(torch.ops, "symm_mem", None)
    for op in ("one_shot_all_reduce_copy_out", "two_shot_all_reduce_out"):
        if ops is None or not hasattr(ops, op):
            return f"this torch ({torch.__version__}) has no torch.ops.symm_mem.{op}"
    index = device.index if device.index is not None else torch.cuda.current_device()
    for peer in range(world):  # one node: rank r uses GPU r
        if peer != index and not torch.cuda.can_device_access_peer(index, peer):
            return f"GPU {index} cannot access GPU {peer} (no peer-to-peer path)"
    return None


class SymmMemAllReduce:
    """One symmetric buffer per rank, rendezvoused over the model's process group; `try_all_reduce` runs the
    selected path in place, or says NCCL should."""

    def __init__(self, cfg: AllReduceConfig, group: dist.ProcessGroup, buffer: torch.Tensor, world: int):
        self.cfg, self.buffer, self.world = cfg, buffer, world
        self.group_name = group.group_name
        self.calls = {"one_shot": 0, "two_shot": 0, "nccl": 0}  # eager and captured calls, for tests and logs

    @classmethod
    def setup(
        cls,
        cfg: AllReduceConfig,
        group: dist.ProcessGroup,
        cpu_group,
        device: torch.device,
        world: int,
        nnodes: int = 1,
    ) -> SymmMemAllReduce | None:
        """Collective (every rank calls it at start): the buffer, or None (NCCL only) where any rank cannot."""
        why = unavailable(cfg, device, world, nnodes)
        if not agree(why is None, cpu_group):
            log.info("all-reduce: NCCL only (%s)", why or "another rank cannot use symmetric memory")
            return None
        buffer, why = None, None
        try:
            import torch.distributed._symmetric_memory as symm_mem

            with warnings.catch_warnings():  # required before torch 2.9, deprecated since
                warnings.simplefilter("ignore")
                if not symm_mem.is_symm_mem_enabled_for_group(group.group_name):
                    symm_mem.enable_symm_mem_for_group(group.group_name)
            buffer = symm_mem.empty(cfg.buffer_bytes(world), dtype=torch.uint8, device=device)
            symm_mem.rendezvous(buffer, group.group_name)
        except Exception as e:  # noqa: BLE001 - any failure means NCCL, agreed below
            why = f"{type(e).__name__}: {e}"
        if not agree(why is None, cpu_group):
            log.warning("all-reduce: NCCL only (symmetric memory setup failed: %s)", why or "on another rank")
            return None
        log.info("all-reduce: %s", cfg.describe(world))
        return cls(cfg, group, buffer, world)

    def try_all_reduce(self, x: torch.Tensor) -> bool:
        """Sum x over the ranks in place by the selected symmetric-memory path -> True; False: the caller runs NCCL."""
        capturing = x.is_cuda and torch.cuda.is_current_stream_capturing()
        how = select(
            self.cfg,
            x.numel() * x.element_size(),
            self.world,
            x.dtype,
            symm_ready=True,
            aligned=is_aligned(x),
            capturing=capturing,
        )
        self.calls[how] += 1
        if how == "nccl":
            return False
        buf = self.buffer.view(x.dtype)[: x.numel()].view(x.shape)  # this rank's symmetric buffer, x's shape
        if how == "one_shot":  # copy in, barrier, sum all ranks' buffers into x, barrier: one kernel
            torch.ops.symm_mem.one_shot_all_reduce_copy_out(buf, x, "sum", self.group_name, x)
        else:
            buf.copy_(x)
            torch.ops.symm_mem.two_shot_all_reduce_out(buf, "sum", self.group_name, x)
        return True
