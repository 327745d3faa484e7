"""OpenAI-compatible request schemas (pydantic, strict: "5" is not an integer) and response builders, with vLLM's
common extensions (top_k, min_p, ignore_eos, stop_token_ids, return_token_ids)."""

from __future__ import annotations

import time
import uuid
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from ..types import SamplingParams, Usage

_STRICT = ConfigDict(extra="ignore", strict=True, allow_inf_nan=False)
MAX_STOP = 64  # stop strings per request, each at most MAX_STOP_LEN characters: the detokenizer scans them per token
MAX_STOP_LEN = 1024


class StreamOptions(BaseModel):
    model_config = _STRICT

    include_usage: bool = False
    continuous_usage_stats: bool = False


class _SamplingFields(BaseModel):
    model_config = _STRICT

    model: str | None = None
    temperature: float | None = Field(default=None, ge=0)
    top_p: float | None = Field(default=None, gt=0, le=1)
    top_k: int | None = Field(default=None, ge=-1, le=(1 << 31) - 1)
    min_p: float | None = Field(default=None, ge=0, le=1)
    seed: int | None = Field(default=None, ge=-(1 << 63), le=(1 << 64) - 1)  # what torch.Generator takes
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = Field(default=None, max_length=1024)
    ignore_eos: bool = False
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: int = 1
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    return_token_ids: bool = False
    user: str | None = None

    @field_validator("n")
    @classmethod
    def _one_choice(cls, v):
        if v != 1:
            raise ValueError(f"only n=1 is supported, got {v}")
        return v

    @field_validator("presence_penalty", "frequency_penalty")
    @classmethod
    def _no_penalties(cls, v):
        if v:
            raise ValueError(f"penalties are not supported; must be 0, got {v!r}")
        return v

    @field_validator("stop")
    @classmethod
    def _stop_bounds(cls, v):
        stops = [v] if isinstance(v, str) else (v or [])
        if len(stops) > MAX_STOP:
            raise ValueError(f"at most {MAX_STOP} stop strings, got {len(stops)}")
        if any(not s or len(s) > MAX_STOP_LEN for s in stops):
            raise ValueError(f"each stop string must hold 1 to {MAX_STOP_LEN} characters")
        return v

    @field_validator("stop_token_ids")
    @classmethod
    def _stop_ids(cls, v):
        if v is not None and any(t < 0 for t in v):
            raise ValueError("must be non-negative token ids")
        return v

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)

    @property
    def continuous_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.continuous_usage_stats)

    def sampling_params(self, max_tokens: int | None, logprobs: int | None) -> SamplingParams:
        """Raises ValueError naming the field (SamplingParams validates)."""
        return SamplingParams(
            temperature=1.0 if self.temperature is None else self.temperature,
            top_p=1.0 if self.top_p is None else self.top_p,
            top_k=-1 if self.top_k is None else self.top_k,
            min_p=0.0 if self.min_p is None else self.min_p,
            max_tokens=max_tokens,
            seed=self.seed,
            stop=self.stop,
            stop_token_ids=self.stop_token_ids,
            ignore_eos=self.ignore_eos,
            logprobs=logprobs,
        )


def _is_token_ids(x) -> bool:
    return isinstance(x, list) and len(x) > 0 and all(isinstance(t, int) and not isinstance(t, bool) for t in x)


class CompletionRequest(_SamplingFields):
    prompt: Any  # a string, a list of token ids, or a list of either: normalised to a list of prompts below
    max_tokens: int | None = Field(default=16, ge=1)
    logprobs: int | None = Field(default=None, ge=0, le=20)
    echo: bool = False
    suffix: str | None = None

    @field_validator("echo", "suffix")
    @classmethod
    def _unsupported(cls, v):
        if v:
            raise ValueError(f"is not supported, got {v!r}")
        return v

    @field_validator("logprobs")
    @classmethod
    def _sampled_only(cls, v):
        if v:  # the engine returns the sampled token's logprob only
            raise ValueError(f"top alternatives are not supported; use 0 (the sampled token's logprob), got {v}")
        return v

    @field_validator("prompt", mode="before")
    @classmethod
    def _prompts(cls, p):
        """-> a non-empty list of prompts, each a string or a non-empty list of token ids."""
        if isinstance(p, str) or _is_token_ids(p):
            return [p]
        if isinstance(p, list) and p and all(isinstance(x, str) or _is_token_ids(x) for x in p):
            return p
        if isinstance(p, list) and (not p or any(x == [] for x in p)):
            raise ValueError("must not be empty")
        raise ValueError("must be a string, a list of token ids (integers), or a list of strings or of token-id lists")

    def prompts(self) -> list[str | list[int]]:
        return self.prompt


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow", strict=True)

    role: Literal["system", "user", "assistant", "tool", "developer"]
    content: str | list[dict] | None = None


class ChatCompletionRequest(_SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = Field(default=None, ge=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=0, le=20)
    add_generation_prompt: bool = True
    chat_template_kwargs: dict | None = None

    @field_validator("chat_template_kwargs")
    @classmethod
    def _own_keys(cls, v):
        clash = sorted(set(v or ()) & {"messages", "add_generation_prompt"})
        if clash:
            raise ValueError(f"must not set {', '.join(clash)} (use the request's own fields)")
        return v

    @field_validator("top_logprobs")
    @classmethod
    def _sampled_only(cls, v):
        if v:
            raise ValueError(f"top alternatives are not supported; use 0 (the sampled token's logprob), got {v}")
        return v


# ---- responses ----------------------------------------------------------------------------------------
def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:24]}"


def now() -> int:
    return int(time.time())


def usage_json(u: Usage) -> dict:
    details = {
        "accepted_prediction_tokens": u.spec_accepted_tokens,
        "rejected_prediction_tokens": u.spec_draft_tokens - u.spec_accepted_tokens,
    }
    if u.spec_accepted_per_position:  # speculative decoding: [i] = verify steps that accepted draft token i + 1
        details["accepted_prediction_tokens_per_position"] = list(u.spec_accepted_per_position)
    return {
        "prompt_tokens": u.prompt_tokens,
        "completion_tokens": u.completion_tokens,
        "total_tokens": u.prompt_tokens + u.completion_tokens,
        "prompt_tokens_details": {"cached_tokens": u.cached_tokens},
        "completion_tokens_details": details,
    }


def sum_usage(us: list[Usage]) -> Usage:
    fields = ("prompt_tokens", "completion_tokens", "cached_tokens", "spec_draft_tokens", "spec_accepted_tokens")
    k = max((len(u.spec_accepted_per_position) for u in us), default=0)
    per_pos = tuple(
        sum(u.spec_accepted_per_position[i] for u in us if i < len(u.spec_accepted_per_position)) for i in range(k)
    )
    return Usage(*(sum(getattr(u, f) for u in us) for f in fields), per_pos)


def error_json(message: str, status: int, param: str | None = None) -> dict:
    kind = {
        400: "invalid_request_error",
        404: "not_found_error",
        405: "invalid_request_error",
        413: "invalid_request_error",
        422: "invalid_request_error",
        503: "server_overloaded",
    }
    return {"error": {"message": message, "type": kind.get(status, "server_error"), "param": param, "code": status}}


def chunk(obj: str, rid: str, model: str, created: int, choices: list[dict], usage: dict | None = None) -> dict:
    out = {"id": rid, "object": obj, "created": created, "model": model, "choices": choices}
    if usage is not None:
        out["usage"] = usage
    return out


def completion_logprobs(tokens: list[str], logprobs: list[float], offset: int) -> dict:
    """The legacy completions shape; text_offset counts characters from the completion's start."""
    offsets = []
    for t in tokens:
        offsets.append(offset)
        offset += len(t)
    return {"tokens": tokens, "token_logprobs": logprobs, "top_logprobs": None, "text_offset": offsets}


def chat_logprobs(tokens: list[str], logprobs: list[float]) -> dict:
    return {
        "content": [
            {"token": t, "logprob": lp, "bytes": list(t.encode("utf-8")), "top_logprobs": []}
            for t, lp in zip(tokens, logprobs)
        ]
    }
