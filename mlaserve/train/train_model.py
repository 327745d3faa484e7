"""`mlaserve train-model WORK`: train a small DeepSeek-V3-architecture model on the Python source of this machine.

Stages, each reusing its output in WORK when it exists (so the same command resumes; --stage X stops after X):
1. corpus     corpus/manifest.json: the stdlib's and site-packages' .py files, deduplicated, 1 % held out by hash
2. tokenizer  tokenizer/: byte-level BPE (--vocab-size) with BOS and EOS
3. tokens     corpus/train.bin, corpus/held_out.bin: uint16, BOS file EOS per file
4. train      checkpoint/checkpoint.pt: until --tokens are seen or --time-limit minutes pass (run again to resume);
              then model/: the HF folder (config.json, model.safetensors, tokenizer), README.md (the model card:
              held-out loss and bits per byte, continuations) and loss.png
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import shlex
import statistics
import time

import torch

from .batches import PackedBatches, read_tokens
from .model import DeepseekV3ForTraining
from .model_config import make_config, param_count
from .prepare import Corpus, build_tokenizer, build_tokens, read_token_info
from .trainer import Schedule, Trainer

log = logging.getLogger("mlaserve.train")
STAGES = ("corpus", "tokenizer", "tokens", "train")


def add_cli_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("work", help="the work folder (corpus, tokenizer, checkpoint, and the model in WORK/model)")
    p.add_argument("--stage", default="all", choices=("all", *STAGES), help="stop after this stage")
    p.add_argument("--roots", nargs="+", default=None, help="folders of .py files (default: stdlib, site-packages)")
    p.add_argument("--manifest", default=None, help="rebuild the corpus of this manifest.json (with --roots: moved)")
    p.add_argument("--max-corpus-mb", type=float, default=400.0, help="corpus size cap (lowest hashes kept)")
    p.add_argument("--held-out-mod", type=int, default=100, help="1 file in this many (by hash) is held out")
    p.add_argument("--vocab-size", type=int, default=8192)
    p.add_argument("--tokenizer-sample-mb", type=float, default=40.0, help="training text the BPE is learned on")
    p.add_argument("--seq-len", type=int, default=1024, help="packed sequence length (= max_position_embeddings)")
    p.add_argument("--micro-batch", type=int, default=64, help="sequences per forward")
    p.add_argument("--batch-tokens", type=int, default=262144, help="tokens per optimizer step")
    p.add_argument("--tokens", type=float, default=500e6, help="training tokens in all (sets the step count)")
    p.add_argument("--lr", type=float, default=3e-3, help="peak AdamW learning rate")
    p.add_argument("--min-lr-ratio", type=float, default=0.1, help="the cosine's floor, as a fraction of --lr")
    p.add_argument("--warmup-steps", type=int, default=100)
    p.add_argument("--weight-decay", type=float, default=0.1)
    p.add_argument("--grad-clip", type=float, default=1.0)
    p.add_argument("--bias-update", type=float, default=1e-3, help="routing-bias step per optimizer step (gamma)")
    p.add_argument("--seed", type=int, default=0, help="initial weights and data order")
    p.add_argument("--model", default=None, help="JSON of model config fields replacing the default's")
    p.add_argument("--time-limit", type=float, default=None, help="minutes from the start; training stops, saves")
    p.add_argument("--save-every", type=float, default=5.0, help="minutes between checkpoints while training")
    p.add_argument("--stop-at-step", type=int, default=None, help="stop (and save) at this step, e.g. to measure")
    p.add_argument("--device", default="auto", help="auto | cpu | cuda | cuda:N")
    p.add_argument("--compile", default="auto", choices=("auto", "on", "off"), help="auto: on for CUDA")
    p.add_argument("--card-device", default="cpu", help="device mlaserve's LLM generates the card's samples on")
    p.add_argument("--card-samples", type=int, default=4, help="held-out function headers continued in the card")
    p.add_argument("--workers", type=int, default=min(16, os.cpu_count() or 1), help="threads reading files")
    p.add_argument("--disable-tqdm", action="store_true")


def _command(args) -> str:
    skip = {"module", "command", "debug", "log_level", "stage", "disable_tqdm", "work"}
    flags = []
    for k, v in sorted(vars(args).items()):
        if k in skip or v is None or v is False:
            continue
        flag = "--" + k.replace("_", "-")
        flags += [flag] if v is True else [flag, *(map(shlex.quote, map(str, v if isinstance(v, list) else [v])))]
    return " ".join(["mlaserve train-model", shlex.quote(args.work), *flags])


def _device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    d = torch.device(name)
    if d.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"--device: {name} asked for, but this torch sees no CUDA device")
    return d


def _check(args) -> None:
    for name in ("seq_len", "micro_batch", "batch_tokens", "warmup_steps", "card_samples", "workers"):
        if getattr(args, name) < (0 if name in ("warmup_steps", "card_samples") else 1):
            raise ValueError(f"--{name.replace('_', '-')}: must be positive, got {getattr(args, name)}")
    per_micro = args.seq_len * args.micro_batch
    if args.batch_tokens % per_micro:
        raise ValueError(f"--batch-tokens: must be a multiple of --seq-len x --micro-batch = {per_micro}")
    if not args.lr > 0 or not 0 <= args.min_lr_ratio <= 1:
        raise ValueError("--lr: must be > 0, and --min-lr-ratio in [0, 1]")


def build_model(args, vocab: int, bos: int, eos: int, device, grouped_ok: bool) -> DeepseekV3ForTraining:
    overrides = json.loads(args.model) if args.model else {}
    cfg = make_config(vocab, bos, eos, args.seq_len, **overrides)
    model = DeepseekV3ForTraining(cfg, grouped=grouped_ok)
    model.init_weights(args.seed)
    return model.to(device)


def _train(args, corpus: Corpus, info: dict, deadline, device) -> tuple[Trainer, bool]:
    from .bpe import BOS, EOS, load_tokenizer
    from .experts import grouped_mm_available

    tok = load_tokenizer(os.path.join(args.work, "tokenizer"))
    model = build_model(
        args, tok.get_vocab_size(), tok.token_to_id(BOS), tok.token_to_id(EOS), device, grouped_mm_available(device)
    )
    if args.compile == "on" or (args.compile == "auto" and device.type == "cuda"):
        model.compile_regions()
    tokens = read_tokens(os.path.join(corpus.dir, "train.bin")).to(device)
    data = PackedBatches(tokens, args.seq_len, args.micro_batch, args.seed)
    per_step = args.batch_tokens
    s = Schedule(
        steps=max(1, round(args.tokens / per_step)),
        seq_len=args.seq_len,
        micro_batch=args.micro_batch,
        accum=per_step // (args.seq_len * args.micro_batch),
        lr=args.lr,
        min_lr_ratio=args.min_lr_ratio,
        warmup_steps=args.warmup_steps,
        weight_decay=args.weight_decay,
        grad_clip=args.grad_clip,
        bias_update=args.bias_update,
        seed=args.seed,
    )
    trainer = Trainer(model, data, s, os.path.join(args.work, "checkpoint"), device)
    if trainer.try_resume():
        log.info("train: resumed at step %d of %d", trainer.step, s.steps)
    log.info(
        "train: %d parameters, %d steps of %d tokens (%.2f epochs of %d), grouped experts %s, compile %s",
        param_count(model.config),
        s.steps,
        per_step,
        s.steps * per_step / info["train_tokens"],
        info["train_tokens"],
        model.moe_layers[0].grouped if model.moe_layers else "-",
        args.compile,
    )
    save_every = args.save_every * 60 if args.save_every else None
    done = trainer.run(deadline, save_every, progress=not args.disable_tqdm, until=args.stop_at_step)
    return trainer, done


def _card(args, corpus: Corpus, info: dict, trainer: Trainer, done: bool, device) -> dict:
    from ..version import __version__
    from . import card
    from .batches import read_tokens
    from .export import export_hf

    out = os.path.join(args.work, "model")
    model, s = trainer.model, trainer.s
    export_hf(model, os.path.join(args.work, "tokenizer"), out)
    held = read_tokens(os.path.join(corpus.dir, "held_out.bin"))
    nats, n = card.held_out_nats(model, held, s.seq_len, s.micro_batch, device)
    m = corpus.load()
    rates = [h["tokens_per_s"] for h in trainer.history[1:] if "tokens_per_s" in h]  # the first holds the compile
    facts = {
        "name": "mlaserve Python code model",
        "command": _command(args),
        "params": param_count(model.config),
        "manifest_sha256": m["sha256"],
        "files": m["num_files"],
        "bytes": m["bytes"],
        "held_out_files": m["held_out_files"],
        "train_tokens": info["train_tokens"],
        "tokens_seen": trainer.step * s.tokens_per_step,
        "epochs": trainer.step * s.tokens_per_step / info["train_tokens"],
        "step": trainer.step,
        "steps": s.steps,
        "complete": done,
        "train_seconds": trainer.train_seconds,
        "device_name": torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU",
        "tokens_per_s": statistics.median(rates) if rates else 0.0,
        "held_out_loss": nats / max(n, 1),
        "held_out_tokens": n,
        "held_out_bytes": m["held_out_bytes"],
        "bpb": card.bits_per_byte(nats, m["held_out_bytes"]),
        "version": __version__,
    }
    card.loss_curve(trainer.history, facts["held_out_loss"], os.path.join(out, "loss.png"))
    headers = card.function_headers(corpus.texts("held_out"), args.card_samples) if args.card_samples else []
    samples = card.continuations(out, headers, args.card_device) if headers else []
    card.write_card(out, facts, samples)
    with open(os.path.join(out, "train_model.json"), "w") as f:
        json.dump({**facts, "history": trainer.history, "samples": samples}, f, indent=1)
    return facts


def train_model(args) -> dict:
    t0 = time.monotonic()
    _check(args)
    deadline = t0 + args.time_limit * 60 if args.time_limit else None
    device = _device(args.device)
    upto = STAGES.index(args.stage) if args.stage != "all" else len(STAGES) - 1
    work = args.work
    os.makedirs(work, exist_ok=True)
    corpus = Corpus(work, args.workers)
    tok_dir = os.path.join(work, "tokenizer")
    if not corpus.exists:
        corpus.build(args.roots, args.manifest, args.max_corpus_mb, args.held_out_mod)
    if upto >= 1 and not os.path.isfile(os.path.join(tok_dir, "tokenizer.json")):
        build_tokenizer(corpus, tok_dir, args.vocab_size, args.tokenizer_sample_mb, args.seq_len)
    info = read_token_info(corpus)
    if upto >= 2 and info is None:
        info = build_tokens(corpus, tok_dir)
    if upto < 3:
        return {}
    trainer, done = _train(args, corpus, info, deadline, device)
    facts = _card(args, corpus, info, trainer, done, device)
    print(
        f"train-model: step {facts['step']}/{facts['steps']}, {facts['tokens_per_s'] / 1e6:.2f} M tokens/s, "
        f"held-out loss {facts['held_out_loss']:.4f}, {facts['bpb']:.4f} bits/byte, "
        f"{time.monotonic() - t0:.0f} s; model in {os.path.join(work, 'model')}",
        flush=True,
    )
    return facts


def cli_main(args) -> int:
    train_model(args)
    return 0
