"""The MTP proposer: DeepSeek-V3's multi-token prediction layer, read from the target's own checkpoint, drafts as
an EAGLE3 draft does (same chain, same device step after a verify, same graphs: spec/eagle3.py), from the
target's final normed hidden (models/deepseek_mtp.py).

Under TP every rank holds its shard of the layer and runs the draft with rank 0: rank 0 sends each draft step to the
others as it sends the target's steps (engine/step_broadcast.py; `followers`, the runner), and every rank captures
the same draft graphs, whose collectives line up as the target's do."""

from __future__ import annotations

import logging

import torch

from ..config import SpecConfig
from ..models.deepseek_mtp import DeepseekMTP
from .eagle3 import Eagle3Proposer

log = logging.getLogger("mlaserve.spec")

FINAL_NORMED = -1  # DeepseekV3ForCausalLM's aux id of its final normed hidden


def check_has_mtp(cfg) -> None:
    """Refuse a target whose checkpoint has no MTP layer (Kimi-K2, Kimi-K2.5, Moonlight), naming the field."""
    if cfg.num_nextn_predict_layers < 1:
        raise ValueError(
            "speculative_config.algorithm: MTP drafts with the target's multi-token prediction layer, and this "
            f"model's config.json has num_nextn_predict_layers {cfg.num_nextn_predict_layers} (DeepSeek-V3 and R1 "
            "ship one); use EAGLE3 with a draft model, or NGRAM"
        )


class MtpProposer(Eagle3Proposer):
    def _load(self, spec: SpecConfig, runner):
        from ..models.dummy_weights import init_dummy_weights
        from ..models.weight_bytes import weight_bytes
        from ..models.weights import load_weights

        cfg, target = runner.model_cfg, runner.model
        check_has_mtp(cfg)
        ranks = runner.ranks
        with torch.device(self.device):
            draft = DeepseekMTP(cfg, runner.dtype, runner.moe_impl, ranks)
        if runner.cfg.load_format == "dummy":
            init_dummy_weights(draft, seed=runner.cfg.seed + 1)
        else:
            load_weights(draft, runner.cfg.model, progress=False, mtp=True)
        self.weight_bytes = own = weight_bytes(draft).total  # before the target's tables join it
        draft.embed_tokens, draft.lm_head = target.model.embed_tokens, target.lm_head
        if ranks.world_size > 1 and ranks.rank == 0:
            self.followers = runner  # the other ranks run each draft step with this one
        if ranks.rank == 0:
            log.info(
                "MTP draft: layer %d of %s, %d draft step%s, %.1f MB of weights on this rank%s",
                cfg.num_hidden_layers,
                runner.cfg.model,
                spec.num_steps,
                "s" if spec.num_steps > 1 else "",
                own / 1e6,
                f" (its shard of {ranks.world_size}; the embedding and lm_head are the target's)"
                if ranks.world_size > 1
                else " (the embedding and lm_head are the target's)",
            )
        return draft.eval(), (FINAL_NORMED,), cfg
