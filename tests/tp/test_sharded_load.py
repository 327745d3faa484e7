"""Each rank reads only its own shard from the safetensors files (in one process: loading needs no peers)."""

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from mlaserve.config import ParallelConfig
from mlaserve.distributed.tp import RankInfo
from mlaserve.layers.quant import dequant_fp8_block
from mlaserve.models.weights import _Tensor
from tests.model import ckpt_edit

from .ranks import load

LAYOUTS = [(2, 2, 1), (2, 1, 2), (4, 2, 2), (4, 1, 4)]


def shard_loads(path: str, sizes):
    par = ParallelConfig(*sizes)
    for rank in range(par.world_size):
        info = par.rank_info(rank)
        model, reads = load(path, info)
        yield info, model, reads


def expert_ids(reads) -> list[int]:
    return sorted({int(name.split(".")[5]) for name, *_ in reads if ".experts." in name})


@pytest.mark.parametrize("sizes", LAYOUTS, ids=lambda s: "attn{}-moe{}-ep{}".format(*s))
def test_each_rank_reads_exactly_its_shard(tiny_ckpt, sizes):
    heads = 4
    for info, model, reads in shard_loads(tiny_ckpt, sizes):
        held = sum(p.numel() for p in model.parameters())
        assert sum(n for _, n, _ in reads) == held, f"rank {info.rank} read more than it holds"
        experts = model.model.layers[1].mlp.experts
        per = 8 // info.ep_size
        assert expert_ids(reads) == list(range(info.ep_rank * per, (info.ep_rank + 1) * per))
        assert experts.gate_up_proj.shape == (per, 2 * 32 // info.moe_tp_size, 64)
        attn = model.model.layers[0].self_attn
        assert attn.q_b_proj.weight.shape[0] == heads // info.world_size * 24
        assert attn.o_proj.weight.shape[1] == heads // info.world_size * 24
        assert model.model.layers[0].mlp.gate_proj.weight.shape[0] == 128 // info.world_size


@pytest.mark.parametrize("sizes", [(2, 2, 1), (2, 1, 2)], ids=["moe-tp2", "ep2"])
def test_fused_expert_checkpoint_reads_only_the_shard(tiny_ckpt, tmp_path, sizes):
    fused = str(tmp_path / "fused")
    ckpt_edit.fuse_experts(tiny_ckpt, fused)
    for (info, per_expert, _), (_, model, reads) in zip(shard_loads(tiny_ckpt, sizes), shard_loads(fused, sizes)):
        assert sum(n for _, n, _ in reads) == sum(p.numel() for p in model.parameters()), f"rank {info.rank}"
        for name, p in per_expert.named_parameters():
            torch.testing.assert_close(dict(model.named_parameters())[name], p, rtol=0, atol=0, msg=name)


def test_padded_vocab_shards(tiny_variant):
    """vocab 509 over 2 ranks: 255 rows each, the last one zero-padded."""
    full, _ = load(tiny_variant, RankInfo())
    for info, model, reads in shard_loads(tiny_variant, (2, 2, 1)):
        emb = model.model.embed_tokens.weight
        assert emb.shape == (255, 64)
        rows = slice(255 * info.rank, min(255 * (info.rank + 1), 509))
        torch.testing.assert_close(emb[: rows.stop - rows.start], full.model.embed_tokens.weight[rows])
        if info.rank == 1:
            assert (emb[254:] == 0).all()
        assert sum(n for _, n, _ in reads) == sum(p.numel() for p in model.parameters()) - (info.rank == 1) * 2 * 64


class RecordingSlice:
    def __init__(self, inner):
        self.inner, self.read = inner, 0

    def get_shape(self):
        return self.inner.get_shape()

    def __getitem__(self, idx):
        t = self.inner[idx]
        self.read += t.numel()
        return t


def test_fp8_shard_is_read_and_dequantized_alone(tmp_path):
    g = torch.Generator().manual_seed(0)
    w = (torch.randn(300, 260, generator=g) * 20).to(torch.float8_e4m3fn)
    scale = torch.rand(3, 3, generator=g) + 0.5  # 128x128 blocks, the last ones partial
    save_file({"w": w, "w_scale_inv": scale}, str(tmp_path / "w.safetensors"))
    full = dequant_fp8_block(w, scale)
    torch.testing.assert_close(full[:128, :128], w[:128, :128].float() * scale[0, 0])
    torch.testing.assert_close(full[280:, 256:], w[280:, 256:].float() * scale[2, 2])
    with safe_open(str(tmp_path / "w.safetensors"), "pt") as h:
        for idx in [slice(0, 150), slice(150, 300), (slice(None), slice(130, 260)), (slice(100, 200), slice(7, 250))]:
            t = _Tensor(h, "w", fp8_scale=scale, dtype=torch.float32)
            t._slice = RecordingSlice(t._slice)
            got = t[idx]
            torch.testing.assert_close(got, full[idx], rtol=0, atol=0)
            assert t._slice.read == got.numel(), f"{idx}: read {t._slice.read} values for {got.numel()}"
