"""The Llama-style EAGLE3 draft's training forward over whole sequences, unrolled K steps (the training-time test).

Index t of a sequence holds the pair (target aux hidden at position t, token t+1), as at inference
(spec/eagle3.py). Step 0 reads the target's aux states; step k >= 1 reads the draft's own pre-norm output of
step k-1 at the same index and token t+1+k, at position t+k: the k-th link of a chain drafted from position t.
Its query sees step 0's keys at indexes <= t (the real context, as the paged cache holds it at inference) and
the keys of steps 1..k at index t alone (the chain's own earlier links). Step k's label is the target's greedy
token at position t+1+k. The weights are a plain dict under the published tensor names, so the forward is
differentiable on any device (the inference modules use Triton kernels on the GPU) and saves as it is.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ..models.eagle3 import rope_neox

A, M = "midlayer.self_attn.", "midlayer.mlp."


def rms(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    """layers/norm.RMSNorm's torch form."""
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return w * h.to(x.dtype)


def ttt_mask(S: int, k: int, device) -> torch.Tensor:
    """[S, (k+1)*S] bool: step k's queries over the keys of steps 0..k (causal block, then k diagonal blocks)."""
    i = torch.arange(S, device=device)
    causal = i[None, :] <= i[:, None]
    diag = i[None, :] == i[:, None]
    return torch.cat([causal] + [diag] * k, dim=1)


class TTTForward:
    """Run the draft over [B, S] indexes for steps 0..K-1, keeping each step's keys and values."""

    def __init__(self, cfg: dict, w: dict[str, torch.Tensor], embed: torch.Tensor):
        self.w, self.embed = w, embed  # embed [V, H]: the target's, frozen
        self.H = cfg["hidden_size"]
        self.nh = cfg["num_attention_heads"]
        self.nkv = cfg.get("num_key_value_heads") or self.nh
        self.hd = cfg.get("head_dim") or self.H // self.nh
        self.eps = cfg.get("rms_norm_eps", 1e-6)
        self.theta = cfg.get("rope_theta", 10000.0)

    def _rope(self, x: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        B, S, h, d = x.shape
        return rope_neox(x.reshape(B * S, h, d), pos.repeat(B), self.theta).view(B, S, h, d)

    def step(self, ids: torch.Tensor, hidden: torch.Tensor, k: int, cache: list) -> tuple[torch.Tensor, torch.Tensor]:
        """ids [B, S] (token t+1+k at index t), hidden [B, S, 3*Ht] (k == 0) or [B, S, H]
        -> (normed [B, S, H] for the logits, pre-norm [B, S, H] for step k+1)."""
        w, B, S = self.w, ids.shape[0], ids.shape[1]
        emb = F.embedding(ids, self.embed)
        if k == 0:
            hidden = F.linear(hidden.to(emb.dtype), w["fc.weight"])
        x = torch.cat(
            [
                rms(emb, w["midlayer.input_layernorm.weight"], self.eps),
                rms(hidden, w["midlayer.hidden_norm.weight"], self.eps),
            ],
            dim=-1,
        )
        pos = torch.arange(k, S + k, device=ids.device)
        q = self._rope(F.linear(x, w[A + "q_proj.weight"]).view(B, S, self.nh, self.hd), pos)
        kk = self._rope(F.linear(x, w[A + "k_proj.weight"]).view(B, S, self.nkv, self.hd), pos)
        v = F.linear(x, w[A + "v_proj.weight"]).view(B, S, self.nkv, self.hd)
        group = self.nh // self.nkv  # head j reads kv head j // group, as attention/mha_ref.py
        cache.append((kk.repeat_interleave(group, 2).transpose(1, 2), v.repeat_interleave(group, 2).transpose(1, 2)))
        keys = torch.cat([c[0] for c in cache], dim=2)  # [B, nh, (k+1)*S, hd]
        vals = torch.cat([c[1] for c in cache], dim=2)
        o = F.scaled_dot_product_attention(
            q.transpose(1, 2), keys, vals, attn_mask=ttt_mask(S, k, ids.device), scale=self.hd**-0.5
        )  # [B, nh, S, hd]
        h = hidden + F.linear(o.transpose(1, 2).reshape(B, S, -1), w[A + "o_proj.weight"])
        y = rms(h, w["midlayer.post_attention_layernorm.weight"], self.eps)
        y = F.linear(
            F.silu(F.linear(y, w[M + "gate_proj.weight"])) * F.linear(y, w[M + "up_proj.weight"]),
            w[M + "down_proj.weight"],
        )
        h = h + y
        return rms(h, w["norm.weight"], self.eps), h

    def logits(self, normed: torch.Tensor) -> torch.Tensor:
        return F.linear(normed, self.w["lm_head.weight"]).float()  # [B, S, draft vocab]

    def run(self, tokens: torch.Tensor, aux: torch.Tensor, steps: int) -> list[torch.Tensor]:
        """tokens [B, S + steps] (tokens 1.. of each sequence, padded), aux [B, S, 3*Ht]
        -> the draft logits of each step, [B, S, draft vocab] each."""
        S, cache, out = aux.shape[1], [], []
        hidden = aux
        for k in range(steps):
            normed, hidden = self.step(tokens[:, k : k + S], hidden, k, cache)
            out.append(self.logits(normed))
        return out
