"""The parallelism flags shared by `serve` and `generate` (same names as the LLM(...) keywords)."""

from __future__ import annotations

import argparse

from ..config import ParallelConfig


def add_parallel_args(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("parallelism (one process per rank; world = attn-tp = moe-tp * ep)")
    g.add_argument(
        "--tp",
        "--tensor-parallel-size",
        dest="tp",
        type=int,
        default=None,
        help="shorthand: --attn-tp-size N --moe-tp-size N --ep-size 1",
    )
    g.add_argument("--attn-tp-size", type=int, default=None, help="ranks splitting the attention heads")
    g.add_argument(
        "--moe-tp-size",
        type=int,
        default=None,
        help="ranks splitting each routed expert's intermediate dim (default: world / ep)",
    )
    g.add_argument("--ep-size", type=int, default=None, help="ranks splitting the routed experts (default: 1)")
    g.add_argument("--nnodes", type=int, default=1, help="machines (default: 1)")
    g.add_argument("--node-rank", type=int, default=0, help="this machine's index, 0 runs the scheduler")
    g.add_argument(
        "--dist-init-addr",
        default=None,
        help="host:port of node 0 for torch.distributed's rendezvous (needed with --nnodes > 1)",
    )


def parallel_config_from_args(args: argparse.Namespace) -> ParallelConfig:
    return ParallelConfig.from_tp(
        args.tp,
        attn_tp_size=args.attn_tp_size,
        moe_tp_size=args.moe_tp_size,
        ep_size=args.ep_size,
        nnodes=args.nnodes,
        node_rank=args.node_rank,
        dist_init_addr=args.dist_init_addr,
    )
