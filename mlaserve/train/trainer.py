"""The training loop: AdamW (fp32 master weights, bf16 autocast on CUDA) with linear warmup and cosine decay,
gradient clipping, gradient accumulation over packed micro-batches, the routing-bias update after every step,
and a checkpoint (model, optimizer, step = data position, RNG, routing biases, loss history) it resumes exactly.
"""

from __future__ import annotations

import math
import os
import time
from dataclasses import asdict, dataclass

import torch
from tqdm import tqdm

from .batches import PackedBatches
from .experts import update_bias
from .model import DeepseekV3ForTraining

CKPT = "checkpoint.pt"


@dataclass(frozen=True)
class Schedule:
    """What a checkpoint must agree with to be resumed: the data order, the batch and the learning-rate curve."""

    steps: int
    seq_len: int
    micro_batch: int
    accum: int
    lr: float
    min_lr_ratio: float
    warmup_steps: int
    weight_decay: float
    grad_clip: float
    bias_update: float
    seed: int

    @property
    def tokens_per_step(self) -> int:
        return self.seq_len * self.micro_batch * self.accum

    def lr_at(self, step: int) -> float:
        if step < self.warmup_steps:
            return self.lr * (step + 1) / self.warmup_steps
        t = (step - self.warmup_steps) / max(1, self.steps - self.warmup_steps)
        return self.lr * (self.min_lr_ratio + (1 - self.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * min(t, 1.0))))


def make_optimizer(model: torch.nn.Module, s: Schedule, device: torch.device) -> torch.optim.AdamW:
    """Weight decay on matrices (not norms, embeddings or the router); fused on CUDA."""
    decay, plain = [], []
    for name, p in model.named_parameters():
        (decay if p.dim() >= 2 and "embed_tokens" not in name and "gate.weight" not in name else plain).append(p)
    groups = [{"params": decay, "weight_decay": s.weight_decay}, {"params": plain, "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, lr=s.lr, betas=(0.9, 0.95), eps=1e-8, fused=device.type == "cuda")


class Trainer:
    def __init__(self, model: DeepseekV3ForTraining, data: PackedBatches, s: Schedule, ckpt_dir: str, device):
        self.model, self.data, self.s, self.ckpt_dir = model, data, s, ckpt_dir
        self.device = torch.device(device)
        self.opt = make_optimizer(model, s, self.device)
        self.step = 0
        self.history: list[dict] = []  # one row per logged interval: step, tokens, loss, lr, tokens_per_s
        self.train_seconds = 0.0  # summed over every run that led to this checkpoint
        self.autocast = self.device.type == "cuda"

    # ---- checkpoint ----------------------------------------------------------------------------------------
    def save(self) -> str:
        os.makedirs(self.ckpt_dir, exist_ok=True)
        state = {
            "model": self.model.state_dict(),
            "optimizer": self.opt.state_dict(),
            "step": self.step,
            "schedule": asdict(self.s),
            "config": self.model.config,
            "history": self.history,
            "train_seconds": self.train_seconds,
            "rng_cpu": torch.get_rng_state(),
            "rng_cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None,
        }
        path = os.path.join(self.ckpt_dir, CKPT)
        torch.save(state, path + ".tmp")
        os.replace(path + ".tmp", path)  # a run killed mid-save keeps the previous checkpoint
        return path

    def try_resume(self) -> bool:
        path = os.path.join(self.ckpt_dir, CKPT)
        if not os.path.isfile(path):
            return False
        state = torch.load(path, map_location=self.device, weights_only=False)
        if state["schedule"] != asdict(self.s) or state["config"] != self.model.config:
            diff = [k for k in asdict(self.s) if state["schedule"].get(k) != asdict(self.s)[k]]
            raise ValueError(
                f"resume: {path} was trained with other settings ({', '.join(diff) or 'the model config'} differ); "
                "pass the same flags, or a new work folder"
            )
        self.model.load_state_dict(state["model"])
        self.opt.load_state_dict(state["optimizer"])
        self.step, self.history, self.train_seconds = state["step"], state["history"], state["train_seconds"]
        torch.set_rng_state(state["rng_cpu"].cpu())
        if state["rng_cuda"] is not None and torch.cuda.is_available():
            torch.cuda.set_rng_state_all([t.cpu() for t in state["rng_cuda"]])
        return True

    # ---- one optimizer step -------------------------------------------------------------------------------
    def train_step(self) -> torch.Tensor:
        """Runs step self.step; -> its mean loss per token (a device scalar: no host sync here)."""
        s = self.s
        lr = s.lr_at(self.step)
        for g in self.opt.param_groups:
            g["lr"] = lr
        total = torch.zeros((), device=self.device)
        loads = None
        for m in range(s.accum):
            x, y = self.data(self.step * s.accum + m)
            x, y = x.to(self.device, non_blocking=True), y.to(self.device, non_blocking=True)
            with torch.autocast(self.device.type, dtype=torch.bfloat16, enabled=self.autocast):
                loss, load = self.model(x, y)
            (loss / s.tokens_per_step).backward()
            total += loss.detach()
            loads = load if loads is None else loads + load
        if s.grad_clip > 0:
            torch.nn.utils.clip_grad_norm_(self.model.parameters(), s.grad_clip)
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        with torch.no_grad():
            for moe, load in zip(self.model.moe_layers, loads):
                update_bias(moe.gate.e_score_correction_bias, load, s.bias_update)
        self.step += 1
        return total / s.tokens_per_step

    def run(
        self, deadline: float | None, save_every_s: float | None, log_every: int = 10, progress=True, until=None
    ) -> bool:
        """Steps until the schedule ends, time.monotonic() passes `deadline` or step `until` is reached; saves then
        (and every `save_every_s`). -> whether the schedule is complete."""
        s = self.s
        last = s.steps if until is None else min(until, s.steps)
        bar = tqdm(total=s.steps, initial=self.step, unit="step", disable=not progress, dynamic_ncols=True)
        losses: list[torch.Tensor] = []
        t_log = t_save = time.monotonic()
        steps_at_log = self.step
        while self.step < last and (deadline is None or time.monotonic() < deadline):
            losses.append(self.train_step())
            done = self.step == s.steps
            if self.step % log_every == 0 or done:
                loss = torch.stack(losses).mean().item()  # the one host sync per interval
                now = time.monotonic()
                tps = (self.step - steps_at_log) * s.tokens_per_step / max(now - t_log, 1e-9)
                self.train_seconds += now - t_log
                row = {"step": self.step, "tokens": self.step * s.tokens_per_step, "loss": loss}
                self.history.append({**row, "lr": s.lr_at(self.step - 1), "tokens_per_s": tps})
                bar.set_postfix(loss=f"{loss:.3f}", tok_s=f"{tps / 1e6:.2f}M", epoch=f"{self._epoch():.2f}")
                bar.update(self.step - bar.n)
                losses, t_log, steps_at_log = [], now, self.step
                if save_every_s is not None and now - t_save >= save_every_s:
                    self.save()
                    t_save = time.monotonic()
        if losses:  # steps after the last log: count their time and loss too
            now = time.monotonic()
            self.train_seconds += now - t_log
            loss = torch.stack(losses).mean().item()
            self.history.append(
                {"step": self.step, "tokens": self.step * s.tokens_per_step, "loss": loss, "lr": s.lr_at(self.step - 1)}
            )
        bar.close()
        self.save()
        return self.step >= s.steps

    def _epoch(self) -> float:
        return self.data.epoch_of(self.step * self.s.accum)
