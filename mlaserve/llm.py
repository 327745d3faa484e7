"""The offline API (vLLM-shaped): LLM(model).generate(prompts, SamplingParams), and `mlaserve generate`.

With no model given, the embedded default is used: a small Python code model shipped in the package (and, with
EAGLE3 and no draft given, its draft).
Under tensor parallelism a rank that dies makes the call in progress (or the next one) raise RankFailed, naming it.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import os
import sys
import threading
import time

from tqdm import tqdm

from .config import EngineConfig, SpecConfig
from .paths import cache_dir
from .types import CompletionOutput, RequestOutput, SamplingParams

TINY_RANDOM_NAME = "tiny-random-v1"
ASSETS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "assets")
RANK_REPORT_S = 5.0  # a step that failed on a collective waits this long for the watchdog to name a dead rank
STUCK_EXIT_S = 15.0  # after a rank died, a main thread still inside the engine this long is stuck in a collective


def default_model_path() -> str:
    """The embedded default model: a 12.8 M-parameter DeepSeek-V3 trained on Python source by `mlaserve
    train-model` (its card: README.md in the folder), shipped in the package."""
    return os.path.join(ASSETS, "pycode-13m")


def default_draft_path() -> str:
    """The default model's EAGLE3 draft, distilled by `mlaserve train-draft` (train_draft.json in the folder)."""
    return os.path.join(ASSETS, "pycode-13m-eagle3")


def tiny_random_model_path() -> str:
    """The built-in tiny preset with random weights (seed 0), made once in the cache: odd shapes for tests."""
    path = os.path.join(cache_dir(), TINY_RANDOM_NAME)
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
        dist_init_timeout: float | None = None,
        speculative_config: dict | None = None,
        seed: int = 0,
        on_rank_failure=None,
        **engine_kwargs,
    ):
        from .config import ModelConfig, ParallelConfig
        from .engine.cuda_graph import graph_safe_kernels
        from .engine.engine import LLMEngine

        if not model:
            model = default_model_path()
            if isinstance(speculative_config, dict) and speculative_config:  # a SpecConfig names its own draft
                spec = SpecConfig.normalize(speculative_config)
                if spec.get("algorithm", "EAGLE3") == "EAGLE3" and not spec.get("draft_model"):
                    speculative_config = {**spec, "draft_model": default_draft_path()}  # the default model's own
        self.engine_config = EngineConfig(model=model, device=device, dtype=dtype, seed=seed, **engine_kwargs)
        self.parallel = ParallelConfig.from_tp(
            tp,
            attn_tp_size=attn_tp_size,
            moe_tp_size=moe_tp_size,
            ep_size=ep_size,
            nnodes=nnodes,
            node_rank=node_rank,
            dist_init_addr=dist_init_addr,
            **({"dist_init_timeout_s": dist_init_timeout} if dist_init_timeout is not None else {}),
        )
        spec = SpecConfig.from_dict(speculative_config) if speculative_config else None
        q = spec.num_steps + 1 if spec is not None else 1  # tokens a request decodes per step
        kernels = graph_safe_kernels(self.engine_config.kernels, self.engine_config.max_num_seqs, q)
        self.engine_config = dataclasses.replace(self.engine_config, kernels=kernels)  # what every rank gets
        self._workers = None
        self._on_rank_failure = on_rank_failure  # None: raise in the main thread (_rank_failed)
        self._busy = 0  # > 0 while the main thread runs the engine
        ranks = None
        if self.parallel.world_size > 1:
            from .distributed.engine_ranks import start_rank0

            model_cfg = ModelConfig.from_pretrained(model)
            ranks, self._workers = start_rank0(
                self.engine_config, self.parallel, model_cfg, on_failure=self._rank_failed, spec=spec
            )
        try:
            with self._engine_call():
                self.engine = LLMEngine(self.engine_config, spec=spec, **({"ranks": ranks} if ranks else {}))
        except BaseException:
            if self._workers is not None:
                from .distributed.engine_ranks import abandon_rank0

                abandon_rank0(self._workers)
                self._workers = None
            raise
        self.tokenizer = self.engine.tokenizer

    @property
    def weight_bytes(self):
        """The weights each rank holds, by kind (models/weight_bytes.WeightBytes, in rank order)."""
        return self.engine.runner.weight_bytes_per_rank

    # ---- a rank that dies (tensor parallelism) ---------------------------------------------------------
    def set_rank_failure_handler(self, handler) -> None:
        """handler(RankFailed), called on the watchdog thread when a rank dies, in place of raising in the main
        thread (the server's: fail the requests, answer 503, exit)."""
        self._on_rank_failure = handler

    def rank_failure(self, wait: float = 0.0):
        """The RankFailed of a rank that died (waiting up to `wait` seconds for the watchdog's report), or None."""
        if self._workers is None:
            return None
        deadline = time.monotonic() + wait
        while self._workers.failure is None and time.monotonic() < deadline:
            time.sleep(0.05)
        return self._workers.failure

    def root_cause(self, e: BaseException) -> BaseException:
        """What made the engine fail with e: a dead rank's RankFailed when e is an error of a collective with it (gloo,
        NCCL and CUDA errors are RuntimeErrors; the watchdog's report may take a moment), else e."""
        if isinstance(e, RuntimeError):
            return self.rank_failure(RANK_REPORT_S) or e
        return e

    def _rank_failed(self, e) -> None:
        """The watchdog thread's report. By default the main thread raises e: at its next step, or as its collective
        with the dead rank fails (gloo notices the closed connection). A collective that never returns (an NCCL or
        symmetric-memory kernel waiting on a dead GPU) cannot raise: after STUCK_EXIT_S still inside the engine,
        the process exits with the message."""
        if self._on_rank_failure is not None:
            self._on_rank_failure(e)
            return

        def exit_if_stuck():
            time.sleep(STUCK_EXIT_S)
            if self._busy:
                from .distributed.launch import abort

                abort(e)

        threading.Thread(target=exit_if_stuck, daemon=True, name="rank-failure-exit").start()

    @contextlib.contextmanager
    def _engine_call(self):
        """Around the main thread's use of the engine: a dead rank's RankFailed instead of its collective's error."""
        failure = self.rank_failure()
        if failure is not None:
            raise failure
        self._busy += 1
        try:
            yield
        except RuntimeError as e:
            cause = self.root_cause(e)
            if cause is not e:
                raise cause from e
            raise
        finally:
            self._busy -= 1

    def reset_prefix_cache(self) -> bool:
        """Forget every cached prefix, so the next prompts are computed whole (False, and nothing done, while a
        request is unfinished)."""
        return self.engine.reset_prefix_cache() is not None

    def close(self) -> None:
        """Stop the other ranks (tensor parallelism) and free the engine: its weights, KV cache and CUDA graphs go
        back to the device, so another LLM can start in the same process. The LLM cannot be used afterwards."""
        if self._workers is not None:
            from .distributed.engine_ranks import stop_rank0

            try:
                if self._workers.failure is None:  # after a failure nobody is left to tell
                    self.engine.runner.shutdown()
            finally:
                stop_rank0(self._workers)
                self._workers = None
        if getattr(self, "engine", None) is not None:
            cuda = self.engine.runner.device.type == "cuda"
            self.engine = None
            import gc

            gc.collect()  # the engine's modules and graphs hold reference cycles
            if cuda:
                import torch

                torch.cuda.empty_cache()

    def chat(
        self,
        messages: list[dict] | list[list[dict]],
        sampling_params: SamplingParams | list[SamplingParams] | None = None,
        use_tqdm: bool = True,
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        tools: list[dict] | None = None,
        chat_template_kwargs: dict | None = None,
    ) -> list[RequestOutput]:
        """vLLM's LLM.chat: one conversation (a list of messages) or several, each through the model's chat template,
        then generate(); each output's `prompt` is its rendered text, and its text the raw reply (no tool-call or
        reasoning parsing: the server does that). continue_final_message: the reply continues the last message."""
        if self.tokenizer is None:
            raise ValueError("messages: this model has no tokenizer, so no chat template; use generate()")
        convs = [messages] if messages and isinstance(messages[0], dict) else messages
        if not convs or any(not isinstance(c, list) or not c for c in convs):
            raise ValueError("messages: a non-empty list of messages, or a list of such lists")
        kwargs = {**(chat_template_kwargs or {}), **({"tools": tools} if tools else {})}
        texts = [
            self.tokenizer.apply_chat_template(
                c,
                add_generation_prompt=add_generation_prompt and not continue_final_message,
                continue_final_message=continue_final_message,
                **kwargs,
            )
            for c in convs
        ]
        outs = self.generate(
            [self.tokenizer.encode(t, add_special_tokens=False) for t in texts], sampling_params, use_tqdm
        )
        for o, t in zip(outs, texts):
            o.prompt = t
        return outs

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
        n_of = dict(zip(rids, (sp.n for sp in params)))
        results: dict[str, dict[int, dict]] = {r: {} for r in rids}
        usage, prompt_lps, done = {}, {}, {r: 0 for r in rids}
        bar = tqdm(total=len(rids), desc="Generating", unit="req", disable=not use_tqdm or len(rids) < 2)
        with self._engine_call():
            while self.engine.has_unfinished():
                if self._workers is not None and self._workers.failure is not None:
                    raise self._workers.failure
                for o in self.engine.step():
                    r = results[o.request_id].setdefault(
                        o.index, {"ids": [], "text": "", "lp": [], "top": [], "reason": None, "stop": None}
                    )
                    r["ids"] += o.new_token_ids
                    r["text"] += o.new_text
                    r["lp"] += o.new_logprobs or []
                    r["top"] += o.new_top_logprobs or []
                    r["cum"] = o.cumulative_logprob
                    if o.prompt_logprobs is not None:
                        prompt_lps[o.request_id] = o.prompt_logprobs
                    if o.finished:
                        r["reason"], r["stop"] = o.finish_reason, o.stop_reason
                        usage[o.request_id] = o.usage
                        done[o.request_id] += 1
                        if done[o.request_id] == n_of[o.request_id]:
                            bar.update()
            self.engine.runner.park()  # TP: the other ranks wait on the host group until the next call
        bar.close()
        outs = []
        for rid, (ids, text), sp in zip(rids, encoded, params):
            ids = self.engine.truncated(ids, sp.truncate_prompt_tokens, sp.max_tokens)  # the prompt that ran
            comps = []
            for i in range(sp.n):
                r = results[rid][i]
                lp = sp.logprobs is not None
                comps.append(
                    CompletionOutput(
                        r["ids"],
                        r["text"],
                        r["reason"],
                        r["lp"] if lp else None,
                        r["stop"],
                        top_logprobs=r["top"] if lp else None,
                        cumulative_logprob=r.get("cum"),
                        index=i,
                    )
                )
            outs.append(
                RequestOutput(rid, ids, comps, True, usage[rid], prompt=text, prompt_logprobs=prompt_lps.get(rid))
            )
        return outs


# ---- `mlaserve generate` ----------------------------------------------------------------------------
def add_cli_args(p: argparse.ArgumentParser) -> None:
    from .args import add_engine_args, add_sampling_args

    p.add_argument("model", nargs="?", default=None, help="model folder (default: the embedded Python code model)")
    p.add_argument("--prompt", action="append", required=True, help="a prompt (repeat for several)")
    p.add_argument("--show-ids", action="store_true", help="print each prompt and output as Python strings, with ids")
    add_sampling_args(p)
    add_engine_args(p)


def cli_main(args) -> int:
    from .args import engine_kwargs_from_args, run_if_follower_node, sampling_params_from_args

    rc = run_if_follower_node(args)
    if rc is not None:
        return rc
    # the sampling flags are checked before the model loads (generation_config.json fills the unset ones)
    params = sampling_params_from_args(args, args.model or default_model_path())
    llm = LLM(args.model, **engine_kwargs_from_args(args))
    outs = llm.generate(args.prompt, params)
    for i, o in enumerate(outs):
        c = o.outputs[0]
        if args.show_ids:
            sys.stdout.write(f"{o.prompt!r} -> {o.text!r}\n  tokens: {o.token_ids} ({c.finish_reason})\n")
            continue
        head = f"request {i}: {len(c.token_ids)} tokens, finish_reason {c.finish_reason}"
        sys.stdout.write(f"--- {head} (temperature {params.temperature:g}, top_p {params.top_p:g})\n")
        sys.stdout.write(f"{o.prompt}{o.text}\n")
    llm.close()
    return 0
