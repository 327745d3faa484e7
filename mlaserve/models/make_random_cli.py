"""`mlaserve make-random PRESET OUT`: flags and entry point for models/make_random.py; with --plan, the per-rank
weight bytes of the model without writing or loading anything."""

from __future__ import annotations

import argparse

from ..quantization import SCHEMES
from .make_random import load_preset, make_random, preset_names
from .make_random_draft import make_random_draft


def add_cli_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("preset", help=f"one of {', '.join(preset_names())}, or a path to a config.json")
    p.add_argument("out", nargs="?", default=None, help="output folder (not with --plan)")
    p.add_argument("--layers", type=int, default=None, help="truncate to N hidden layers")
    p.add_argument("--seed", type=int, default=0, help="random seed (same seed, same weights)")
    p.add_argument("--dtype", default=None, help="bfloat16 | float32 | float16 (default: the preset's)")
    p.add_argument("--device", default="cpu", help="where to draw the numbers (cuda is faster for big presets)")
    p.add_argument("--shard-size-gb", type=float, default=2.0, help="max safetensors shard size")
    p.add_argument(
        "--target", default=None, help="EAGLE3 draft presets: the target checkpoint whose shapes the draft must match"
    )
    p.add_argument(
        "--wrapper",
        action="store_true",
        help="write a plain text model inside the Kimi-K2.5 wrapper (weights under language_model.)",
    )
    p.add_argument(
        "--quantization",
        choices=SCHEMES,
        default=None,
        help="the published form to write (default: the preset's: kimi-k2.5 int4-experts, deepseek-v3 fp8-block, "
        "others none)",
    )
    p.add_argument(
        "--mtp",
        action="store_true",
        help="also write the MTP layer DeepSeek-V3 ships (num_nextn_predict_layers, at least 1), the draft of "
        "--speculative-algorithm MTP",
    )
    p.add_argument(
        "--config-only",
        action="store_true",
        help="write config.json and the tokenizer, no weights: a folder for --load-format dummy (weights in place)",
    )
    p.add_argument(
        "--plan",
        action="store_true",
        help="print each rank's weight bytes for the parallel layout below (nothing is written or loaded)",
    )
    p.add_argument("--gpu-memory-gib", type=float, default=139.0, help="--plan: one GPU's memory (H200: 139)")
    from ..args import add_parallel_args  # the command's module: it may read the shared flags

    add_parallel_args(p)


def cli_main(args) -> int:
    if args.plan:
        return _plan(args)
    if args.out is None:
        raise SystemExit("make-random: the output folder is required (or --plan)")
    arch = (load_preset(args.preset).get("architectures") or [""])[0]
    if "Eagle3" in arch:
        print(
            make_random_draft(
                args.preset, args.out, target=args.target, seed=args.seed, dtype=args.dtype, device=args.device
            )
        )
        return 0
    out = make_random(
        args.preset,
        args.out,
        layers=args.layers,
        seed=args.seed,
        dtype=args.dtype,
        device=args.device,
        shard_bytes=int(args.shard_size_gb * (1 << 30)),
        wrapper=args.wrapper,
        quantization=args.quantization,
        config_only=args.config_only,
        mtp=args.mtp,
    )
    print(out)
    return 0


def _plan(args) -> int:
    import tempfile

    from ..args import parallel_config_from_args
    from ..config import ModelConfig, torch_dtype
    from .weight_bytes import plan_lines

    with tempfile.TemporaryDirectory() as tmp:  # the config make-random would write, without the weights
        path = make_random(
            args.preset,
            tmp,
            layers=args.layers,
            dtype=args.dtype,
            quantization=args.quantization,
            config_only=True,
            tokenizer=False,
            mtp=args.mtp,
        )
        cfg = ModelConfig.from_pretrained(path)
    for line in plan_lines(
        cfg, parallel_config_from_args(args), torch_dtype(cfg.torch_dtype), args.gpu_memory_gib * 2**30, mtp=args.mtp
    ):
        print(line)
    return 0
