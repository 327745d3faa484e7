"""POST /tokenize and /detokenize, as vLLM serves them: a prompt (or chat messages, through the chat template) to
token ids, and token ids back to text. No engine request is made."""

from __future__ import annotations

from fastapi import FastAPI, Request
from pydantic import BaseModel, Field, field_validator

from .protocol import _STRICT, ChatMessage
from .serving import APIError, ServingContext


class TokenizeRequest(BaseModel):
    """A completion prompt (prompt) or chat messages (messages, as /v1/chat/completions takes them)."""

    model_config = _STRICT
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = Field(default=None, min_length=1)
    add_special_tokens: bool | None = None  # default: True for a prompt, False for messages (the template has them)
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template_kwargs: dict | None = None
    return_token_strs: bool = False

    @field_validator("messages")
    @classmethod
    def _one_of(cls, v, info):
        if v is not None and info.data.get("prompt") is not None:
            raise ValueError("give either prompt or messages, not both")
        return v


class DetokenizeRequest(BaseModel):
    model_config = _STRICT
    model: str | None = None
    tokens: list[int] = Field(max_length=1 << 20)


def register(app: FastAPI, ctx: ServingContext) -> None:
    @app.post("/tokenize")
    async def tokenize(request: Request):
        req: TokenizeRequest = await ctx.parse(request, TokenizeRequest)
        tok = ctx.tok
        if tok is None:
            raise APIError(400, "prompt: this model has no tokenizer", "prompt")
        if req.messages is not None:
            text = ctx.render_chat(req)
            ids = await ctx.encode(text, add_special_tokens=bool(req.add_special_tokens), field="messages")
        elif req.prompt is not None:
            special = True if req.add_special_tokens is None else req.add_special_tokens
            ids = await ctx.encode(req.prompt, add_special_tokens=special)
        else:
            raise APIError(400, "prompt: give a prompt or messages", "prompt")
        return {
            "count": len(ids),
            "max_model_len": ctx.llm.max_model_len,
            "tokens": ids,
            "token_strs": ctx.token_texts(ids) if req.return_token_strs else None,
        }

    @app.post("/detokenize")
    async def detokenize(request: Request):
        req: DetokenizeRequest = await ctx.parse(request, DetokenizeRequest)
        if ctx.tok is None:
            raise APIError(400, "tokens: this model has no tokenizer", "tokens")
        V = ctx.llm.model_config.vocab_size
        bad = next((i for i, t in enumerate(req.tokens) if not 0 <= t < V), None)
        if bad is not None:
            raise APIError(
                400, f"tokens: id {req.tokens[bad]} at index {bad} is outside the vocabulary [0, {V})", "tokens"
            )
        return {"prompt": ctx.tok.decode(req.tokens, skip_special_tokens=False)}
