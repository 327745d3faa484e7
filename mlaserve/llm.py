"""The offline API (vLLM-shaped): LLM(model).generate(prompts, SamplingParams), and `mlaserve generate`.

With no model given, the embedded default is used: a tiny random checkpoint, made on first use in the cache.
"""

from __future__ import annotations

import argparse
import os
import sys

from tqdm import tqdm

from .config import EngineConfig, SpecConfig
from .paths import cache_dir
from .types import CompletionOutput, RequestOutput, SamplingParams

DEFAULT_MODEL_NAME = "tiny-random-v1"


def default_model_path() -> str:
    """The embedded default model: the built-in tiny preset with random weights (seed 0), made once."""
    path = os.path.join(cache_dir(), DEFAULT_MODEL_NAME)
    if not os.path.isfile(os.path.join(path, "model.safetensors.index.json")):
        from .models.make_random import make_random

        tmp = f"{path}.tmp-{os.getpid()}"
        make_random("tiny", tmp, seed=0, dtype="float32", progress=False)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        try:
            os.rename(tmp, path)  # atomic: a concurrent first use sees a whole folder or none
        except OSError:
            import shutil

            shutil.rmtree(tmp, ignore_errors=True)
    return path


class LLM:
    def __init__(
        self,
        model: str | None = None,
        *,
        device: str = "auto",
        dtype: str = "auto",
        attn_tp_size: int | None = None,
        moe_tp_size: int | None = None,
        ep_size: int | None = None,
        tp: int | None = None,
        nnodes: int = 1,
        node_rank: int = 0,
        dist_init_addr: str | None = None,
        speculative_config: dict | None = None,
        seed: int = 0,
        on_rank_failure=None,
        **engine_kwargs,
    ):
        from .config import ModelConfig, ParallelConfig
        from .engine.engine import LLMEngine

        model = model or default_model_path()
        self.engine_config = EngineConfig(model=model, device=device, dtype=dtype, seed=seed, **engine_kwargs)
        self.parallel = ParallelConfig.from_tp(
            tp,
            attn_tp_size=attn_tp_size,
            moe_tp_size=moe_tp_size,
            ep_size=ep_size,
            nnodes=nnodes,
            node_rank=node_rank,
            dist_init_addr=dist_init_addr,
        )
        spec = SpecConfig.from_dict(speculative_config) if speculative_config else None
        self._workers = None
        ranks = None
        if self.parallel.world_size > 1:
            from .distributed.engine_ranks import start_rank0

            model_cfg = ModelConfig.from_pretrained(model)
            ranks, self._workers = start_rank0(
                self.engine_config,
                self.parallel,
                model_cfg,
                **({"on_failure": on_rank_failure} if on_rank_failure else {}),
            )
        self.engine = LLMEngine(self.engine_config, spec=spec, **({"ranks": ranks} if ranks else {}))
        self.tokenizer = self.engine.tokenizer

    def close(self) -> None:
        """Stop the other ranks (tensor parallelism); the LLM cannot be used afterwards."""
        if self._workers is not None:
            from .distributed.engine_ranks import stop_rank0

            self.engine.runner.shutdown()
            stop_rank0(self._workers)
            self._workers = None

    def _prompt_ids(self, prompt) -> tuple[list[int], str | None]:
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError("prompt: this model has no tokenizer; pass token ids (list[int])")
            return self.tokenizer.encode(prompt, add_special_tokens=True), prompt
        if isinstance(prompt, (list, tuple)) and all(isinstance(t, int) for t in prompt):
            return list(prompt), None
        raise ValueError(f"prompt: must be a str or a list of token ids, got {type(prompt).__name__}")

    def generate(
        self, prompts, sampling_params: SamplingParams | list[SamplingParams] | None = None, use_tqdm: bool = True
    ) -> list[RequestOutput]:
        """prompts: a str, a list of str, a list of token ids, or a list of lists of token ids. Outputs in order."""
        if isinstance(prompts, str) or (isinstance(prompts, list) and prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        params = sampling_params or SamplingParams()
        params = params if isinstance(params, list) else [params] * len(prompts)
        if len(params) != len(prompts):
            raise ValueError(f"sampling_params: {len(params)} given for {len(prompts)} prompts")
        encoded = [self._prompt_ids(p) for p in prompts]
        for (ids, _), sp in zip(encoded, params):  # refuse the whole call before queueing anything
            self.engine.validate(ids, sp)
        rids = [self.engine.add_request(ids, sp) for (ids, _), sp in zip(encoded, params)]
        results: dict[str, dict] = {r: {"ids": [], "text": "", "lp": [], "reason": None, "stop": None} for r in rids}
        usage = {}
        bar = tqdm(total=len(rids), desc="Generating", unit="req", disable=not use_tqdm or len(rids) < 2)
        while self.engine.has_unfinished():
            for o in self.engine.step():
                r = results[o.request_id]
                r["ids"] += o.new_token_ids
                r["text"] += o.new_text
                r["lp"] += o.new_logprobs or []
                if o.finished:
                    r["reason"], r["stop"] = o.finish_reason, o.stop_reason
                    usage[o.request_id] = o.usage
                    bar.update()
        bar.close()
        outs = []
        for rid, (ids, text), sp in zip(rids, encoded, params):
            r = results[rid]
            comp = CompletionOutput(
                r["ids"], r["text"], r["reason"], r["lp"] if sp.logprobs is not None else None, r["stop"]
            )
            outs.append(RequestOutput(rid, ids, [comp], True, usage[rid], prompt=text))
        return outs


# ---- `mlaserve generate` ----------------------------------------------------------------------------
def add_cli_args(p: argparse.ArgumentParser) -> None:
    from .args import add_engine_args, add_sampling_args

    p.add_argument("model", nargs="?", default=None, help="model folder (default: the embedded tiny random model)")
    p.add_argument("--prompt", action="append", required=True, help="a prompt (repeat for several)")
    add_sampling_args(p)
    add_engine_args(p)


def cli_main(args) -> int:
    from .args import engine_kwargs_from_args, run_if_follower_node, sampling_params_from_args

    rc = run_if_follower_node(args)
    if rc is not None:
        return rc
    llm = LLM(args.model, **engine_kwargs_from_args(args))
    outs = llm.generate(args.prompt, sampling_params_from_args(args))
    for o in outs:
        sys.stdout.write(f"{o.prompt!r} -> {o.text!r}\n  tokens: {o.token_ids} ({o.outputs[0].finish_reason})\n")
    llm.close()
    return 0
