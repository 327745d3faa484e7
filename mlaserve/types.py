"""CPU-side bookkeeping types shared by the engine, the offline API and the server."""

from __future__ import annotations

import enum
import itertools
from dataclasses import dataclass, field


@dataclass
class SamplingParams:
    """vLLM-shaped sampling parameters. temperature 0 means greedy."""

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1  # -1 or 0: off
    min_p: float = 0.0
    max_tokens: int | None = 16  # None: up to max_model_len
    seed: int | None = None
    stop: list[str] | str | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    logprobs: int | None = None  # None: off; k >= 0: the sampled token's logprob (+ top-k alternatives)

    def __post_init__(self):
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop or [])
        self.stop_token_ids = list(self.stop_token_ids or [])
        self.validate()

    def validate(self) -> None:
        """Raise ValueError naming the field and its limit."""

        def bad(field_: str, why: str):
            raise ValueError(f"{field_}: {why}")

        if not isinstance(self.temperature, (int, float)) or self.temperature < 0:
            bad("temperature", f"must be >= 0, got {self.temperature!r}")
        if not isinstance(self.top_p, (int, float)) or not 0 < self.top_p <= 1:
            bad("top_p", f"must be in (0, 1], got {self.top_p!r}")
        if not isinstance(self.top_k, int) or self.top_k < -1:
            bad("top_k", f"must be -1 (off) or >= 0, got {self.top_k!r}")
        if not isinstance(self.min_p, (int, float)) or not 0 <= self.min_p <= 1:
            bad("min_p", f"must be in [0, 1], got {self.min_p!r}")
        if self.max_tokens is not None and (not isinstance(self.max_tokens, int) or self.max_tokens <= 0):
            bad("max_tokens", f"must be a positive integer, got {self.max_tokens!r}")
        if self.seed is not None and not isinstance(self.seed, int):
            bad("seed", f"must be an integer, got {self.seed!r}")
        if self.logprobs is not None and (not isinstance(self.logprobs, int) or not 0 <= self.logprobs <= 20):
            bad("logprobs", f"must be an integer in [0, 20], got {self.logprobs!r}")
        if any(not isinstance(s, str) or not s for s in self.stop):
            bad("stop", "must be non-empty strings")
        if any(not isinstance(t, int) or t < 0 for t in self.stop_token_ids):
            bad("stop_token_ids", "must be non-negative integers")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


_ids = itertools.count()


@dataclass
class Request:
    """One generation request as the scheduler sees it."""

    prompt_token_ids: list[int]
    params: SamplingParams
    request_id: str = field(default_factory=lambda: f"req-{next(_ids)}")
    arrival: float = 0.0
    output_token_ids: list[int] = field(default_factory=list)
    output_logprobs: list[float] = field(default_factory=list)
    status: RequestStatus = RequestStatus.WAITING
    finish_reason: str | None = None  # "stop" | "length" | "abort"
    stop_reason: str | int | None = None
    num_computed_tokens: int = 0  # tokens whose KV is in the cache
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache (first schedule)
    pages: list[int] = field(default_factory=list)
    num_preemptions: int = 0
    # speculative decoding: per-request exact counts
    spec_draft_tokens: int = 0
    spec_accepted_tokens: int = 0
    spec_accepted_per_position: list[int] = field(default_factory=list)  # [i]: steps that accepted draft i + 1
    spec_steps: int = 0

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    def tokens(self, start: int, end: int) -> list[int]:
        """all_token_ids[start:end] without building the whole list (the decode hot path)."""
        p = len(self.prompt_token_ids)
        if end <= p:
            return self.prompt_token_ids[start:end]
        if start >= p:
            return self.output_token_ids[start - p : end - p]
        return self.prompt_token_ids[start:] + self.output_token_ids[: end - p]

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def finished(self) -> bool:
        return self.status == RequestStatus.FINISHED


@dataclass
class CompletionOutput:
    """What one prompt produced (vLLM-shaped: outputs[i].token_ids / .text)."""

    token_ids: list[int]
    text: str
    finish_reason: str | None
    logprobs: list[float] | None = None
    stop_reason: str | int | None = None


@dataclass
class Usage:
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int = 0
    spec_draft_tokens: int = 0
    spec_accepted_tokens: int = 0
    spec_accepted_per_position: tuple[int, ...] = ()  # [i]: verify steps that accepted draft token i + 1


@dataclass
class RequestOutput:
    request_id: str
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    usage: Usage
    prompt: str | None = None

    # Convenience: the single completion's fields, as docs/design.md's `.token_ids` / `.text`.
    @property
    def token_ids(self) -> list[int]:
        return self.outputs[0].token_ids

    @property
    def text(self) -> str:
        return self.outputs[0].text
