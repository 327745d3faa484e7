"""Prometheus metrics of one server, in their own registry (no process-wide state)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

LATENCY_BUCKETS = (
    0.001,
    0.0025,
    0.005,
    0.01,
    0.02,
    0.04,
    0.06,
    0.08,
    0.1,
    0.25,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    7.5,
    10.0,
    20.0,
    40.0,
    80.0,
    160.0,
    640.0,
)


class Metrics:
    def __init__(self, model: str, spec_positions: int = 0):
        r = self.registry = CollectorRegistry()
        lbl = ["model_name"]
        self.model = model
        self.requests = Counter(
            "mlaserve:request_success", "Finished requests by finish reason", lbl + ["finished_reason"], registry=r
        )
        self.errors = Counter(
            "mlaserve:request_errors", "Refused requests by HTTP status", lbl + ["status"], registry=r
        )
        self.prompt_tokens = Counter("mlaserve:prompt_tokens", "Prompt tokens of finished requests", lbl, registry=r)
        self.generation_tokens = Counter("mlaserve:generation_tokens", "Generated tokens", lbl, registry=r)
        self.ttft = Histogram(
            "mlaserve:time_to_first_token_seconds", "Time to first token", lbl, buckets=LATENCY_BUCKETS, registry=r
        )
        self.tpot = Histogram(
            "mlaserve:time_per_output_token_seconds",
            "Time per output token after the first",
            lbl,
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.e2el = Histogram(
            "mlaserve:e2e_request_latency_seconds",
            "End-to-end request latency",
            lbl,
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.running = Gauge("mlaserve:num_requests_running", "Requests running", lbl, registry=r)
        self.waiting = Gauge("mlaserve:num_requests_waiting", "Requests waiting", lbl, registry=r)
        self.kv_used = Gauge("mlaserve:kv_cache_pages_used", "KV-cache pages in use", lbl, registry=r)
        self.kv_total = Gauge("mlaserve:kv_cache_pages_total", "KV-cache pages", lbl, registry=r)
        self.prefix_queries = Counter(
            "mlaserve:prefix_cache_queries", "Prompt tokens looked up in the prefix cache", lbl, registry=r
        )
        self.prefix_hits = Counter(
            "mlaserve:prefix_cache_hits", "Prompt tokens served by the prefix cache", lbl, registry=r
        )
        self.spec_drafts = Counter("mlaserve:spec_decode_num_drafts", "Speculative verify steps", lbl, registry=r)
        self.spec_draft_tokens = Counter(
            "mlaserve:spec_decode_num_draft_tokens", "Draft tokens proposed", lbl, registry=r
        )
        self.spec_accepted = Counter(
            "mlaserve:spec_decode_num_accepted_tokens", "Draft tokens accepted", lbl, registry=r
        )
        # vLLM's name: accepted draft tokens by draft position (label "0": the first draft token of each step)
        self.spec_accepted_per_pos = Counter(
            "mlaserve:spec_decode_num_accepted_tokens_per_pos",
            "Draft tokens accepted, by position in the draft chain",
            lbl + ["position"],
            registry=r,
        )
        self._last_per_pos = [0] * spec_positions
        for i in range(spec_positions):
            self.spec_accepted_per_pos.labels(model, str(i))
        # engine stats key -> counter fed with its deltas
        self._deltas = {
            "prefix_cache_queries": self.prefix_queries,
            "prefix_cache_hits": self.prefix_hits,
            "spec_steps": self.spec_drafts,
            "spec_draft_tokens": self.spec_draft_tokens,
            "spec_accepted_tokens": self.spec_accepted,
        }
        self._last = dict.fromkeys(self._deltas, 0)
        # Expose every unlabelled-by-outcome series from the start (at 0), so a scrape before the first request
        # already lists them and `bench serve` can take deltas.
        for metric in (
            self.prompt_tokens,
            self.generation_tokens,
            self.ttft,
            self.tpot,
            self.e2el,
            self.running,
            self.waiting,
            self.kv_used,
            self.kv_total,
            *self._deltas.values(),
        ):
            metric.labels(model)
        for reason in ("stop", "length", "abort"):
            self.requests.labels(model, reason)

    def observe_engine(self, stats: dict) -> None:
        """Called from the engine thread after each step with LLMEngine.stats()."""
        m = self.model
        self.running.labels(m).set(stats["running"])
        self.waiting.labels(m).set(stats["waiting"])
        self.kv_used.labels(m).set(stats["kv_pages_used"])
        self.kv_total.labels(m).set(stats["kv_pages_total"])
        for key, counter in self._deltas.items():
            delta = stats.get(key, 0) - self._last[key]
            if delta > 0:
                counter.labels(m).inc(delta)
            self._last[key] = stats.get(key, 0)
        per_pos = stats.get("spec_accepted_per_position") or []
        if len(self._last_per_pos) < len(per_pos):
            self._last_per_pos += [0] * (len(per_pos) - len(self._last_per_pos))
        for i, v in enumerate(per_pos):
            if v > self._last_per_pos[i]:
                self.spec_accepted_per_pos.labels(m, str(i)).inc(v - self._last_per_pos[i])
            self._last_per_pos[i] = v

    def observe_finished(self, reason: str, usage, ttft: float | None, e2el: float) -> None:
        m = self.model
        self.requests.labels(m, reason or "unknown").inc()
        self.prompt_tokens.labels(m).inc(usage.prompt_tokens)
        self.generation_tokens.labels(m).inc(usage.completion_tokens)
        if ttft is not None:
            self.ttft.labels(m).observe(ttft)
            if usage.completion_tokens > 1:
                self.tpot.labels(m).observe((e2el - ttft) / (usage.completion_tokens - 1))
        self.e2el.labels(m).observe(e2el)

    def observe_abort(self) -> None:
        """A request abandoned by its client (or its handler) and aborted before it finished."""
        self.requests.labels(self.model, "abort").inc()

    def render(self) -> bytes:
        return generate_latest(self.registry)
