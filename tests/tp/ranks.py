"""What the TP tests run on each rank (module-level, so spawned ranks can import it by name)."""

from __future__ import annotations

import contextlib
import os
import signal
import time

import torch

from mlaserve.attention.base import ForwardBatch, SeqChunk
from mlaserve.attention.torch_ref import TorchRefBackend
from mlaserve.config import ModelConfig
from mlaserve.distributed import tp
from mlaserve.distributed.tp import RankInfo
from mlaserve.layers.moe import ExpertsBase
from mlaserve.models import weights
from mlaserve.models.deepseek_v3 import DeepseekV3ForCausalLM

PAGE = 4
PAGES_PER_REQ = 6
DECODE_STEPS = 8


@contextlib.contextmanager
def count_reads():
    """Record (tensor name, elements, bytes) of every checkpoint read the loader makes."""
    reads = []
    init, getitem = weights._Tensor.__init__, weights._Tensor.__getitem__

    def counting_init(self, handle, name, *a, **kw):
        init(self, handle, name, *a, **kw)
        self.name = name

    def counting_getitem(self, idx):
        t = getitem(self, idx)
        reads.append((self.name, t.numel(), t.numel() * t.element_size()))
        return t

    weights._Tensor.__init__, weights._Tensor.__getitem__ = counting_init, counting_getitem
    try:
        yield reads
    finally:
        weights._Tensor.__init__, weights._Tensor.__getitem__ = init, getitem


def load(path: str, ranks: RankInfo, device: str = "cpu") -> tuple[DeepseekV3ForCausalLM, list]:
    cfg = ModelConfig.from_pretrained(path)
    model = DeepseekV3ForCausalLM(cfg, ranks=ranks)
    with count_reads() as reads:
        weights.load_weights(model, path, progress=False)
    return model.to(device), reads


def prompts(cfg: ModelConfig) -> list[list[int]]:
    g = torch.Generator().manual_seed(0)
    return [torch.randint(0, cfg.vocab_size, (n,), generator=g).tolist() for n in (5, 9, 3)]


def step_chunks(seqs, cached, pages, step):
    """(decode, prefill) lists of (request, SeqChunk) for `step`: step 0 prefills A and B's first chunk; step 1
    mixes A's decode with B's last chunk and C's prefill; then all three decode."""
    decode = [(i, SeqChunk(s[-1:], cached[i], pages[i])) for i, s in enumerate(seqs) if 0 < cached[i] == len(s) - 1]
    prefill = {
        0: [(0, SeqChunk(seqs[0], 0, pages[0])), (1, SeqChunk(seqs[1][:6], 0, pages[1], need_logits="none"))],
        1: [(1, SeqChunk(seqs[1][6:], 6, pages[1])), (2, SeqChunk(seqs[2], 0, pages[2]))],
    }.get(step, [])
    return decode, prefill


def greedy(model: DeepseekV3ForCausalLM, broadcast: bool = False):
    """Run the schedule greedily; returns (generated ids per request, logits per step [n, vocab]).

    With `broadcast`, rank 0 owns the schedule and sends each step's chunks over a StepChannel (what the engine
    does); the other ranks only follow. Without it, every rank derives the same steps."""
    from mlaserve.engine.step_broadcast import StepChannel

    cfg, device = model.config, model.lm_head.weight.device
    attn = TorchRefBackend(
        torch.zeros(cfg.num_hidden_layers, 18, PAGE, cfg.kv_cache_dim, device=device), cfg.kv_lora_rank
    )
    start = prompts(cfg)
    seqs, cached = [list(p) for p in start], [0] * len(start)
    pages = [[PAGES_PER_REQ * i + j for j in range(PAGES_PER_REQ)] for i in range(len(start))]  # 24 slots each
    all_logits = []
    channel = StepChannel(device, tp.group()) if broadcast else None
    for step in range(2 + DECODE_STEPS):
        if tp.rank_info().rank == 0 or not broadcast:
            decode, prefill = step_chunks(seqs, cached, pages, step)
            if broadcast:
                channel.send([c for _, c in decode], [c for _, c in prefill])
        else:  # a follower gets the chunks alone; a request's first page says which one it is
            decode, prefill = ([(c.pages[0] // PAGES_PER_REQ, c) for c in part] for part in channel.recv())
        batch = ForwardBatch.build([c for _, c in decode], [c for _, c in prefill], PAGE, device, attn)
        with torch.no_grad():
            logits = model.compute_logits(model(batch.input_ids, batch.positions, batch)[batch.logits_indices])
        all_logits.append(logits.cpu())
        for i, c in decode + prefill:
            cached[i] = c.num_cached + len(c.token_ids)
        for row, i in enumerate(i for i, c in decode + prefill if c.need_logits != "none"):
            seqs[i].append(int(logits[row].argmax()))
    return [s[len(p) :] for s, p in zip(seqs, start)], all_logits


# ---- targets: target(rank_info, *args), run on each rank by mlaserve.distributed.launch ------------------------
def parity(info: RankInfo, path: str, device: str = "cpu") -> dict:
    """Load this rank's shard and run the greedy schedule; report what was read and what came out."""
    model, reads = load(path, info, device)
    experts = next(m for m in model.modules() if isinstance(m, ExpertsBase))
    tokens, logits = greedy(model)
    return dict(
        tokens=tokens,
        logits=logits,
        read=sum(n for _, n, _ in reads),
        numel=sum(p.numel() for p in model.parameters()),
        read_bytes={name: b for name, _, b in reads},  # each tensor is read once
        held_bytes={n: p.numel() * p.element_size() for n, p in model.named_parameters()},
        experts_read=sorted({int(name.split(".")[5]) for name, _, _ in reads if ".experts." in name}),
        experts_owned=list(range(experts.expert_offset, experts.expert_offset + experts.num_local)),
    )


def follower(info: RankInfo, path: str) -> list[list[int]]:
    """A rank > 0 of the engine's shape: follow rank 0's broadcast steps, run the model, return the tokens."""
    model, _ = load(path, info)
    return greedy(model, broadcast=True)[0]


def crash(info: RankInfo, how: str) -> str:
    """Rank 1 fails after the first collective while rank 0 waits in the second."""
    tp.all_reduce(torch.ones(4))
    if info.rank == 1:
        if how == "raise":
            raise RuntimeError("rank 1 fails on purpose")
        if how == "kill":
            os.kill(os.getpid(), signal.SIGKILL)
        if how == "hang":
            time.sleep(60)
    tp.all_reduce(torch.ones(4))
    return "done"


def collectives(info: RankInfo) -> tuple:
    """Where this rank sits, a sum over ranks, and rank 0's broadcast."""
    total = tp.all_reduce(torch.tensor([float(info.rank + 1)]))
    return info.rank, info.moe_tp_rank, info.ep_rank, total.item(), tp.broadcast_object(f"from {info.rank}")


def _spread_rows(rank: int, rows: int = 300) -> torch.Tensor:
    """[rows, 64] bf16 of magnitudes 1e-3..1e3 (their sum depends on the order), the same for a rank every time."""
    g = torch.Generator().manual_seed(1234 + rank)
    return (torch.randn(rows, 64, generator=g) * 10.0 ** torch.randint(-3, 4, (rows, 64), generator=g)).bfloat16()


def ordered_all_reduce(info: RankInfo, sizes=(1, 7, 300)) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Deterministic mode's all-reduce of messages of the first 1, 7 and 300 rows of one tensor: (the result, the
    fp32 sum in rank order of every rank's rows, rounded once) per size."""
    tp.set_ordered_all_reduce(True)
    try:
        ref = torch.zeros(max(sizes), 64)
        for r in range(info.world_size):
            ref += _spread_rows(r).float()
        mine = _spread_rows(info.rank)
        return [(tp.all_reduce(mine[:n].clone()), ref[:n].bfloat16()) for n in sizes]
    finally:
        tp.set_ordered_all_reduce(False)


def progress_bar(info: RankInfo) -> int:
    """A tqdm bar on every rank, as the weight loader draws one."""
    from tqdm import tqdm

    for _ in tqdm(range(3), desc=f"rank {info.rank}"):
        pass
    return info.rank


def allreduce_fallback(info: RankInfo) -> tuple:
    """(symmetric memory installed, agreement when rank 1 cannot, agreement when all can, a sum over ranks)."""
    from mlaserve.distributed.allreduce import agree

    installed = tp.symm_all_reduce() is not None
    one_says_no = agree(info.rank != 1, tp.cpu_group())
    all_say_yes = agree(True, tp.cpu_group())
    return installed, one_says_no, all_say_yes, tp.all_reduce(torch.tensor([float(info.rank + 1)])).item()


def allreduce_vs_nccl(info: RankInfo, rows_list=(1, 8, 64, 300)) -> list[dict]:
    """Each forced symmetric-memory path against NCCL on fresh random inputs, eager and replayed from a CUDA graph:
    (path, dtype, rows, graph, bit-equal to NCCL, its error and NCCL's against the fp64 sum, the rounding bound, equal
    on every rank)."""
    import torch.distributed as dist

    from mlaserve.distributed.allreduce import AllReduceConfig, SymmMemAllReduce

    installed = tp.symm_all_reduce()
    assert installed is not None, "symmetric memory was not set up on this machine (see the log for why)"
    W, out = info.world_size, []
    torch.manual_seed(1234 + info.rank)  # every rank its own inputs
    for how in ("one_shot", "two_shot"):
        sym = SymmMemAllReduce(AllReduceConfig(backend=how), tp.group(), installed.buffer, W)
        for dtype, unit in ((torch.bfloat16, 2.0**-8), (torch.float32, 2.0**-24)):
            for rows in rows_list:
                if rows * 7168 * dtype.itemsize > sym.cfg.buffer_bytes(W):
                    continue  # past the buffer: NCCL's
                for graph in (False, True):
                    x = torch.randn(rows, 7168, device="cuda", dtype=dtype)
                    every = [torch.empty_like(x) for _ in range(W)]
                    dist.all_gather(every, x)
                    exact = torch.stack([e.double() for e in every]).sum(0)
                    bound = W * unit * torch.stack([e.double().abs() for e in every]).sum(0)
                    ref = x.clone()
                    dist.all_reduce(ref)
                    got = x.clone()
                    if graph:  # capture on a static buffer, then replay on new contents
                        static = torch.full_like(x, float("nan"))
                        sym.try_all_reduce(static)  # warm up outside capture
                        g = torch.cuda.CUDAGraph()
                        with torch.cuda.graph(g):
                            assert sym.try_all_reduce(static)
                        static.copy_(x)
                        g.replay()
                        got = static
                    else:
                        assert sym.try_all_reduce(got)
                    torch.cuda.synchronize()
                    gathered = [torch.empty_like(got) for _ in range(W)]
                    dist.all_gather(gathered, got)
                    out.append(
                        dict(
                            how=how,
                            dtype=str(dtype),
                            rows=rows,
                            graph=graph,
                            bit_equal=bool(torch.equal(got, ref)),
                            err=float((got.double() - exact).abs().sub(bound).max()),
                            nccl_err=float((ref.double() - exact).abs().sub(bound).max()),
                            same_on_all_ranks=all(torch.equal(g_, gathered[0]) for g_ in gathered),
                        )
                    )
    return out


def park(info: RankInfo) -> str:
    """Wait for rank 0's broadcast on the host group, as an idle engine rank does."""
    return f"rank {info.rank}: {tp.broadcast_object(None)}"
