"""The command-line flags `serve` and `generate` share (vLLM/SGLang names), and what they become: the LLM(...)
keywords, a ParallelConfig, SamplingParams. Shared by the entry points, so that the library (`llm.py`) never
imports the command line."""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import os

from .config import KV_CACHE_DTYPES, ParallelConfig, generation_sampling_defaults, kv_cache_dtype_error
from .kernel_config import KernelConfig
from .types import SamplingParams

log = logging.getLogger("mlaserve")


def add_engine_args(p: argparse.ArgumentParser) -> None:
    """Flags shared by `serve` and `generate` (vLLM/SGLang names)."""
    g = p.add_argument_group("engine")
    g.add_argument("--device", default="auto", help="auto | cpu | cuda | cuda:N")
    g.add_argument("--dtype", default="auto", help="auto (the checkpoint's) | bfloat16 | float16 | float32")
    g.add_argument("--page-size", type=int, default=64, help="tokens per KV-cache page")
    g.add_argument("--num-pages", type=int, default=None, help="KV-cache pages (default: sized from memory)")
    g.add_argument("--gpu-memory-utilization", "--mem-fraction-static", type=float, default=0.90)
    g.add_argument("--kv-cache-memory-gb", type=float, default=1.0, help="CPU: KV-cache size")
    g.add_argument(
        "--max-num-seqs", "--max-running-requests", type=int, default=256, help="most requests running at once"
    )
    g.add_argument("--max-num-batched-tokens", type=int, default=8192, help="token budget of one step")
    g.add_argument("--chunked-prefill-size", type=int, default=8192, help="largest prefill chunk per request")
    g.add_argument(
        "--max-model-len",
        "--context-length",
        type=int,
        default=None,
        help="prompt + output limit (default: the model's)",
    )
    g.add_argument(
        "--no-prefix-caching",
        "--no-enable-prefix-caching",
        "--disable-radix-cache",
        dest="enable_prefix_caching",
        action="store_false",
        help="no prefix caching (on by default)",
    )
    g.add_argument("--enforce-eager", "--disable-cuda-graph", action="store_true", help="no CUDA graphs")
    g.add_argument(
        "--disable-overlap-schedule",
        action="store_true",
        help="read each decode step back before launching the next (no overlapped decode)",
    )
    g.add_argument(
        "--deterministic-inference",
        "--enable-deterministic-inference",
        dest="deterministic",
        action="store_true",
        help="batch-invariant kernels: a request's greedy tokens do not depend on what shares its steps "
        "(README says what is not yet covered)",
    )
    g.add_argument("--prefill-graph-max-tokens", type=int, default=8192, help="largest prefill CUDA graph")
    g.add_argument(
        "--prefill-graph-max-context",
        type=int,
        default=16384,
        help="largest context (cached + new tokens) of a prefill CUDA graph over cached context (a prefix hit's "
        "suffix, a long prompt's later chunks); 0: such chunks run eagerly",
    )
    g.add_argument("--attention-backend", default="auto", choices=["auto", "torch", "triton"])
    g.add_argument(
        "--kv-cache-dtype",
        type=kv_cache_dtype,
        default="auto",
        help="auto: the model's dtype; fp8 | fp8_e4m3: the MLA latent cache in float8_e4m3fn with one scale per "
        "layer (1.0), twice the tokens in the same memory",
    )
    g.add_argument("--moe-backend", default="auto", choices=["auto", "torch", "triton"])
    g.add_argument(
        "--load-format",
        default="auto",
        choices=["auto", "dummy"],
        help="dummy: random weights in place, reading no weight files",
    )
    g.add_argument("--seed", type=int, default=0)
    g.add_argument("--tokenizer", default=None, help="a folder with the tokenizer files; unset: the model's")
    g.add_argument(
        "--chat-template",
        type=chat_template,
        default=None,
        help="a chat template replacing the tokenizer's: a file, or the template itself (as vLLM takes it)",
    )
    g.add_argument(
        "--max-logprobs",
        type=int,
        default=20,
        help="the most alternatives a request's logprobs, top_logprobs or prompt_logprobs may ask for",
    )
    add_compat_args(p)
    add_parallel_args(p)
    s = p.add_argument_group("speculative decoding")
    s.add_argument(
        "--speculative-algorithm",
        default=None,
        choices=["EAGLE3", "MTP", "NEXTN", "NGRAM", "REPLAY"],
        help="MTP (or SGLang's NEXTN) drafts with the target checkpoint's own multi-token prediction layer "
        "(DeepSeek-V3/R1), no draft folder; NGRAM drafts by prompt lookup, with no draft model "
        "(--speculative-ngram-*); REPLAY is a benchmark-only draft: it proposes recorded greedy outputs "
        "(--speculative-replay-path)",
    )
    s.add_argument(
        "--speculative-draft-model-path",
        default=None,
        help="the EAGLE3 draft (with REPLAY: optional, its forward runs each step and its tokens are replaced)",
    )
    s.add_argument(
        "--speculative-num-steps",
        type=int,
        default=None,
        help="draft tokens per step; default: a speculators draft's speculative_tokens (as vLLM), else 1",
    )
    s.add_argument("--speculative-num-draft-tokens", type=int, default=None, help="verify width (num-steps + 1)")
    s.add_argument(
        "--speculative-eagle-topk",
        type=int,
        default=None,
        help="SGLang's flag: 1 (chain drafting, what mlaserve does); tree drafting (topk > 1) is refused",
    )
    s.add_argument(
        "--speculative-config",
        default=None,
        metavar="JSON",
        help='vLLM\'s flag, e.g. \'{"method": "eagle3", "model": DIR, "num_speculative_tokens": 3}\' (or our '
        "SpecConfig keys); instead of the --speculative-* flags",
    )
    s.add_argument(
        "--speculative-aux-layer-offset",
        type=int,
        default=0,
        choices=[0, 1],
        help="the draft's explicit eagle_aux_hidden_state_layer_ids: 0 reads the stream entering those layers (vLLM), "
        "1 leaving them (SGLang); the default ids (2, L/2, L-3) are read the same way by both",
    )
    s.add_argument(
        "--speculative-ngram-min-match-window-size",
        type=int,
        default=None,
        metavar="N",
        help="NGRAM: the shortest context suffix looked up (vLLM's prompt_lookup_min); default: the max, or 5",
    )
    s.add_argument(
        "--speculative-ngram-max-match-window-size",
        type=int,
        default=None,
        metavar="N",
        help="NGRAM: the longest context suffix looked up, tried first (vLLM's prompt_lookup_max); default: the "
        "min, or 5",
    )
    s.add_argument(
        "--speculative-replay-path",
        default=None,
        help="REPLAY (benchmark only): recorded greedy outputs, as `bench serve --save-replay FILE` writes them",
    )
    s.add_argument(
        "--speculative-replay-miss-rate",
        type=float,
        default=0.0,
        help="REPLAY (benchmark only): probability that a draft position is a deliberate miss (acceptance 1 - p)",
    )
    s.add_argument(
        "--speculative-replay-seed",
        type=int,
        default=0,
        help="REPLAY's misses and --speculative-simulate-acceptance's draws (benchmark only): the seed",
    )
    s.add_argument(
        "--speculative-simulate-acceptance",
        type=float,
        default=None,
        metavar="A",
        help="EAGLE3, benchmark only: accept each draft position with probability A whatever the target computes, "
        "so the speed at that acceptance is measured at any context; the text is then not the model's greedy text",
    )


ENGINE_FIELDS = (
    "device",
    "dtype",
    "page_size",
    "num_pages",
    "gpu_memory_utilization",
    "kv_cache_memory_gb",
    "max_num_seqs",
    "max_num_batched_tokens",
    "chunked_prefill_size",
    "max_model_len",
    "enable_prefix_caching",
    "enforce_eager",
    "disable_overlap_schedule",
    "deterministic",
    "prefill_graph_max_tokens",
    "prefill_graph_max_context",
    "attention_backend",
    "kv_cache_dtype",
    "moe_backend",
    "load_format",
    "seed",
    "max_logprobs",
    "tokenizer",
    "chat_template",
)


def engine_kwargs_from_args(args) -> dict:
    for line in compat_notes(args):
        log.info(line)
    kw = {f: getattr(args, f) for f in ENGINE_FIELDS}
    kw.update(parallel_sizes_from_args(args))
    kernels = kernels_from_args(args)
    if kernels is not None:
        kw["kernels"] = kernels
    if args.nnodes > 1:
        kw.update(nnodes=args.nnodes, node_rank=args.node_rank, dist_init_addr=args.dist_init_addr)
    if args.dist_init_timeout is not None:
        kw["dist_init_timeout"] = args.dist_init_timeout
    topk = args.speculative_eagle_topk
    if topk is not None and topk != 1:
        raise ValueError(
            f"--speculative-eagle-topk: tree drafting (topk > 1) is not implemented; chain drafting is 1, got {topk}"
        )
    ngram = (args.speculative_ngram_min_match_window_size, args.speculative_ngram_max_match_window_size)
    if ngram != (None, None) and args.speculative_algorithm != "NGRAM":
        raise ValueError(
            "--speculative-ngram-min/max-match-window-size: for --speculative-algorithm NGRAM "
            '(in --speculative-config: "prompt_lookup_min" / "prompt_lookup_max")'
        )
    if args.speculative_simulate_acceptance is not None and not args.speculative_algorithm:
        raise ValueError(
            "--speculative-simulate-acceptance: needs --speculative-algorithm EAGLE3 and its draft "
            '(in --speculative-config: "simulate_acceptance")'
        )
    if args.speculative_config is not None:
        if args.speculative_algorithm:
            raise ValueError("--speculative-config: give it or --speculative-algorithm and its flags, not both")
        try:
            spec = json.loads(args.speculative_config)
        except ValueError as e:
            raise ValueError(f"--speculative-config: not JSON ({e})") from None
        if not isinstance(spec, dict):
            raise ValueError(f"--speculative-config: a JSON object, got {args.speculative_config!r}")
        kw["speculative_config"] = spec
    elif args.speculative_algorithm:
        kw["speculative_config"] = {
            "algorithm": args.speculative_algorithm,
            "draft_model": args.speculative_draft_model_path,
            "num_steps": args.speculative_num_steps,  # None: the draft's default (SpecConfig.from_dict)
            "num_draft_tokens": args.speculative_num_draft_tokens,
            "aux_layer_offset": args.speculative_aux_layer_offset,
        }
        if args.speculative_algorithm == "NGRAM":
            kw["speculative_config"].update(
                prompt_lookup_min=args.speculative_ngram_min_match_window_size,
                prompt_lookup_max=args.speculative_ngram_max_match_window_size,
            )
        if args.speculative_algorithm == "REPLAY":
            kw["speculative_config"].update(
                replay_path=args.speculative_replay_path,
                replay_miss_rate=args.speculative_replay_miss_rate,
                replay_seed=args.speculative_replay_seed,
            )
        if args.speculative_simulate_acceptance is not None:
            kw["speculative_config"].update(
                simulate_acceptance=args.speculative_simulate_acceptance, replay_seed=args.speculative_replay_seed
            )
    return kw


def moe_a2a_min_tokens(value: str) -> int | str:
    """--moe-a2a-min-tokens: an integer >= 0, or off."""
    if value.lower() in ("off", "none"):
        return "off"
    try:
        n = int(value)
    except ValueError:
        n = -1
    if n < 0:
        raise argparse.ArgumentTypeError(f"{value!r}: an integer >= 0 (tokens), or off")
    return n


def kernels_from_args(args) -> KernelConfig | None:
    """The environment's KernelConfig with the kernel flags given applied; None when none was given."""
    n = getattr(args, "moe_a2a_min_tokens", None)
    if n is None:
        return None
    return dataclasses.replace(KernelConfig.from_env(), moe_a2a_min_tokens=None if n == "off" else n)


def run_if_follower_node(args) -> int | None:
    """On nodes > 0 of a multi-node run, serve as followers of node 0's engine; None on node 0."""
    if args.nnodes <= 1 or args.node_rank == 0:
        return None
    from .config import EngineConfig, SpecConfig
    from .distributed.engine_ranks import run_follower_node
    from .engine.cuda_graph import graph_safe_kernels

    kw = {f: getattr(args, f) for f in ENGINE_FIELDS}
    spec = engine_kwargs_from_args(args).get("speculative_config")
    spec = SpecConfig.from_dict(spec) if spec else None  # a sharded draft: these ranks hold shards of it too
    cfg = EngineConfig(model=args.model, kernels=kernels_from_args(args) or KernelConfig.from_env(), **kw)
    q = spec.num_steps + 1 if spec is not None else 1
    # the kernel edges node 0's LLM gives its ranks (llm.py), so that every rank computes the same forms
    cfg = dataclasses.replace(cfg, kernels=graph_safe_kernels(cfg.kernels, cfg.max_num_seqs, q))
    return run_follower_node(cfg, parallel_config_from_args(args), spec)


def add_sampling_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("sampling (unset: the model's generation_config.json, else greedy)")
    g.add_argument("--max-tokens", type=int, default=16)
    g.add_argument("--temperature", type=float, default=None, help="0 = greedy")
    g.add_argument("--top-p", type=float, default=None)
    g.add_argument("--top-k", type=int, default=None)
    g.add_argument("--min-p", type=float, default=None)
    g.add_argument("--sampling-seed", type=int, default=None, help="per-request sampling seed")
    g.add_argument("--stop", action="append", default=None, help="stop string (repeatable)")
    g.add_argument("--ignore-eos", action="store_true")


def sampling_params_from_args(args, model_dir: str | None = None) -> SamplingParams:
    """The flags given; a flag left unset takes generation_config.json's value (as the server's --generation-config
    auto), else greedy with no filtering."""
    gen = generation_sampling_defaults(model_dir)
    base = {"temperature": 0.0, "top_p": 1.0, "top_k": -1, "min_p": 0.0}
    pick = {k: getattr(args, k) if getattr(args, k) is not None else gen.get(k, v) for k, v in base.items()}
    return SamplingParams(
        **pick,
        max_tokens=args.max_tokens,
        seed=args.sampling_seed,
        stop=args.stop,
        ignore_eos=args.ignore_eos,
        **({"repetition_penalty": gen["repetition_penalty"]} if "repetition_penalty" in gen else {}),
    )


def chat_template(value: str) -> str:
    """--chat-template: a file's text, or the value itself when it is a template (it holds a '{')."""
    if os.path.isfile(value):
        try:
            with open(value, encoding="utf-8") as f:
                return f.read()
        except (OSError, UnicodeDecodeError) as e:
            raise argparse.ArgumentTypeError(f"{value}: cannot read it ({e})") from None
    if "{" in value:
        return value
    raise argparse.ArgumentTypeError(f"{value!r}: neither a file nor a jinja template")


def kv_cache_dtype(value: str) -> str:
    """--kv-cache-dtype: auto (the model's dtype), fp8 or fp8_e4m3 (an e4m3 latent cache, one scale per layer);
    anything else is refused, never ignored."""
    if value not in KV_CACHE_DTYPES:
        raise argparse.ArgumentTypeError(kv_cache_dtype_error(value))
    return value


def add_compat_args(p: argparse.ArgumentParser) -> None:
    """vLLM flags that people paste, each accepted with the meaning it has here (SGLang's names are aliases on the
    flags above: --mem-fraction-static, --context-length, --max-running-requests, --disable-radix-cache,
    --disable-cuda-graph, --tp-size)."""
    g = p.add_argument_group("accepted for compatibility")
    g.add_argument(
        "--trust-remote-code",
        action="store_true",
        help="accepted: mlaserve runs no code from the model folder (its model classes are built in)",
    )
    g.add_argument(
        "--enable-prefix-caching",
        dest="enable_prefix_caching",
        action="store_true",
        default=argparse.SUPPRESS,
        help="accepted: prefix caching is on unless --no-prefix-caching",
    )
    g.add_argument(
        "--enable-chunked-prefill",
        action="store_true",
        help="accepted: prefill is always chunked (--chunked-prefill-size, --max-num-batched-tokens)",
    )
    g.add_argument(
        "--enable-expert-parallel",
        action="store_true",
        help="the MoE layers split their experts over the ranks (--ep-size = --tp, --moe-tp-size 1), as vLLM's flag",
    )
    g.add_argument(
        "--disable-log-requests",
        action="store_true",
        help="accepted: mlaserve logs no prompts or outputs (only request ids)",
    )
    g.add_argument(
        "--swap-space",
        type=float,
        default=None,
        help="accepted: a preempted request's KV is recomputed, never swapped to the CPU, so no swap space is used",
    )


def compat_notes(args) -> list[str]:
    """One line for each accepted compatibility flag that was given, saying what it means here."""
    notes = []
    if getattr(args, "trust_remote_code", False):
        notes.append("--trust-remote-code: accepted; mlaserve runs no code from the model folder")
    if getattr(args, "enable_chunked_prefill", False):
        notes.append("--enable-chunked-prefill: accepted; prefill is always chunked")
    if getattr(args, "disable_log_requests", False):
        notes.append("--disable-log-requests: accepted; mlaserve logs no prompts or outputs")
    if getattr(args, "swap_space", None) is not None:
        notes.append("--swap-space: accepted; preempted requests recompute their KV, nothing is swapped")
    return notes


def add_parallel_args(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("parallelism (one process per rank; world = attn-tp = moe-tp * ep)")
    g.add_argument(
        "--tp",
        "--tensor-parallel-size",
        "--tp-size",
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
    g.add_argument(
        "--moe-a2a-min-tokens",
        type=moe_a2a_min_tokens,
        default=None,
        help="with --ep-size > 1: steps of at least N tokens send each token to its experts' ranks and back by "
        "all-to-all (run eagerly, outside CUDA graphs), smaller ones all-reduce; off: never "
        "(default: off)",
    )
    g.add_argument("--nnodes", type=int, default=1, help="machines (default: 1)")
    g.add_argument("--node-rank", type=int, default=0, help="this machine's index, 0 runs the scheduler")
    g.add_argument(
        "--dist-init-addr",
        default=None,
        help="host:port of node 0 for torch.distributed's rendezvous (needed with --nnodes > 1)",
    )
    g.add_argument(
        "--dist-init-timeout",
        type=float,
        default=None,
        help="seconds the ranks wait for each other at start before giving up with a message (default: 300)",
    )


def parallel_sizes_from_args(args) -> dict:
    """--tp, --attn-tp-size, --moe-tp-size and --ep-size as given, with --enable-expert-parallel applied (EP over the
    world, moe-TP 1): node 0's engine and the follower nodes read the layout through this one rule."""
    sizes = ("tp", "attn_tp_size", "moe_tp_size", "ep_size")
    kw = {f: getattr(args, f) for f in sizes if getattr(args, f, None) is not None}
    if getattr(args, "enable_expert_parallel", False):
        world = kw.get("attn_tp_size") or kw.get("tp") or 1
        if kw.get("moe_tp_size", 1) != 1 or kw.get("ep_size", world) != world:
            raise ValueError("--enable-expert-parallel: means --ep-size = --tp, --moe-tp-size 1; give one or the other")
        kw.update(moe_tp_size=1, ep_size=world)
    return kw


def parallel_config_from_args(args: argparse.Namespace) -> ParallelConfig:
    return ParallelConfig.from_tp(
        **parallel_sizes_from_args(args),
        nnodes=args.nnodes,
        node_rank=args.node_rank,
        dist_init_addr=args.dist_init_addr,
        **({} if args.dist_init_timeout is None else {"dist_init_timeout_s": args.dist_init_timeout}),
    )
