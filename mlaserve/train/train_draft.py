"""`mlaserve train-draft TARGET OUT`: distill an EAGLE3 draft from a target's own hidden states and greedy outputs.

1. Prompts: read (--prompts) or random token prefixes; the target's greedy continuations make them sequences.
2. Features: one prefill forward of the target per sequence gives its aux hidden states and greedy next tokens.
3. The draft vocabulary: the --draft-vocab most frequent greedy tokens (d2t / t2d map it to target ids).
4. Training: cross-entropy of the draft's logits against the target's greedy tokens, over --ttt-steps unrolled
   steps of the draft's own hidden state (train/ttt.py), weighted 0.8^k as EAGLE3 does.
5. Output: a `LlamaForCausalLMEagle3` folder (train/draft_ckpt.py); then the acceptance per draft position on
   held-out random prompts, measured by the speculative engine.
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import os
import time
from types import SimpleNamespace

import torch
import torch.nn.functional as F
from tqdm import tqdm

from ..config import ModelConfig
from .data import TargetFeatures, corpus_prompts, greedy_sequences, random_prompts, read_prompts
from .draft_ckpt import draft_vocab, init_weights, make_config, save_draft
from .ttt import TTTForward

LOSS_DECAY = 0.8  # step k's loss weight is LOSS_DECAY ** k (EAGLE3's)


def add_cli_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("target", help="the target model folder")
    p.add_argument("out", help="where to write the draft (config.json, model.safetensors)")
    p.add_argument("--steps", type=int, default=2000, help="optimizer steps (default: %(default)s)")
    p.add_argument("--prompts", default=None, help="a .jsonl or text file of prompts (default: random prefixes)")
    p.add_argument(
        "--corpus",
        default=None,
        help="a train-model corpus folder: prompts are windows of its train.bin, held-out ones of held_out.bin",
    )
    p.add_argument("--num-prompts", type=int, default=256, help="random prompts to make (default: %(default)s)")
    p.add_argument("--max-len", type=int, default=256, help="prompt + greedy continuation tokens (default: 256)")
    p.add_argument("--draft-vocab", type=int, default=None, help="draft vocabulary (default: min(32000, vocab/2))")
    p.add_argument("--ttt-steps", type=int, default=3, help="unrolled draft steps trained (default: %(default)s)")
    p.add_argument("--lr", type=float, default=3e-3, help="peak AdamW learning rate (default: %(default)s)")
    p.add_argument("--batch", type=int, default=8, help="sequences per optimizer step (default: %(default)s)")
    p.add_argument("--device", default="auto", help="auto | cpu | cuda | cuda:N (target and draft)")
    p.add_argument("--dtype", default=None, help="the draft's saved dtype (default: the target's)")
    p.add_argument("--seed", type=int, default=0, help="prompts, initial weights and batches (default: 0)")
    p.add_argument(
        "--aux-layer-offset",
        type=int,
        default=0,
        choices=[0, 1],
        help="0: aux states entering the draft's aux layer ids (vLLM); 1: leaving them. Serve with the same",
    )
    p.add_argument("--feature-cache-gb", type=float, default=4.0, help="target features kept in host memory")
    p.add_argument("--eval-prompts", type=int, default=8, help="held-out prompts the acceptance is measured on")
    p.add_argument(
        "--no-embedding", action="store_true", help="write no embed_tokens copy (the draft shares the target's)"
    )
    p.add_argument("--disable-tqdm", action="store_true")


def _check(steps, max_len, ttt_steps, batch, lr, vocab, dvocab) -> None:
    for name, v, lo in (("steps", steps, 1), ("max-len", max_len, 3), ("ttt-steps", ttt_steps, 1), ("batch", batch, 1)):
        if v < lo:
            raise ValueError(f"--{name}: must be >= {lo}, got {v}")
    if not lr > 0:
        raise ValueError(f"--lr: must be > 0, got {lr}")
    if not 1 <= dvocab <= vocab:
        raise ValueError(f"--draft-vocab: must be in [1, {vocab}] (the target's vocabulary), got {dvocab}")


def make_batch(seqs, feats, index, steps: int, t2d_index: torch.Tensor, device):
    """-> tokens [B, S+steps] (token 1+j at column j), aux [B, S, 3D], labels [B, S+steps] (the target's greedy
    token 1+j; -1 past the end) and their draft ids (-1: outside the draft vocabulary or past the end)."""
    rows = [(seqs[i], *feats(i, seqs[i])) for i in index]
    S = max(len(s) for s, _, _ in rows) - 1
    B, D = len(rows), rows[0][1].shape[-1]
    tokens = torch.zeros(B, S + steps, dtype=torch.int64)
    labels = torch.full((B, S + steps), -1, dtype=torch.int64)
    aux = torch.zeros(B, S, D, dtype=rows[0][1].dtype)
    for b, (s, a, y) in enumerate(rows):
        n = len(s) - 1
        tokens[b, :n] = torch.tensor(s[1:])
        labels[b, :n] = y[1:]
        aux[b, :n] = a[:n]
    dlabels = torch.where(labels >= 0, t2d_index[labels.clamp(min=0)], -1)
    return tokens.to(device), aux.to(device, torch.float32), labels.to(device), dlabels.to(device)


def ttt_loss(fwd: TTTForward, batch, steps: int, ids: torch.Tensor):
    """-> (weighted loss, [accuracy of step k]); accuracy over every position with a label (a label outside the
    draft vocabulary counts as a miss)."""
    tokens, aux, labels, dlabels = batch
    S = aux.shape[1]
    loss, accs = 0.0, []
    for k, logits in enumerate(fwd.run(tokens, aux, steps)):
        lab, dlab = labels[:, k : k + S], dlabels[:, k : k + S]
        known, inv = lab >= 0, dlab >= 0
        if inv.any():
            loss = loss + LOSS_DECAY**k * F.cross_entropy(logits[inv], dlab[inv])
        with torch.no_grad():
            hit = (ids[logits.argmax(-1)] == lab) & known
            accs.append(hit.sum().item() / max(known.sum().item(), 1))
    return loss, accs


def train_draft(
    target: str,
    out: str,
    *,
    steps: int = 2000,
    prompts: str | None = None,
    corpus: str | None = None,
    num_prompts: int = 256,
    max_len: int = 256,
    draft_vocab_size: int | None = None,
    ttt_steps: int = 3,
    lr: float = 3e-3,
    batch: int = 8,
    device: str = "auto",
    dtype: str | None = None,
    seed: int = 0,
    aux_layer_offset: int = 0,
    feature_cache_gb: float = 4.0,
    write_embedding: bool = True,
    progress: bool = True,
) -> dict:
    """Train and write the draft; returns what train_draft.json records."""
    from ..llm import LLM
    from ..spec.eagle3 import aux_layer_ids

    t0 = time.perf_counter()
    tcfg = ModelConfig.from_pretrained(target)
    V = tcfg.vocab_size
    dvocab = draft_vocab_size or min(32000, V // 2)
    _check(steps, max_len, ttt_steps, batch, lr, V, dvocab)
    page_size, seqs_at_once = 64, min(num_prompts, 128)
    pages = -(-max_len // page_size) + 1
    llm = LLM(
        target,
        device=device,
        seed=seed,
        page_size=page_size,
        max_model_len=max_len,
        max_num_seqs=seqs_at_once,
        num_pages=pages * (seqs_at_once + 1),
        enable_prefix_caching=False,
    )
    model, dev = llm.engine.runner.model, llm.engine.runner.device
    if prompts and corpus:
        raise ValueError("--prompts and --corpus: give one")
    if prompts:
        data = read_prompts(prompts, llm.tokenizer)
    elif corpus:
        data = corpus_prompts(os.path.join(corpus, "train.bin"), num_prompts, max_len, seed, tcfg.bos_token_id)
    else:
        data = random_prompts(num_prompts, V, max_len, seed, exclude=llm.engine.eos_token_ids)
    seqs = [s for s in greedy_sequences(llm, data, max_len, progress) if len(s) >= 3]
    if not seqs:
        raise ValueError("--prompts: no sequence of 3 or more tokens to train on")

    cfg = make_config(tcfg, dvocab)
    ids = cfg["eagle_config"]["eagle_aux_hidden_state_layer_ids"]
    aux_ids = aux_layer_ids(SimpleNamespace(aux_layer_ids=tuple(ids)), tcfg.num_hidden_layers, aux_layer_offset)
    feats = TargetFeatures(llm.engine, aux_ids, int(feature_cache_gb * (1 << 30)))
    counts = torch.zeros(V, dtype=torch.int64)
    for i, s in enumerate(tqdm(seqs, desc="target features", disable=not progress)):
        counts += torch.bincount(feats(i, s)[1][1:], minlength=V)
    vocab_ids = draft_vocab(counts, dvocab)
    coverage = counts[vocab_ids].sum().item() / max(counts.sum().item(), 1)
    t2d_index = torch.full((V,), -1, dtype=torch.int64)
    t2d_index[vocab_ids] = torch.arange(dvocab)

    w = init_weights(cfg, model, vocab_ids, seed, dev)
    embed = model.model.embed_tokens.weight.detach()
    fwd = TTTForward(cfg, w, embed.float())
    opt = torch.optim.AdamW(w.values(), lr=lr, betas=(0.9, 0.95), weight_decay=0.0)
    warm = max(1, steps // 20)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda i: min(1.0, (i + 1) / warm) * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(i / steps, 1.0))))
    )
    gen = torch.Generator().manual_seed(seed)
    target_ids = vocab_ids.to(dev)
    bar = tqdm(range(steps), desc="train-draft", disable=not progress)
    ema = None
    for _ in bar:
        index = torch.randint(len(seqs), (min(batch, len(seqs)),), generator=gen).tolist()
        loss, accs = ttt_loss(fwd, make_batch(seqs, feats, index, ttt_steps, t2d_index, dev), ttt_steps, target_ids)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(w.values(), 0.5)
        opt.step()
        sched.step()
        ema = accs if ema is None else [0.9 * e + 0.1 * a for e, a in zip(ema, accs)]
        bar.set_postfix(loss=f"{loss.item():.3f}", acc="/".join(f"{a:.2f}" for a in ema))
    bar.close()
    extra = dict(
        target=target,
        prompts=prompts or (os.path.join(corpus, "train.bin") if corpus else "random"),
        steps=steps,
        sequences=len(seqs),
        max_len=max_len,
        ttt_steps=ttt_steps,
        lr=lr,
        batch=batch,
        seed=seed,
        aux_layer_offset=aux_layer_offset,
        draft_vocab_size=dvocab,
        draft_vocab_coverage=coverage,
        train_accuracy_per_step=ema,
        seconds=time.perf_counter() - t0,
    )
    save_draft(out, cfg, w, vocab_ids, embed if write_embedding else None, dtype or tcfg.torch_dtype, extra)
    del llm, model, feats, fwd, sched, opt, w, embed  # the target's cache and graphs go before an evaluation starts
    gc.collect()
    if dev.type == "cuda":
        torch.cuda.empty_cache()
    return extra


def measure_acceptance(
    target: str, draft: str, num_steps: int, prompts, max_tokens: int, aux_layer_offset: int = 0, **engine_kw
) -> dict:
    """Greedy speculative generation of `prompts` with `draft` -> the engine's acceptance per draft position."""
    from ..llm import LLM
    from ..types import SamplingParams

    spec = {"draft_model": draft, "num_steps": num_steps, "aux_layer_offset": aux_layer_offset}
    llm = LLM(target, speculative_config=spec, **engine_kw)
    llm.generate(prompts, SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True), use_tqdm=False)
    st = llm.engine.stats()
    n = max(st["spec_steps"], 1)
    return {
        "verify_steps": st["spec_steps"],
        "accepted_per_position": st["spec_accepted_per_position"],
        "acceptance_per_position": [a / n for a in st["spec_accepted_per_position"]],
        "mean_accepted_length": 1 + st["spec_accepted_tokens"] / n,
    }


def cli_main(args) -> int:
    try:
        info = train_draft(
            args.target,
            args.out,
            steps=args.steps,
            prompts=args.prompts,
            corpus=args.corpus,
            num_prompts=args.num_prompts,
            max_len=args.max_len,
            draft_vocab_size=args.draft_vocab,
            ttt_steps=args.ttt_steps,
            lr=args.lr,
            batch=args.batch,
            device=args.device,
            dtype=args.dtype,
            seed=args.seed,
            aux_layer_offset=args.aux_layer_offset,
            feature_cache_gb=args.feature_cache_gb,
            write_embedding=not args.no_embedding,
            progress=not args.disable_tqdm,
        )
    except ValueError as e:
        print(f"train-draft: {e}")
        return 2
    acc = " / ".join(f"{a:.3f}" for a in info["train_accuracy_per_step"])
    print(
        f"wrote {args.out}: {info['sequences']} sequences, {info['steps']} steps in {info['seconds']:.1f}s; "
        f"training accuracy per step {acc}; draft vocabulary covers {info['draft_vocab_coverage']:.1%}"
    )
    if args.eval_prompts:
        tcfg = ModelConfig.from_pretrained(args.target)
        if args.corpus:
            path = os.path.join(args.corpus, "held_out.bin")
            held = corpus_prompts(path, args.eval_prompts, args.max_len, args.seed + 1, tcfg.bos_token_id)
        else:
            held = random_prompts(args.eval_prompts, tcfg.vocab_size, args.max_len, args.seed + 1)
        m = measure_acceptance(
            args.target,
            args.out,
            args.ttt_steps,
            held,
            max(1, args.max_len // 2),
            device=args.device,
            aux_layer_offset=args.aux_layer_offset,
        )
        with open(os.path.join(args.out, "eval_prompts.jsonl"), "w") as f:  # what the acceptance was measured on
            f.writelines(json.dumps({"prompt_token_ids": p}) + "\n" for p in held)
        info["held_out_acceptance"] = dict(prompts=args.eval_prompts, k=args.ttt_steps, **m)
        with open(os.path.join(args.out, "train_draft.json"), "w") as f:
            json.dump(info, f, indent=1)
        rates = ", ".join(f"{i + 1}: {r:.3f}" for i, r in enumerate(m["acceptance_per_position"]))
        print(
            f"held-out acceptance per draft position ({args.eval_prompts} prompts, K={args.ttt_steps}, "
            f"{m['verify_steps']} verify steps): {rates}; mean accepted length {m['mean_accepted_length']:.3f}"
        )
    return 0
