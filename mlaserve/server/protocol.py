"""OpenAI-compatible request schemas (pydantic, strict: "5" is not an integer) and response builders, with vLLM's
common extensions (top_k, min_p, repetition_penalty, min_tokens, ignore_eos, stop_token_ids, prompt_logprobs,
return_token_ids, skip_special_tokens) and structured output (response_format, guided_*, structured_outputs:
structured.py). Unknown fields are ignored, as vLLM does; known fields the engine cannot honour (beam search, suffix,
...) are a 400 naming them when set."""

from __future__ import annotations

import time
import uuid
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from ..types import SamplingParams, Usage
from .structured import structured_output

_STRICT = ConfigDict(extra="ignore", strict=True, allow_inf_nan=False)
MAX_N = 128  # sequences per prompt (n, best_of)
MAX_STOP = 64  # stop strings per request, each at most MAX_STOP_LEN characters: the detokenizer scans them per token
MAX_STOP_LEN = 1024


# field -> the values that mean "off" (accepted); anything else is refused
UNSUPPORTED = {
    "use_beam_search": (False,),
    "length_penalty": (1, 1.0),
    "logits_processors": ((), []),
    "spaces_between_special_tokens": (True,),
}
UNSUPPORTED_WHY = {
    "use_beam_search": "beam search is not supported",
}


def _refuse(name: str, v, ok: tuple):
    """v unless it asks for what the engine cannot do (anything but None or the `ok` values): then ValueError."""
    if v is not None and v not in ok and not (isinstance(v, dict) and v.get("type") in ok):
        raise ValueError(f"{UNSUPPORTED_WHY.get(name, 'is not supported by this server')}, got {v!r}")
    return v


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
    include_stop_str_in_output: bool = False
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: int = Field(default=1, ge=1, le=MAX_N)
    presence_penalty: float | None = Field(default=None, ge=-2, le=2)
    frequency_penalty: float | None = Field(default=None, ge=-2, le=2)
    repetition_penalty: float | None = Field(default=None, gt=0, le=2)
    logit_bias: dict[str, float] | None = None
    allowed_token_ids: list[int] | None = Field(default=None, min_length=1)
    bad_words: list[str] | None = Field(default=None, max_length=MAX_STOP)
    min_tokens: int = Field(default=0, ge=0)
    prompt_logprobs: int | None = Field(default=None, ge=0)
    return_token_ids: bool = False
    return_tokens_as_token_ids: bool = False  # logprobs name tokens "token_id:N" (texts can collide)
    user: str | None = None
    # keep the prompt's last k tokens (vLLM's field); -1: as many as leave room for max_tokens in max_model_len
    truncate_prompt_tokens: int | None = Field(default=None, ge=-1)
    # structured output: one of these (structured.py)
    response_format: Any = None
    guided_json: Any = None
    guided_regex: Any = None
    guided_choice: Any = None
    guided_grammar: Any = None
    structured_outputs: Any = None
    # OpenAI's Predicted Outputs, {"type": "content", "content": text or [{"type": "text", "text": ...}]}: an NGRAM
    # server drafts from it (spec/ngram.py); others accept and ignore it
    prediction: Any = None
    # known fields the engine cannot honour: a 400 naming the field when set to anything but these
    use_beam_search: Any = None
    length_penalty: Any = None
    logits_processors: Any = None
    skip_special_tokens: bool = True
    spaces_between_special_tokens: Any = None

    @field_validator(*UNSUPPORTED)
    @classmethod
    def _unsupported(cls, v, info):
        return _refuse(info.field_name, v, UNSUPPORTED[info.field_name])

    @field_validator("prediction")
    @classmethod
    def _prediction(cls, v):
        """-> the predicted text (None when empty)."""
        if v is None:
            return None
        c = v.get("content") if isinstance(v, dict) and v.get("type") == "content" else None
        if isinstance(c, list):
            texts = [p.get("text") for p in c if isinstance(p, dict) and p.get("type") == "text"]
            c = "".join(texts) if len(texts) == len(c) and all(isinstance(t, str) for t in texts) else None
        if not isinstance(c, str):
            raise ValueError(
                'must be {"type": "content", "content": a string or a list of {"type": "text", "text": ...} parts}'
            )
        return c or None

    @field_validator("logit_bias")
    @classmethod
    def _bias(cls, v):
        for k, b in (v or {}).items():
            if not k.lstrip("-").isdigit():
                raise ValueError(f"keys must be token ids, got {k!r}")
            if not -100 <= b <= 100:
                raise ValueError(f"the bias of token {k} must be in [-100, 100], got {b!r}")
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

    @field_validator("bad_words")
    @classmethod
    def _bad_words(cls, v):
        if any(len(w) > MAX_STOP_LEN for w in v or ()):  # blank words: SamplingParams refuses them
            raise ValueError(f"each bad word must hold at most {MAX_STOP_LEN} characters")
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

    def sampling_params(
        self,
        max_tokens: int | None,
        logprobs: int | None,
        prompt_logprobs: int | None = None,
        best_of=None,
        defaults: dict | None = None,
    ) -> SamplingParams:
        """Raises ValueError naming the field (SamplingParams validates). defaults: the model's generation_config
        values for the sampling fields the request leaves unset."""
        d = defaults or {}
        return SamplingParams(
            structured=structured_output(self),
            n=self.n,
            best_of=best_of,
            presence_penalty=self.presence_penalty or 0.0,
            frequency_penalty=self.frequency_penalty or 0.0,
            repetition_penalty=d.get("repetition_penalty", 1.0)
            if self.repetition_penalty is None
            else self.repetition_penalty,
            logit_bias={int(k): b for k, b in self.logit_bias.items()} if self.logit_bias else None,
            allowed_token_ids=self.allowed_token_ids,
            bad_words=self.bad_words,
            min_tokens=self.min_tokens,
            prompt_logprobs=prompt_logprobs,
            temperature=d.get("temperature", 1.0) if self.temperature is None else self.temperature,
            top_p=d.get("top_p", 1.0) if self.top_p is None else self.top_p,
            top_k=d.get("top_k", -1) if self.top_k is None else self.top_k,
            min_p=d.get("min_p", 0.0) if self.min_p is None else self.min_p,
            max_tokens=max_tokens,
            seed=self.seed,
            stop=self.stop,
            include_stop_str_in_output=self.include_stop_str_in_output,
            truncate_prompt_tokens=self.truncate_prompt_tokens,  # SamplingParams checks it; the engine's cut is a no-op
            stop_token_ids=self.stop_token_ids,
            ignore_eos=self.ignore_eos,
            logprobs=logprobs,
            skip_special_tokens=self.skip_special_tokens,
            prediction=self.prediction,
        )


def _is_token_ids(x) -> bool:
    return isinstance(x, list) and len(x) > 0 and all(isinstance(t, int) and not isinstance(t, bool) for t in x)


class CompletionRequest(_SamplingFields):
    prompt: Any  # a string, a list of token ids, or a list of either: normalised to a list of prompts below
    echo: bool = False  # before max_tokens: its validator reads it
    max_tokens: int | None = Field(default=16, ge=0)  # 0: with echo, the prompt alone (its logprobs: scoring)
    logprobs: int | None = Field(default=None, ge=0)  # the limit is the engine's max_logprobs
    best_of: int | None = Field(default=None, ge=1, le=MAX_N)
    suffix: str | None = None

    @field_validator("suffix")
    @classmethod
    def _suffix(cls, v):
        if v:
            raise ValueError(f"is not supported (no fill-in-the-middle), got {v!r}")
        return v

    @field_validator("max_tokens")
    @classmethod
    def _echo_only(cls, v, info):
        if v == 0 and not info.data.get("echo"):
            raise ValueError("0 returns the prompt alone, which needs echo: true")
        return v

    @property
    def echo_only(self) -> bool:
        """max_tokens 0 with echo (vLLM's, as eval harnesses score a text): the prompt and its logprobs, no
        completion (the engine still runs one step: its token is dropped)."""
        return self.max_tokens == 0

    @field_validator("best_of")
    @classmethod
    def _best_of(cls, v, info):
        n = info.data.get("n", 1)
        if v is not None and v < n:
            raise ValueError(f"must be >= n ({n}), got {v}")
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
    top_logprobs: int | None = Field(default=None, ge=0)  # the limit is the engine's max_logprobs
    add_generation_prompt: bool = True
    chat_template_kwargs: dict | None = None
    tools: Any = None  # checked with tool_choice by chat_tools (errors naming tools[i]...)
    tool_choice: Any = None
    continue_final_message: bool = False  # the reply continues the last message (a prefilled answer)
    echo: Any = None

    @model_validator(mode="after")
    def _partial_reply(self):
        """A last assistant message marked `"partial": true` (Moonshot's API for Kimi) or `"prefix": true`
        (DeepSeek's) asks for what continue_final_message does."""
        last = self.messages[-1]
        if last.role == "assistant" and any((last.model_extra or {}).get(k) is True for k in ("partial", "prefix")):
            self.continue_final_message = True
        return self

    @field_validator("echo")
    @classmethod
    def _echo(cls, v):
        if v not in (None, False):
            raise ValueError(f"is not supported for chat completions, got {v!r}")
        return v

    @field_validator("chat_template_kwargs")
    @classmethod
    def _own_keys(cls, v):
        clash = sorted(set(v or ()) & {"messages", "add_generation_prompt", "continue_final_message"})
        if clash:
            raise ValueError(f"must not set {', '.join(clash)} (use the request's own fields)")
        return v

    @field_validator("top_logprobs")
    @classmethod
    def _needs_logprobs(cls, v, info):
        if v and not info.data.get("logprobs"):
            raise ValueError("needs logprobs: true")
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
        409: "invalid_request_error",
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


def completion_logprobs(
    tokens: list[str],
    logprobs: list[float | None],
    offset: int,
    top: list[dict[str, float] | None] | None = None,
) -> dict:
    """The legacy completions shape; text_offset counts characters from the completion's start (with echo, the
    prompt's). top: per token, its text -> logprob for the sampled token and the top alternatives."""
    offsets = []
    for t in tokens:
        offsets.append(offset)
        offset += len(t)
    return {"tokens": tokens, "token_logprobs": logprobs, "top_logprobs": top, "text_offset": offsets}


def chat_logprobs(tokens: list[str], logprobs: list[float], top: list[list[tuple[str, float]]] | None = None) -> dict:
    """top: per token, the (text, logprob) of its top_logprobs alternatives, most likely first."""

    def entry(t: str, lp: float) -> dict:
        return {"token": t, "logprob": lp, "bytes": list(t.encode("utf-8"))}

    return {
        "content": [
            {**entry(t, lp), "top_logprobs": [entry(a, b) for a, b in (top[i] if top else [])]}
            for i, (t, lp) in enumerate(zip(tokens, logprobs))
        ]
    }


def prompt_logprobs_json(entries: list[dict[int, float] | None] | None, texts) -> list | None:
    """vLLM's prompt_logprobs: per prompt token None (the first) or {id: {logprob, decoded_token}}, the prompt's
    own token first. texts(ids) -> their texts."""
    if entries is None:
        return None
    return [
        None
        if e is None
        else {str(t): {"logprob": lp, "decoded_token": x} for (t, lp), x in zip(e.items(), texts(list(e)))}
        for e in entries
    ]
