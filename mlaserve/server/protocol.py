"""OpenAI-compatible request schemas (pydantic) and response builders, with vLLM's common extensions
(top_k, min_p, ignore_eos, stop_token_ids, return_token_ids)."""

from __future__ import annotations

import time
import uuid
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from ..types import SamplingParams, Usage


class StreamOptions(BaseModel):
    include_usage: bool = False
    continuous_usage_stats: bool = False


class _SamplingFields(BaseModel):
    model_config = ConfigDict(extra="ignore")

    model: str | None = None
    temperature: float | None = Field(default=None, ge=0)
    top_p: float | None = Field(default=None, gt=0, le=1)
    top_k: int | None = Field(default=None, ge=-1)
    min_p: float | None = Field(default=None, ge=0, le=1)
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: int = Field(default=1, ge=1, le=1, description="only n=1 is supported")
    presence_penalty: float = Field(default=0.0, ge=0, le=0, description="not supported: must be 0")
    frequency_penalty: float = Field(default=0.0, ge=0, le=0, description="not supported: must be 0")
    return_token_ids: bool = False
    user: str | None = None

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


class CompletionRequest(_SamplingFields):
    prompt: str | list[int] | list[str] | list[list[int]]
    max_tokens: int | None = Field(default=16, ge=1)
    logprobs: int | None = Field(default=None, ge=0, le=20)
    echo: bool = Field(default=False)
    suffix: str | None = None

    @field_validator("echo")
    @classmethod
    def _no_echo(cls, v):
        if v:
            raise ValueError("echo is not supported")
        return v

    @field_validator("suffix")
    @classmethod
    def _no_suffix(cls, v):
        if v:
            raise ValueError("suffix is not supported")
        return v

    def prompts(self) -> list[str | list[int]]:
        p = self.prompt
        if isinstance(p, str) or (isinstance(p, list) and p and isinstance(p[0], int)):
            return [p]
        if isinstance(p, list) and not p:
            return [p]  # an empty prompt: refused later with a clear message
        return list(p)


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")

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


# ---- responses ----------------------------------------------------------------------------------------
def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:24]}"


def usage_json(u: Usage) -> dict:
    return {
        "prompt_tokens": u.prompt_tokens,
        "completion_tokens": u.completion_tokens,
        "total_tokens": u.prompt_tokens + u.completion_tokens,
        "prompt_tokens_details": {"cached_tokens": u.cached_tokens},
        "completion_tokens_details": {
            "accepted_prediction_tokens": u.spec_accepted_tokens,
            "rejected_prediction_tokens": u.spec_draft_tokens - u.spec_accepted_tokens,
        },
    }


def sum_usage(us: list[Usage]) -> Usage:
    return Usage(
        *(
            sum(getattr(u, f) for u in us)
            for f in (
                "prompt_tokens",
                "completion_tokens",
                "cached_tokens",
                "spec_draft_tokens",
                "spec_accepted_tokens",
            )
        )
    )


def error_json(message: str, status: int, param: str | None = None) -> dict:
    kind = {
        400: "invalid_request_error",
        404: "not_found_error",
        413: "invalid_request_error",
        422: "invalid_request_error",
        503: "server_overloaded",
    }.get(status, "server_error")
    return {"error": {"message": message, "type": kind, "param": param, "code": status}}


def chunk(obj: str, rid: str, model: str, created: int, choices: list[dict], usage: dict | None = None) -> dict:
    out = {"id": rid, "object": obj, "created": created, "model": model, "choices": choices}
    if usage is not None:
        out["usage"] = usage
    return out


def now() -> int:
    return int(time.time())
