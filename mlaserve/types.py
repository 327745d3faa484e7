"""CPU-side bookkeeping types shared by the engine, the offline API and the server."""

from __future__ import annotations

import enum
import itertools
from dataclasses import dataclass, field

STRUCTURED_KINDS = ("json", "json_object", "regex", "choice", "grammar")


@dataclass(frozen=True)
class StructuredOutput:
    """What a request's output must match (vLLM's StructuredOutputsParams, one kind at a time):

        json         spec: a JSON schema (its JSON text)
        json_object  any JSON object (spec None)
        regex        spec: a regular expression
        choice       choices: the output is exactly one of them
        grammar      spec: an EBNF (GBNF) grammar, or Lark when it has no '::='

    field: the request field that asked for it, named in errors (response_format, guided_json, ...).
    after_token_ids: the output is free until one of these tokens (a reasoning model's end of thinking) and follows
    the grammar from the token after it; empty: from the first token."""

    kind: str
    spec: str | None = None
    choices: tuple[str, ...] = ()
    field: str = "structured_outputs"
    after_token_ids: tuple[int, ...] = ()

    def __post_init__(self):
        if self.kind not in STRUCTURED_KINDS:
            raise ValueError(f"{self.field}: unknown kind {self.kind!r}; one of {', '.join(STRUCTURED_KINDS)}")
        if self.kind == "choice":
            if not self.choices or any(not isinstance(c, str) or not c for c in self.choices):
                raise ValueError(f"{self.field}: the choices must be a non-empty list of non-empty strings")
        elif self.kind != "json_object" and (not isinstance(self.spec, str) or not self.spec):
            raise ValueError(f"{self.field}: a {self.kind} needs a non-empty string")
        if not isinstance(self.after_token_ids, tuple) or any(
            not isinstance(t, int) or isinstance(t, bool) or t < 0 for t in self.after_token_ids
        ):
            raise ValueError(
                f"{self.field}: after_token_ids must be a tuple of token ids, got {self.after_token_ids!r}"
            )


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
    prompt_logprobs: int | None = None  # None: off; k >= 0: each prompt token's logprob (+ top-k), from token 1 on
    n: int = 1  # sequences returned for the prompt
    best_of: int | None = None  # sequences generated (>= n); the n of highest cumulative logprob are returned
    presence_penalty: float = 0.0  # subtracted once from each token already generated
    frequency_penalty: float = 0.0  # subtracted per occurrence in the generated tokens
    repetition_penalty: float = 1.0  # tokens of the prompt or output: positive logits divided, negative multiplied
    logit_bias: dict[int, float] | None = None  # token id -> added to its logit, in [-100, 100]
    allowed_token_ids: list[int] | None = None  # only these tokens can be generated (vLLM's field)
    bad_words: list[str] | None = None  # never generated, at a word's start or inside text (vLLM's field)
    min_tokens: int = 0  # EOS and stop_token_ids are masked until this many tokens are generated
    include_stop_str_in_output: bool = False  # the matched stop string ends the text (vLLM's field)
    truncate_prompt_tokens: int | None = None  # the prompt's last k tokens; -1: what leaves room for max_tokens
    skip_special_tokens: bool = True  # the output text leaves out special tokens
    keep_special_token_ids: frozenset[int] = frozenset()  # ... but these (a tool or reasoning parser's markers)
    # OpenAI's Predicted Outputs: the expected output (text, or token ids); an NGRAM engine drafts from it too
    prediction: str | list[int] | None = None
    structured: StructuredOutput | None = None  # the output follows a JSON schema, regex, choice or grammar

    def __post_init__(self):
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop or [])
        self.stop_token_ids = list(self.stop_token_ids or [])
        if self.logit_bias:  # JSON object keys arrive as strings
            try:
                self.logit_bias = {int(k): v for k, v in self.logit_bias.items()}
            except (TypeError, ValueError):
                raise ValueError("logit_bias: keys must be token ids (integers)") from None
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
        for name in ("logprobs", "prompt_logprobs"):
            v = getattr(self, name)
            if v is not None and (not _is_int(v) or v < 0):
                bad(name, f"must be a non-negative integer, got {v!r}")
        if not _is_int(self.n) or self.n < 1:
            bad("n", f"must be a positive integer, got {self.n!r}")
        if self.best_of is not None and (not _is_int(self.best_of) or self.best_of < self.n):
            bad("best_of", f"must be an integer >= n ({self.n}), got {self.best_of!r}")
        for name in ("presence_penalty", "frequency_penalty"):
            v = getattr(self, name)
            if not _is_num(v) or not -2 <= v <= 2:
                bad(name, f"must be in [-2, 2], got {v!r}")
        if not _is_num(self.repetition_penalty) or not 0 < self.repetition_penalty <= 2:
            bad("repetition_penalty", f"must be in (0, 2], got {self.repetition_penalty!r}")
        for t, b in (self.logit_bias or {}).items():
            if t < 0:
                bad("logit_bias", f"token id {t} is negative")
            if not _is_num(b) or not -100 <= b <= 100:
                bad("logit_bias", f"the bias of token {t} must be in [-100, 100], got {b!r}")
        k = self.truncate_prompt_tokens
        if k is not None and (not _is_int(k) or not (k == -1 or k >= 1)):
            bad("truncate_prompt_tokens", f"must be -1 (fit max_model_len) or a positive number of tokens, got {k!r}")
        if self.bad_words is not None and (
            not isinstance(self.bad_words, (list, tuple))
            or any(not isinstance(w, str) or not w.strip() for w in self.bad_words)
        ):
            bad("bad_words", f"must be a list of non-empty strings, got {self.bad_words!r}"[:200])
        if self.allowed_token_ids is not None:
            a = self.allowed_token_ids
            if not isinstance(a, (list, tuple)) or not a or any(not _is_int(t) or t < 0 for t in a):
                bad("allowed_token_ids", f"must be a non-empty list of token ids, got {a!r}"[:200])
        if not _is_int(self.min_tokens) or self.min_tokens < 0:
            bad("min_tokens", f"must be a non-negative integer, got {self.min_tokens!r}")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            bad("min_tokens", f"{self.min_tokens} exceeds max_tokens {self.max_tokens}")
        if self.structured is not None and not isinstance(self.structured, StructuredOutput):
            bad("structured", f"must be a StructuredOutput, got {type(self.structured).__name__}")
        if any(not isinstance(s, str) or not s for s in self.stop):
            bad("stop", "must be non-empty strings")
        if any(not isinstance(t, int) or t < 0 for t in self.stop_token_ids):
            bad("stop_token_ids", "must be non-negative integers")
        pr = self.prediction
        if pr is not None and not (
            (isinstance(pr, str) and pr)
            or (isinstance(pr, (list, tuple)) and pr and all(_is_int(t) and t >= 0 for t in pr))
        ):
            bad("prediction", f"must be non-empty text or a non-empty list of token ids, got {pr!r}"[:200])
        for name in ("skip_special_tokens", "include_stop_str_in_output"):
            if not isinstance(getattr(self, name), bool):
                bad(name, f"must be true or false, got {getattr(self, name)!r}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    @property
    def penalized(self) -> bool:
        """Sampling reads the request's own tokens (presence, frequency or repetition penalty)."""
        return bool(self.presence_penalty or self.frequency_penalty or self.repetition_penalty != 1.0)

    @property
    def processes_logits(self) -> bool:
        """The logits are changed before sampling (penalties, logit_bias, allowed_token_ids, bad_words, min_tokens, a
        grammar): no graph arg-max."""
        return (
            self.penalized
            or bool(self.logit_bias)
            or self.allowed_token_ids is not None
            or bool(self.bad_words)
            or self.min_tokens > 0
            or self.structured is not None
        )

    @property
    def num_seqs(self) -> int:
        """Sequences generated for the prompt: best_of, else n."""
        return self.best_of or self.n


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_num(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


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
    output_top_logprobs: list[dict[int, float]] = field(default_factory=list)  # per token: id -> logprob
    cumulative_logprob: float = 0.0  # of the tokens whose logprob was computed
    track_logprob: bool = False  # compute each sampled token's logprob even without params.logprobs (best_of)
    prompt_logprobs: dict[int, dict[int, float]] = field(default_factory=dict)  # position -> id -> logprob
    fork_of: Request | None = None  # a sibling of the same prompt (n > 1): its full prompt pages are shared
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
    prediction_token_ids: list[int] | None = None  # params.prediction as tokens (an NGRAM engine's, else None)

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
    top_logprobs: list[dict[int, float]] | None = None  # per token: the logprobs top alternatives, id -> logprob
    cumulative_logprob: float | None = None
    index: int = 0


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
    prompt_logprobs: list[dict[int, float] | None] | None = None  # per prompt token (None for the first)

    # Convenience: the single completion's fields, as docs/design.md's `.token_ids` / `.text`.
    @property
    def token_ids(self) -> list[int]:
        return self.outputs[0].token_ids

    @property
    def text(self) -> str:
        return self.outputs[0].text
