"""Tokenizer: HF `tokenizer.json` through the `tokenizers` library, chat templates through sandboxed jinja2.

Also writes the byte-level tokenizer that `make-random` puts beside random checkpoints.
"""

from __future__ import annotations

import json
import os
from datetime import datetime

import jinja2
import jinja2.ext
import jinja2.nodes
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer as HFTokenizer


def _read_json(path: str) -> dict:
    if not os.path.isfile(path):
        return {}
    with open(path, encoding="utf-8") as f:
        data = json.load(f)
    return data if isinstance(data, dict) else {}


def _token_text(value) -> str | None:
    """tokenizer_config.json writes a special token as a string or as an AddedToken dict."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None


def _sorted_deep(x):
    """Kimi's tokenizer sorts tool schemas' keys before its template sees them."""
    if isinstance(x, dict):
        return {k: _sorted_deep(v) for k, v in sorted(x.items())}
    if isinstance(x, list):
        return [_sorted_deep(v) for v in x]
    return x


def _as_id_list(value) -> list[int]:
    if isinstance(value, int) and not isinstance(value, bool):
        return [value]
    if isinstance(value, list):
        return [v for v in value if isinstance(v, int) and not isinstance(v, bool)]
    return []


class _GenerationTag(jinja2.ext.Extension):
    """`{% generation %}...{% endgeneration %}` (transformers' assistant-mask marker): renders its body as is."""

    tags = {"generation"}

    def parse(self, parser):
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_render"), [], [], body).set_lineno(lineno)

    def _render(self, caller):
        return caller()


def _compile_chat_template(source: str) -> jinja2.Template:
    """Compile as transformers does: sandboxed, trim/lstrip blocks, loop controls and its helper globals."""

    def raise_exception(message):
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        # Jinja's own tojson escapes HTML characters; templates expect plain json.dumps
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    def strftime_now(fmt):
        return datetime.now().strftime(fmt)

    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols, _GenerationTag]
    )
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = strftime_now
    return env.from_string(source)


def _normalize_messages(messages: list[dict]) -> list[dict]:
    """Drop None-valued keys but `content` (DeepSeek's template tests `content is none` on tool-call turns), and
    flatten text-part lists into one string."""
    if not isinstance(messages, list) or not messages:
        raise ValueError("messages: must be a non-empty list of objects")
    out = []
    for i, message in enumerate(messages):
        if not isinstance(message, dict):
            raise ValueError(f"messages[{i}]: must be an object, got {type(message).__name__}")
        message = {k: v for k, v in message.items() if v is not None or k == "content"}
        content = message.get("content")
        if isinstance(content, list):
            texts = []
            for part in content:
                if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                    raise ValueError(f"messages[{i}].content: only text parts are supported")
                texts.append(part["text"])
            message["content"] = "\n".join(texts)  # vLLM joins text parts the same way
        out.append(message)
    return out


class Tokenizer:
    """A model folder's tokenizer: ids <-> text, special ids, and the chat template."""

    def __init__(
        self,
        backend: HFTokenizer,
        config: dict | None = None,
        chat_template: str | None = None,
        generation_config: dict | None = None,
        model_config: dict | None = None,
    ):
        self.backend = backend
        config = config or {}
        self.vocab_size: int = backend.get_vocab_size(with_added_tokens=True)
        self.special_ids: frozenset[int] = frozenset(
            i for i, t in backend.get_added_tokens_decoder().items() if t.special
        )
        # add_bos_token / add_eos_token (LlamaTokenizerFast's keys, DeepSeek's config): encode(add_special_tokens=
        # True) follows them; unset, the tokenizer.json post-processor decides.
        self.add_bos: bool | None = (
            config.get("add_bos_token") if isinstance(config.get("add_bos_token"), bool) else None
        )
        self.add_eos: bool = config.get("add_eos_token") is True
        self.sort_tools = False  # Kimi's tokenizer sorts tool schemas' keys
        # Special-token strings the template sees (bos_token, eos_token, ...), as transformers passes them.
        self.special_tokens: dict[str, str] = {}
        for key in ("bos_token", "eos_token", "unk_token", "pad_token"):
            text = _token_text(config.get(key))
            if text is not None:
                self.special_tokens[key] = text

        gen, model = generation_config or {}, model_config or {}
        text_model = model.get("text_config") if isinstance(model.get("text_config"), dict) else {}

        def token_id(key: str) -> list[int]:
            text = self.special_tokens.get(key)
            tid = backend.token_to_id(text) if text is not None else None
            return [] if tid is None else [tid]

        bos = token_id("bos_token") + _as_id_list(gen.get("bos_token_id")) + _as_id_list(model.get("bos_token_id"))
        bos += _as_id_list(text_model.get("bos_token_id"))
        self.bos_token_id: int | None = bos[0] if bos else None
        eos = token_id("eos_token") + _as_id_list(gen.get("eos_token_id")) + _as_id_list(model.get("eos_token_id"))
        eos += _as_id_list(text_model.get("eos_token_id"))
        self.eos_token_ids: list[int] = list(dict.fromkeys(eos))  # ordered union, tokenizer's own first

        self.chat_template = chat_template
        self.has_chat_template: bool = chat_template is not None
        self._template: jinja2.Template | None = None

    @classmethod
    def from_pretrained(cls, path: str) -> Tokenizer | None:
        """Load from a model folder (tokenizer.json, or Kimi's tiktoken.model); None when it has neither (the
        engine then works on token ids)."""
        tok_file = os.path.join(path, "tokenizer.json")
        kimi = False
        if os.path.isfile(tok_file):
            backend = HFTokenizer.from_file(tok_file)
        elif os.path.isfile(os.path.join(path, "tiktoken.model")):  # Kimi's published tokenizer
            from .tokenizer_tiktoken import TiktokenBackend

            backend, kimi = TiktokenBackend(path, bytes_to_unicode()), True
        else:
            return None
        config = _read_json(os.path.join(path, "tokenizer_config.json"))
        if kimi:
            config = {k: v for k, v in config.items() if k not in ("add_bos_token", "add_eos_token")}  # Kimi adds none
        template = config.get("chat_template")
        if isinstance(template, list):  # [{name, template}, ...]: the "default" one, as transformers picks
            named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
            template = named.get("default")
        jinja_file = os.path.join(path, "chat_template.jinja")
        if os.path.isfile(jinja_file):  # transformers 5 writes it; it wins over tokenizer_config.json
            with open(jinja_file, encoding="utf-8") as f:
                template = f.read()
        tok = cls(
            backend,
            config,
            template if isinstance(template, str) else None,
            _read_json(os.path.join(path, "generation_config.json")),
            _read_json(os.path.join(path, "config.json")),
        )
        tok.sort_tools = kimi
        return tok

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        if not isinstance(text, str):
            raise ValueError(f"text: must be a string, got {type(text).__name__}")
        if not add_special_tokens or self.add_bos is None:
            return self.backend.encode(text, add_special_tokens=add_special_tokens).ids
        ids = self.backend.encode(text, add_special_tokens=False).ids
        if self.add_bos and self.bos_token_id is not None:
            ids = [self.bos_token_id, *ids]
        if self.add_eos and self.eos_token_ids:
            ids = [*ids, self.eos_token_ids[0]]
        return ids

    def decode(self, ids: list[int], skip_special_tokens: bool = True, keep: frozenset[int] = frozenset()) -> str:
        """keep: special ids decoded even with skip_special_tokens (the markers a tool or reasoning parser reads)."""
        if skip_special_tokens and keep:
            ids = [i for i in ids if i not in self.special_ids or i in keep]
            return self.backend.decode(ids, skip_special_tokens=False)
        return self.backend.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def set_chat_template(self, source: str) -> None:
        """Replace the tokenizer's chat template (--chat-template); one that does not compile raises ValueError."""
        try:
            compiled = _compile_chat_template(source)
        except jinja2.TemplateSyntaxError as e:
            raise ValueError(f"chat_template: the template does not compile (line {e.lineno}: {e})") from e
        self.chat_template, self.has_chat_template, self._template = source, True, compiled

    def apply_chat_template(
        self, messages: list[dict], add_generation_prompt: bool = True, continue_final_message: bool = False, **kwargs
    ) -> str:
        """Render the chat template to a prompt string (encode it with add_special_tokens=False).
        continue_final_message: the text ends with the last message's text, left open (what the template puts after
        it, the end of its turn, cut), so the model continues that message: a prefilled reply."""
        if continue_final_message:
            if add_generation_prompt:
                raise ValueError("continue_final_message: cannot be combined with add_generation_prompt")
            return _open_final_message(self.apply_chat_template(messages, False, **kwargs), messages)
        if self.chat_template is None:
            raise ValueError(
                "chat_template: this model's tokenizer has no chat template "
                "(tokenizer_config.json 'chat_template' or chat_template.jinja)"
            )
        if self._template is None:
            try:
                self._template = _compile_chat_template(self.chat_template)
            except jinja2.TemplateSyntaxError as e:
                raise ValueError(f"chat template: the model's template does not compile (line {e.lineno}: {e})") from e
        variables = {**self.special_tokens, "tools": None, "documents": None, **kwargs}
        if self.sort_tools and variables["tools"] is not None:
            variables["tools"] = _sorted_deep(variables["tools"])
        variables.update(messages=_normalize_messages(messages), add_generation_prompt=add_generation_prompt)
        try:
            return self._template.render(**variables)
        except jinja2.TemplateError as e:  # raise_exception() in the template: bad input, not a server fault
            raise ValueError(f"chat template: {e}") from e
        except (TypeError, KeyError, AttributeError, IndexError, ValueError, ZeroDivisionError) as e:
            # a template that fails on these messages (a None where it adds strings, a missing key): the request's
            raise ValueError(f"chat template: failed to render these messages: {type(e).__name__}: {e}") from e


def _open_final_message(rendered: str, messages: list[dict]) -> str:
    """The rendered chat cut just after the last message's text (its last text part when it has parts), at that
    text's last place in it: what the template adds after it (end-of-turn tokens) is dropped."""
    content = messages[-1].get("content") if messages else None
    if isinstance(content, list):
        texts = [p.get("text") for p in content if isinstance(p, dict) and isinstance(p.get("text"), str)]
        content = texts[-1] if texts else None
    if not isinstance(content, str) or not content.strip():
        raise ValueError("continue_final_message: the last message has no text to continue")
    core = content.strip()
    at = rendered.rfind(core)
    if at < 0:
        raise ValueError("continue_final_message: the chat template does not keep the last message's text as sent")
    # keep the message's trailing whitespace when the template kept it too
    end = at + len(content.lstrip())
    return rendered[:end] if rendered[at:end] == content.lstrip() else rendered[: at + len(core)]


# ---- the byte-level tokenizer of random checkpoints ---------------------------------------------------------------

CHATML_TEMPLATE = (
    "{{- bos_token }}"
    "{%- for message in messages %}"
    "{%- set content = message['content'] if message['content'] is defined else none %}"
    "{%- set content = '' if content is none else content %}"
    "{%- if content is not string %}"
    "{%- set content = content | selectattr('type', 'equalto', 'text') | map(attribute='text') | join('\\n') %}"
    "{%- endif %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + content + '<|im_end|>\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)


def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte -> printable character map, which the ByteLevel pre-tokenizer and decoder use."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    table = {b: chr(b) for b in printable}
    extra = 0
    for b in range(256):
        if b not in table:
            table[b] = chr(256 + extra)
            extra += 1
    return dict(sorted(table.items()))


def _added(tid: int, content: str, special: bool) -> dict:
    return {
        "id": tid,
        "content": content,
        "single_word": False,
        "lstrip": False,
        "rstrip": False,
        "normalized": False,
        "special": special,
    }


def write_byte_level_tokenizer(out_dir: str, vocab_size: int, bos_token_id: int, eos_token_id: int) -> None:
    """Write tokenizer.json + tokenizer_config.json: a byte-level BPE without merges where every id decodes.

    bos/eos sit at the given ids; the 256 bytes take the lowest other ids (0..255 when bos/eos >= 256), then
    `<|im_start|>` and `<|im_end|>` (special), and every other id is a non-special added token `<|t{id}|>`.
    """
    for name, tid in (("bos_token_id", bos_token_id), ("eos_token_id", eos_token_id)):
        if not isinstance(tid, int) or not 0 <= tid < vocab_size:
            raise ValueError(f"{name}: must be an integer in [0, vocab_size={vocab_size}), got {tid!r}")
    specials = {bos_token_id: "<|bos|>", eos_token_id: "<|eos|>"}
    if bos_token_id == eos_token_id:
        specials = {bos_token_id: "<|endoftext|>"}
    if vocab_size < 256 + len(specials) + 2:
        raise ValueError(
            f"vocab_size: must be >= {256 + len(specials) + 2} (256 bytes + bos/eos + "
            f"<|im_start|>/<|im_end|>), got {vocab_size}"
        )

    free = (i for i in range(vocab_size) if i not in specials)
    byte_chars = bytes_to_unicode()
    tokens: dict[int, str] = {next(free): byte_chars[b] for b in range(256)}
    byte_ids = set(tokens)
    special_ids = set(specials)
    for content in ("<|im_start|>", "<|im_end|>"):
        tid = next(free)
        specials[tid] = content
        special_ids.add(tid)
    tokens.update(specials)
    for tid in free:
        tokens[tid] = f"<|t{tid}|>"
    tokens = dict(sorted(tokens.items()))

    # Every non-byte token is also an added token: encode finds it in text, and decode gives its text back.
    added = [_added(tid, text, tid in special_ids) for tid, text in tokens.items() if tid not in byte_ids]
    bos = specials[bos_token_id]
    byte_level = {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": True}
    tokenizer = {
        "version": "1.0",
        "truncation": None,
        "padding": None,
        "added_tokens": added,
        "normalizer": None,
        "pre_tokenizer": byte_level,
        "post_processor": {  # add_special_tokens=True prepends bos, as DeepSeek-V3's tokenizer does
            "type": "TemplateProcessing",
            "single": [{"SpecialToken": {"id": bos, "type_id": 0}}, {"Sequence": {"id": "A", "type_id": 0}}],
            "pair": [
                {"SpecialToken": {"id": bos, "type_id": 0}},
                {"Sequence": {"id": "A", "type_id": 0}},
                {"SpecialToken": {"id": bos, "type_id": 1}},
                {"Sequence": {"id": "B", "type_id": 1}},
            ],
            "special_tokens": {bos: {"id": bos, "ids": [bos_token_id], "tokens": [bos]}},
        },
        "decoder": byte_level,
        "model": {
            "type": "BPE",
            "dropout": None,
            "unk_token": None,
            "continuing_subword_prefix": None,
            "end_of_word_suffix": None,
            "fuse_unk": False,
            "byte_fallback": False,
            "ignore_merges": False,
            "vocab": {text: tid for tid, text in tokens.items()},
            "merges": [],
        },
    }
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": bos,
        "eos_token": specials[eos_token_id],
        "add_bos_token": True,
        "add_eos_token": False,
        "clean_up_tokenization_spaces": False,
        "model_max_length": 1 << 30,
        "chat_template": CHATML_TEMPLATE,
    }
    os.makedirs(out_dir, exist_ok=True)
    # Compact JSON keeps the 163840-token file small; sorted ids and fixed key order make it deterministic.
    with open(os.path.join(out_dir, "tokenizer.json"), "w", encoding="utf-8") as f:
        f.write(json.dumps(tokenizer, ensure_ascii=False, separators=(",", ":")) + "\n")
    with open(os.path.join(out_dir, "tokenizer_config.json"), "w", encoding="utf-8") as f:
        f.write(json.dumps(config, ensure_ascii=False, indent=1) + "\n")
