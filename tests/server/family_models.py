"""The tiny checkpoint with each family's tokenizer written here (Kimi's tiktoken.model with tool and think markers
among its reserved ids; DeepSeek's tokenizer.json with its tool markers), a chat template of that family's shape, and
scripted outputs: the engine's sampled tokens replaced by a script chosen by a tag in the prompt, so the parsers
see the marker tokens a real model emits."""

from __future__ import annotations

import base64
import json
import os
import shutil

KIMI_NAMED = [
    "[BOS]",
    "[EOS]",
    "<|im_end|>",
    "<|im_user|>",
    "<|im_assistant|>",
    "<|im_system|>",
    "<|im_middle|>",
    "<|tool_calls_section_begin|>",
    "<|tool_calls_section_end|>",
    "<|tool_call_begin|>",
    "<|tool_call_argument_begin|>",
    "<|tool_call_end|>",
    "<think>",
    "</think>",
]
KIMI_TEMPLATE = (
    "{%- if tools %}<|im_system|>tool_declare<|im_middle|>{{ tools | tojson }}<|im_end|>{% endif %}"
    "{%- for m in messages %}"
    "{%- if m.role == 'user' %}<|im_user|>user<|im_middle|>{{ m.content }}<|im_end|>"
    "{%- elif m.role == 'assistant' %}<|im_assistant|>assistant<|im_middle|>{{ m.content or '' }}"
    "{%- if m.tool_calls %}<|tool_calls_section_begin|>{% for tc in m.tool_calls %}<|tool_call_begin|>{{ tc.id }}"
    "<|tool_call_argument_begin|>{{ tc.function.arguments }}<|tool_call_end|>{% endfor %}"
    "<|tool_calls_section_end|>{% endif %}<|im_end|>"
    "{%- elif m.role == 'tool' %}<|im_system|>tool<|im_middle|>## Return of {{ m.tool_call_id }}\n{{ m.content }}"
    "<|im_end|>"
    "{%- else %}{{ raise_exception('unknown role ' + m.role) }}{% endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}<|im_assistant|>assistant<|im_middle|>{% endif %}"
)
DS_MARKERS = [
    "<｜tool▁calls▁begin｜>",
    "<｜tool▁calls▁end｜>",
    "<｜tool▁call▁begin｜>",
    "<｜tool▁call▁end｜>",
    "<｜tool▁sep｜>",
    "<think>",
    "</think>",
]
DS_TEMPLATE = (
    "{{ bos_token }}{%- if tools %}## Tools\n{{ tools | tojson }}\n{% endif %}"
    "{%- for m in messages %}"
    "{%- if m.role == 'user' %}User: {{ m.content }}\n"
    "{%- elif m.role == 'assistant' and m.content is none %}Assistant: <｜tool▁calls▁begin｜>"
    "{%- for tc in m.tool_calls %}<｜tool▁call▁begin｜>{{ tc.type }}<｜tool▁sep｜>{{ tc.function.name }}\n```json\n"
    "{{ tc.function.arguments }}\n```<｜tool▁call▁end｜>{% endfor %}<｜tool▁calls▁end｜><|eos|>"
    "{%- elif m.role == 'assistant' %}Assistant: {{ m.content }}<|eos|>"
    "{%- elif m.role == 'tool' %}Tool: {{ m.content }}\n"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}Assistant: <think>\n{% endif %}"
)

# DeepSeek-V3.1's shape: the generation prompt opens <think> when chat_template_kwargs says `thinking`, else closes it
DS31_TEMPLATE = (
    "{{ bos_token }}{%- if tools %}## Tools\n{{ tools | tojson }}\n{% endif %}"
    "{%- for m in messages %}"
    "{%- if m.role == 'user' %}User: {{ m.content }}\n"
    "{%- elif m.role == 'assistant' %}Assistant: </think>{{ m.content or '' }}<|eos|>"
    "{%- elif m.role == 'tool' %}Tool: {{ m.content }}\n"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}Assistant: {{ '<think>' if thinking else '</think>' }}{% endif %}"
)


def _copy_weights(tiny: str, out: str) -> None:
    os.makedirs(out, exist_ok=True)
    for f in os.listdir(tiny):
        if f.endswith(".safetensors") or f.endswith(".index.json") or f == "config.json":
            shutil.copy(os.path.join(tiny, f), out)


def kimi_model(tiny: str, out: str) -> str:
    """Kimi: 256 byte ranks, then the reserved ids 256.. named as above (all special: kept only as markers)."""
    _copy_weights(tiny, out)
    with open(os.path.join(out, "tiktoken.model"), "w") as f:
        for b in range(256):
            f.write(f"{base64.b64encode(bytes([b])).decode()} {b}\n")
    cfg = {
        "bos_token": "[BOS]",
        "eos_token": "[EOS]",
        "added_tokens_decoder": {str(256 + i): {"content": c, "special": True} for i, c in enumerate(KIMI_NAMED)},
        "chat_template": KIMI_TEMPLATE,
    }
    with open(os.path.join(out, "tokenizer_config.json"), "w") as f:
        json.dump(cfg, f)
    return out


def deepseek_model(tiny: str, out: str, generation_config: dict | None = None, template: str = DS_TEMPLATE) -> str:
    """DeepSeek: the tiny byte-level tokenizer.json with its added tokens 260.. renamed to the markers (tool markers
    special, <think> / </think> not, as DeepSeek-R1's), add_bos_token, the template given (R1's shape by default)."""
    _copy_weights(tiny, out)
    with open(os.path.join(tiny, "tokenizer.json"), encoding="utf-8") as f:
        tj = json.load(f)
    rename = {260 + i: m for i, m in enumerate(DS_MARKERS)}
    vocab = tj["model"]["vocab"]
    for t in tj["added_tokens"]:
        if t["id"] in rename:
            del vocab[t["content"]]
            t["content"] = rename[t["id"]]
            t["special"] = "think" not in t["content"]
            vocab[t["content"]] = t["id"]
    with open(os.path.join(out, "tokenizer.json"), "w", encoding="utf-8") as f:
        json.dump(tj, f, ensure_ascii=False)
    with open(os.path.join(tiny, "tokenizer_config.json"), encoding="utf-8") as f:
        cfg = json.load(f)
    cfg["chat_template"] = template
    with open(os.path.join(out, "tokenizer_config.json"), "w", encoding="utf-8") as f:
        json.dump(cfg, f, ensure_ascii=False)
    if generation_config is not None:
        with open(os.path.join(out, "generation_config.json"), "w") as f:
            json.dump(generation_config, f)
    return out


def script_outputs(llm, scripts: dict[str, str], open_ended: tuple[str, ...] = ()) -> None:
    """A prompt holding `[script:NAME]` (the last such tag) generates scripts[NAME] (encoded, then EOS) whatever the
    model samples: the engine's sampled tokens are replaced as they are sampled, so the next step is fed them.
    Scripts named in open_ended have no EOS: the model samples on after them (under any grammar then in force)."""
    engine = llm.engine
    tok = engine.tokenizer
    eos = sorted(engine.eos_token_ids)[0]
    ids = {k: tok.encode(v) + ([] if k in open_ended else [eos]) for k, v in scripts.items()}
    loop = engine.loop
    inner = getattr(loop, "loop", loop)
    original = inner.sample
    chosen: dict[str, list[int] | None] = {}
    counts: dict[str, int] = {}

    def sample(out, *args, **kw):
        step = original(out, *args, **kw)
        if step.tokens is None:
            return step
        for j, c in enumerate(c for c in out.chunks if c.sample):
            rid = c.req.request_id
            if rid not in chosen:
                prompt = tok.decode(c.req.prompt_token_ids, skip_special_tokens=False)
                at = {k: prompt.rfind(f"[script:{k}]") for k in ids}  # the last tag wins (later turns)
                best = max(at, key=at.get, default=None)
                chosen[rid] = ids[best] if best is not None and at[best] >= 0 else None
            script, n = chosen[rid], counts.get(rid, 0)
            counts[rid] = n + 1
            if script is not None and n < len(script):
                step.tokens[j] = script[n]
                if step.host is not None:
                    step.host[0][j] = script[n]
        return step

    inner.sample = sample
