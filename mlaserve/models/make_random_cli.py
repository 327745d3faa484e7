"""`mlaserve make-random PRESET OUT`: flags and entry point for models/make_random.py."""

from __future__ import annotations

import argparse

from .make_random import load_preset, make_random, preset_names
from .make_random_draft import make_random_draft


def add_cli_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("preset", help=f"one of {', '.join(preset_names())}, or a path to a config.json")
    p.add_argument("out", help="output folder")
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


def cli_main(args) -> int:
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
    )
    print(out)
    return 0
