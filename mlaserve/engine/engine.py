"""LLMEngine: requests in (validated when added: a bad one raises ValueError naming the field and is never queued,
so one request's bad input cannot disturb the others), one step's events out.

The engine builds the model runner, the KV pool and the scheduler, then steps with the loop its mode needs
(loop.py): plain or speculative (spec_loop.py), each overlapped with the host on one rank (the default).
"""

from __future__ import annotations

import dataclasses
import logging
import time

import torch

from ..config import EngineConfig, ModelConfig, SpecConfig
from ..detokenizer import IncrementalDetokenizer
from ..distributed.tp import RankInfo
from ..tokenizer import Tokenizer
from ..types import Request, SamplingParams, Usage
from .cuda_graph import a2a_edge, captured_decode_sizes, graph_safe_kernels
from .grammar import GrammarCompiler
from .kv_pool import KVPool
from .loop import Loop, OverlapLoop
from .parallel import ParallelSampling
from .postprocess import Postprocessor, ReqState, StepOutput
from .runner import ModelRunner, resolve_dtype
from .scheduler import Scheduler
from .warmup import warm_up

__all__ = ["LLMEngine", "StepOutput"]

log = logging.getLogger("mlaserve.engine")


class LLMEngine:
    def __init__(
        self,
        cfg: EngineConfig,
        model_cfg: ModelConfig | None = None,
        runner: ModelRunner | None = None,
        spec: SpecConfig | None = None,
        proposer=None,
        ranks: RankInfo = RankInfo(),
        reserve_for: SpecConfig | None = None,
    ):
        """reserve_for (benchmarks): a plain engine (spec None) whose runner a speculative engine of that SpecConfig
        will share sets aside the draft's KV pages and weights, as that engine's own runner would."""
        cfg.validate()
        # the FP8 activation edge where CUDA-graph padding cannot cross it (LLM applied it already for TP ranks)
        q = spec.num_steps + 1 if spec is not None else 1
        cfg = dataclasses.replace(cfg, kernels=graph_safe_kernels(cfg.kernels, cfg.max_num_seqs, q))
        self.cfg, self.spec = cfg, spec
        self.model_config = model_cfg or ModelConfig.from_pretrained(cfg.model)
        from ..spec.build import draft_memory

        dtype = resolve_dtype(cfg.dtype, self.model_config)
        extra, reserve = draft_memory(spec or reserve_for, cfg.page_size, dtype, self.model_config, ranks)
        self.runner = runner or ModelRunner(
            cfg, self.model_config, ranks=ranks, extra_page_bytes=extra, reserve_bytes=reserve
        )
        log.info("kernels: %s", self.runner.kernels)  # the switches and thresholds every kernel call site got
        if self.runner.kernels.deterministic:
            log.info(self.runner.kernels.deterministic_summary())
        self.proposer = proposer
        if spec is not None and proposer is None:
            from ..spec.build import build_proposer

            self.proposer = build_proposer(spec, self.runner)
        self.spec_k = spec.num_steps if spec is not None else 0
        self.tokenizer = Tokenizer.from_pretrained(cfg.tokenizer or cfg.model)
        if cfg.tokenizer and self.tokenizer is None:
            raise ValueError(f"tokenizer: {cfg.tokenizer} holds no tokenizer (tokenizer.json or tiktoken.model)")
        if cfg.chat_template is not None:
            if self.tokenizer is None:
                raise ValueError("chat_template: the model has no tokenizer to apply it with")
            self.tokenizer.set_chat_template(cfg.chat_template)
        self.max_model_len = cfg.max_model_len or self.model_config.max_position_embeddings
        if self.max_model_len > self.model_config.max_position_embeddings:
            log.warning(
                "max_model_len %d exceeds the model's max_position_embeddings %d: positions past it were never trained",
                self.max_model_len,
                self.model_config.max_position_embeddings,
            )
        self.pool = KVPool(self.runner.num_pages, cfg.page_size, cfg.enable_prefix_caching)
        self.max_model_len = self._fit_cache(self.max_model_len)
        self.scheduler = Scheduler(cfg, self.pool, decode_q_len=self.spec_k + 1)
        self.states: dict[str, ReqState] = {}
        self.parallel = ParallelSampling()
        self.generator = torch.Generator(device=self.runner.device).manual_seed(cfg.seed)
        eos = set(self.model_config.eos_token_ids)
        if self.tokenizer is not None:
            eos |= set(self.tokenizer.eos_token_ids)
        self.eos_token_ids = frozenset(eos)
        self.grammars = GrammarCompiler(self.tokenizer, self.model_config.vocab_size, self.eos_token_ids)
        self.spec_step_graphs = None  # the greedy speculative step in one graph (spec_graph.py), when captured
        if self.runner.device.type == "cuda" and not cfg.enforce_eager:
            self.runner.capture_graphs(self.spec_k + 1, self.max_model_len)
            if hasattr(self.proposer, "capture_graphs"):
                max_bs = self._draft_graph_max_bs()
                if max_bs:
                    self.proposer.capture_graphs(max_bs, self.runner.graphs.max_pages)
                    self.capture_spec_step_graphs()
        elif self.runner.device.type == "cpu" and hasattr(self.proposer, "capture_graphs"):
            # the draft's static step, run eagerly: a greedy decode-only verify drafts from its device outputs on
            # the CPU too (spec_loop.py), so the path the GPU's graphs take is the one CI runs
            pages = self.runner.graph_max_pages(self.spec_k + 1, self.max_model_len)
            self.proposer.capture_graphs(cfg.max_num_seqs, pages, use_graphs=False)
        self.warmup_seconds = None  # the start-up warm-up's time (warmup.py), when it ran
        if self.runner.device.type == "cuda" and cfg.warmup:  # after capture: the graphs' shapes are compiled
            self.warmup_seconds = warm_up(self)
        self.post = Postprocessor(self.scheduler, self.states, self.max_model_len)
        if spec is not None:
            from .spec_loop import SpecLoop

            self.loop = SpecLoop(self)
        else:
            self.loop = Loop(self)
        if ranks.world_size == 1 and not cfg.disable_overlap_schedule:  # overlapped steps (loop.py): one rank
            self.loop = OverlapLoop(self.loop)

    def _draft_graph_max_bs(self) -> int:
        """The largest batch of the draft's graphs: max_num_seqs, but for a draft sharded over EP ranks the verify
        graphs' largest (their steps stay below the MoE all-to-all, which no graph holds: cuda_graph.py);
        0: none."""
        from ..spec.build import draft_is_sharded

        if not draft_is_sharded(self.spec, self.runner.ranks.world_size):
            return self.cfg.max_num_seqs
        edge = a2a_edge(self.runner.ranks, self.runner.kernels)
        return max(captured_decode_sizes(self.cfg.max_num_seqs, self.spec_k + 1, edge), default=0)

    def capture_spec_step_graphs(self, use_graphs: bool = True) -> None:
        """The step graphs of greedy EAGLE3 and NGRAM steps (spec_graph.py), over the runner's verify graphs and the
        draft's static step (NGRAM: its lookup), on one rank (their inputs come from the device). use_graphs=False:
        the same step run eagerly (the CPU tests, after runner.capture_graphs(..., use_graphs=False))."""
        draft = getattr(self.proposer, "graphs", None)
        if draft is None or self.runner.graphs is None or self.runner.ranks.world_size > 1:
            return
        if self.spec.simulate_acceptance is not None:  # a benchmark's: its steps take the launches (spec_loop.py)
            return
        from .spec_graph import SpecStepGraphs

        self.spec_step_graphs = SpecStepGraphs(self.runner.graphs, draft, use_graphs)
        self.spec_step_graphs.capture()
        loop = getattr(self, "loop", None)
        if loop is not None:  # built after the engine's loop (the CPU tests)
            getattr(loop, "loop", loop).step_graphs = self.spec_step_graphs

    @property
    def cache_tokens(self) -> int:
        """The longest request the KV cache holds alone: its pages, less the verify step's and its drafts' slots
        past the fed tokens (2 K) that speculative decoding reserves."""
        return self.pool.num_pages * self.pool.page_size - 2 * self.spec_k

    def _cache_note(self) -> str:
        p = self.pool
        reserve = f", less {2 * self.spec_k} for speculative steps" if self.spec_k else ""
        return f"the KV cache holds {self.cache_tokens} tokens ({p.num_pages} pages of {p.page_size}{reserve})"

    def _fit_cache(self, max_model_len: int) -> int:
        """vLLM's rule: one request of max_model_len tokens must fit the KV cache; a smaller cache lowers it."""
        if self.cache_tokens < self.pool.page_size:
            raise ValueError(f"num_pages: {self._cache_note()}, less than one page: no request fits; give more pages")
        if max_model_len > self.cache_tokens:
            log.warning(
                "max_model_len lowered from %d to %d: %s; give it more pages (--num-pages, --gpu-memory-utilization, "
                "--kv-cache-memory-gb) to serve longer requests",
                max_model_len,
                self.cache_tokens,
                self._cache_note(),
            )
            return self.cache_tokens
        return max_model_len

    # ---- requests ------------------------------------------------------------------------------
    def truncated(self, ids: list[int], keep: int | None, max_tokens: int | None) -> list[int]:
        """truncate_prompt_tokens (vLLM's): the prompt's last `keep` tokens (None: all of them); -1: the last
        max_model_len - max_tokens (max_tokens None: max_model_len - 1), what leaves room to generate."""
        if keep is None:
            return ids
        n = self.max_model_len
        if keep > n:
            raise ValueError(f"truncate_prompt_tokens: {keep} is more than max_model_len {n}")
        if keep == -1:
            keep = max(1, n - (max_tokens or 1))
        return ids[-keep:]

    def validate(self, prompt_token_ids: list[int], params: SamplingParams) -> None:
        """Raise ValueError naming the field and the limit; nothing is queued."""
        params.validate()
        prompt_token_ids = self.truncated(prompt_token_ids, params.truncate_prompt_tokens, params.max_tokens)
        n = len(prompt_token_ids)
        if n == 0:
            raise ValueError("prompt: must not be empty")
        V = self.model_config.vocab_size
        ids = prompt_token_ids
        if not (set(map(type, ids)) == {int} and min(ids) >= 0 and max(ids) < V):  # C loops; the Python one names it
            for i, t in enumerate(ids):
                if not isinstance(t, int) or isinstance(t, bool) or not 0 <= t < V:
                    raise ValueError(f"prompt: token id {t!r} at index {i} is outside the vocabulary [0, {V})")
        if n >= self.max_model_len:
            raise ValueError(
                f"prompt: {n} tokens leave no room to generate within max_model_len {self.max_model_len} "
                f"({self._cache_note()})"
            )
        if params.max_tokens is not None and n + params.max_tokens > self.max_model_len:
            raise ValueError(
                f"max_tokens: {params.max_tokens} plus the prompt's {n} tokens is {n + params.max_tokens}, more than "
                f"max_model_len {self.max_model_len} ({self._cache_note()})"
            )
        for name in ("logprobs", "prompt_logprobs"):
            k = getattr(params, name)
            if k is not None and k > self.cfg.max_logprobs:
                raise ValueError(f"{name}: {k} exceeds the server's max_logprobs {self.cfg.max_logprobs}")
        for t in params.logit_bias or ():
            if t >= V:
                raise ValueError(f"logit_bias: token id {t} is outside the vocabulary [0, {V})")
        for t in params.allowed_token_ids or ():
            if t >= V:
                raise ValueError(f"allowed_token_ids: token id {t} is outside the vocabulary [0, {V})")
        pr = params.prediction
        if pr is not None and not isinstance(pr, str):
            for t in pr:
                if t >= V:
                    raise ValueError(f"prediction: token id {t} is outside the vocabulary [0, {V})")
        if isinstance(pr, str) and self.tokenizer is None and self.spec is not None and self.spec.is_ngram:
            raise ValueError("prediction: text needs a tokenizer; this model has none (give token ids)")
        if params.bad_words:
            if self.tokenizer is None:
                raise ValueError("bad_words: need a tokenizer; this model has none")
        if self.spec_k and params.num_seqs > params.n:  # the verify rows keep no cumulative logprob to rank by
            raise ValueError("best_of: not supported together with speculative decoding")
        if params.structured is not None:
            self.grammars.compile(params.structured)  # a ValueError naming the field; cached for _add
        if params.stop and self.tokenizer is None:
            raise ValueError("stop: stop strings need a tokenizer; this model has none")
        if params.num_seqs > self.cfg.max_queue_len:
            what = "best_of" if params.best_of else "n"
            raise ValueError(f"{what}: {params.num_seqs} sequences exceed max_queue_len {self.cfg.max_queue_len}")
        if self.scheduler.num_unfinished + params.num_seqs > self.cfg.max_queue_len:
            raise OverflowError(
                f"the engine already holds {self.scheduler.num_unfinished} requests "
                f"(max_queue_len {self.cfg.max_queue_len})"
            )

    def add_request(self, prompt_token_ids: list[int], params: SamplingParams, request_id: str | None = None) -> str:
        """Queue a request; n > 1 or best_of: its sequences as child requests (parallel.py), whose events carry
        this request id and their choice as StepOutput.index."""
        self.validate(prompt_token_ids, params)
        prompt_token_ids = self.truncated(prompt_token_ids, params.truncate_prompt_tokens, params.max_tokens)
        if request_id is not None and (request_id in self.states or request_id in self.parallel.groups):
            raise ValueError(f"request_id: {request_id!r} is already in use")
        if params.num_seqs == 1:
            reqs = [self._add(list(prompt_token_ids), params, request_id)]
            rid = reqs[0].request_id
        else:
            rid = request_id or Request([], params).request_id
            reqs = self.parallel.children(rid, list(prompt_token_ids), params, self._add)
        for r in reqs:
            self.scheduler.add(r)
        return rid

    def _add(self, prompt_token_ids: list[int], params: SamplingParams, request_id: str | None = None) -> Request:
        req = Request(prompt_token_ids, params, arrival=time.monotonic())
        if request_id is not None:
            req.request_id = request_id
        gen = None
        if params.seed is not None and not params.greedy:
            gen = torch.Generator(device=self.runner.device).manual_seed(params.seed)
        detok = IncrementalDetokenizer(
            self.tokenizer,
            req.prompt_token_ids,
            stop=params.stop,
            include_stop_str_in_output=params.include_stop_str_in_output,
            skip_special_tokens=params.skip_special_tokens,
            keep_special_token_ids=params.keep_special_token_ids,
        )
        eos = frozenset() if params.ignore_eos else self.eos_token_ids
        grammar = self.grammars.state(params.structured) if params.structured is not None else None
        st = ReqState(req, detok, gen, eos, grammar=grammar)
        if params.bad_words:
            st.cache["bad_words"] = bad_word_ids(self.tokenizer, params.bad_words)
        if params.prediction is not None and self.spec is not None and self.spec.is_ngram:  # others ignore it
            pr = params.prediction
            ids = self.tokenizer.encode(pr, add_special_tokens=False) if isinstance(pr, str) else list(pr)
            req.prediction_token_ids = ids[: self.max_model_len]  # drafts past max_model_len are never verified
        self.states[req.request_id] = st
        return req

    def abort_request(self, request_id: str) -> bool:
        """Finish a request (every sequence of it) now and free its pages; False if it is unknown or already done."""
        children = self.parallel.child_ids(request_id)
        if children is not None:
            self.parallel.drop(request_id)
            return any([self.abort_request(c) for c in children])
        st = self.states.pop(request_id, None)
        if st is None:
            return False
        self.scheduler.finish(st.req, "abort")
        return True

    def has_unfinished(self) -> bool:
        return self.scheduler.num_unfinished > 0 or self.loop.pending

    def reset_prefix_cache(self) -> int | None:
        """Forget every cached prefix (vLLM's reset_prefix_cache: a benchmark's runs each start cold) -> the pages
        freed; None, and nothing done, while a request is running or waiting (their pages are in use)."""
        if self.has_unfinished():
            return None
        freed = len(self.pool.evictable)
        self.pool.reset_prefix_cache()
        return freed

    # ---- the step --------------------------------------------------------------------------------
    def step(self) -> list[StepOutput]:
        """One step's events (loop.py: plain, overlapped or speculative)."""
        outs = self.loop.step()
        if self.scheduler.cannot_fit:
            outs += self._cannot_fit_events()
        return self.parallel.route(outs) if self.parallel.groups else outs

    def _cannot_fit_events(self) -> list[StepOutput]:
        """The last event of each request the scheduler finished because the whole cache cannot hold it."""
        outs = []
        for req in self.scheduler.cannot_fit:
            st = self.states.pop(req.request_id, None)
            if st is None:
                continue
            log.warning("%s: finished by length at %d tokens: %s", req.request_id, req.num_tokens, self._cache_note())
            text = st.detok.flush()[0]
            outs.append(StepOutput(req.request_id, [], text, True, "length", None, None, self.usage(req)))
        self.scheduler.cannot_fit.clear()
        return outs

    def usage(self, req: Request) -> Usage:
        return self.post.usage(req)

    @property
    def num_steps(self) -> int:
        return self.loop.num_steps

    @property
    def num_overlapped_steps(self) -> int:
        return self.loop.num_overlapped_steps

    @property
    def num_generated_tokens(self) -> int:
        return self.post.num_generated_tokens

    def stats(self) -> dict:
        # the verify counts are SpecLoop's; the other loops verify nothing
        return {
            "spec_steps": getattr(self.loop, "spec_steps", 0),
            "spec_draft_tokens": getattr(self.loop, "spec_draft_tokens", 0),
            "spec_accepted_tokens": getattr(self.loop, "spec_accepted_tokens", 0),
            "spec_accepted_per_position": list(getattr(self.loop, "spec_accepted_per_position", ())),
            "spec_device_steps": getattr(self.loop, "spec_device_steps", 0),
            "running": len(self.scheduler.running),
            "waiting": len(self.scheduler.waiting),
            "kv_pages_used": self.pool.num_used,
            "kv_pages_total": self.pool.num_pages,
            "prefix_cache_queries": self.pool.queries,
            "prefix_cache_hits": self.pool.hits,
            "steps": self.num_steps,
            "overlapped_steps": self.num_overlapped_steps,
            "generated_tokens": self.num_generated_tokens,
        }


def bad_word_ids(tokenizer: Tokenizer, words: list[str]) -> list[tuple[int, ...]]:
    """bad_words -> the token sequences to ban: each word as it starts a text and after a space (how it appears
    inside one), without special tokens; duplicates dropped."""
    seqs: list[tuple[int, ...]] = []
    for w in words:
        for form in (w.lstrip(), " " + w.lstrip()):
            ids = tuple(tokenizer.encode(form, False))
            if ids and ids not in seqs:
                seqs.append(ids)
    return seqs
