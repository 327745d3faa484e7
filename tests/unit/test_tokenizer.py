"""Tokenizer: loading, round trips, chat templates, the byte-level writer, and parity with transformers."""

import json
import os
import random

import pytest

from mlaserve.tokenizer import Tokenizer, bytes_to_unicode, write_byte_level_tokenizer

SAMPLES = [
    "",
    " ",
    "hello world",
    "  leading and trailing  ",
    "tabs\tand\nnewlines\r\n",
    "\x00\x01\x7f",
    "héllo wörld",
    "世界你好",
    "日本語のテキスト",
    "🎉🚀",
    "👩‍👩‍👧‍👦 family",
    "e\u0301 combining",
    "\ufffd literal",
    "<|t300|> looks like a filler",
    "mixed 世 🎉 é \U0010ffff end",
]


def random_text(rng: random.Random, n: int) -> str:
    """Unicode from every plane (no surrogates), weighted towards ASCII and multi-byte neighbours."""
    ranges = [(0x20, 0x7E), (0x0, 0x1F), (0x80, 0x7FF), (0x800, 0xD7FF), (0xE000, 0xFFFF), (0x10000, 0x10FFFF)]
    out = []
    for _ in range(n):
        lo, hi = rng.choice(ranges)
        out.append(chr(rng.randint(lo, hi)))
    return "".join(out)


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    d = str(tmp_path_factory.mktemp("bytetok"))
    write_byte_level_tokenizer(d, 512, 256, 257)
    return d


@pytest.fixture(scope="module")
def tok(tiny_dir):
    return Tokenizer.from_pretrained(tiny_dir)


def test_special_ids_and_layout(tok):
    assert tok.vocab_size == 512 and tok.bos_token_id == 256 and tok.eos_token_ids == [257]
    assert tok.encode("<|im_start|><|im_end|>") == [258, 259]
    b2u = bytes_to_unicode()
    assert [tok.backend.token_to_id(b2u[b]) for b in range(256)] == list(range(256))
    assert tok.encode("hi") == [104, 105]
    assert tok.encode("hi", add_special_tokens=True) == [256, 104, 105]
    assert tok.decode([256, 104, 105, 257]) == "hi"
    assert tok.decode([256, 104, 105, 257], skip_special_tokens=False) == "<|bos|>hi<|eos|>"
    assert tok.has_chat_template


def test_round_trip(tok):
    rng = random.Random(0)
    for s in SAMPLES + [random_text(rng, rng.randint(1, 60)) for _ in range(300)]:
        ids = tok.encode(s)
        assert tok.decode(ids) == s, repr(s)
        assert all(0 <= i < tok.vocab_size for i in ids)


def test_every_id_decodes_nonempty_and_fillers_distinct(tok):
    texts = [tok.decode([i], skip_special_tokens=False) for i in range(tok.vocab_size)]
    assert all(texts)
    fillers = texts[260:]
    assert fillers[0] == "<|t260|>" and len(set(fillers)) == len(fillers)
    # Non-special tokens also decode non-empty with the default skip_special_tokens=True
    assert all(tok.decode([i]) for i in range(tok.vocab_size) if i not in (256, 257, 258, 259))
    # Fillers are added tokens: their text encodes back to the same id
    assert tok.encode("<|t300|><|t511|>") == [300, 511]


def test_kimi_size_vocab(tmp_path):
    """163840 ids (Kimi/Moonlight): bos/eos at the top, every id decodes, loads in about a second."""
    write_byte_level_tokenizer(str(tmp_path), 163840, 163584, 163586)
    t = Tokenizer.from_pretrained(str(tmp_path))
    assert t.vocab_size == 163840 and t.bos_token_id == 163584 and t.eos_token_ids == [163586]
    assert t.encode("<|im_start|><|im_end|>") == [256, 257]
    outs = t.backend.decode_batch([[i] for i in range(163840)], skip_special_tokens=False)
    assert all(outs)
    assert t.decode([163585, 163839]) == "<|t163585|><|t163839|>"
    assert t.decode(t.encode("héllo 世界 🎉")) == "héllo 世界 🎉"


def test_low_bos_eos_moves_bytes(tmp_path):
    """DeepSeek-V3's preset has bos 0, eos 1: the bytes take the next free ids and still round-trip."""
    write_byte_level_tokenizer(str(tmp_path), 1000, 0, 1)
    t = Tokenizer.from_pretrained(str(tmp_path))
    assert t.bos_token_id == 0 and t.eos_token_ids == [1]
    assert t.encode("\x00") == [2] and t.encode("<|im_start|>") == [258]
    assert t.decode(t.encode("héllo 世界")) == "héllo 世界"
    assert all(t.decode([i], skip_special_tokens=False) for i in range(1000))


def test_writer_is_deterministic(tmp_path):
    a, b = tmp_path / "a", tmp_path / "b"
    write_byte_level_tokenizer(str(a), 700, 256, 257)
    write_byte_level_tokenizer(str(b), 700, 256, 257)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        assert (a / name).read_bytes() == (b / name).read_bytes()


def test_writer_rejects_bad_arguments(tmp_path):
    with pytest.raises(ValueError, match="vocab_size"):
        write_byte_level_tokenizer(str(tmp_path), 259, 256, 257)
    with pytest.raises(ValueError, match="eos_token_id"):
        write_byte_level_tokenizer(str(tmp_path), 512, 256, 512)
    write_byte_level_tokenizer(str(tmp_path), 512, 300, 300)  # bos == eos: one token serves both
    t = Tokenizer.from_pretrained(str(tmp_path))
    assert t.bos_token_id == 300 and t.eos_token_ids == [300]


def test_no_tokenizer_json_gives_none(tmp_path):
    (tmp_path / "config.json").write_text("{}")
    assert Tokenizer.from_pretrained(str(tmp_path)) is None


def test_eos_ids_from_generation_and_model_config(tmp_path):
    write_byte_level_tokenizer(str(tmp_path), 512, 256, 257)
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [259, 257]}))
    (tmp_path / "config.json").write_text(json.dumps({"text_config": {"eos_token_id": 300, "bos_token_id": 256}}))
    t = Tokenizer.from_pretrained(str(tmp_path))
    assert t.eos_token_ids == [257, 259, 300] and t.bos_token_id == 256


# ---- chat templates -------------------------------------------------------------------------------------------------


def _with_template(tmp_path, config_template=None, jinja_file=None) -> Tokenizer:
    write_byte_level_tokenizer(str(tmp_path), 512, 256, 257)
    cfg_path = tmp_path / "tokenizer_config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg.pop("chat_template")
    if config_template is not None:
        cfg["chat_template"] = config_template
    cfg_path.write_text(json.dumps(cfg))
    if jinja_file is not None:
        (tmp_path / "chat_template.jinja").write_text(jinja_file)
    return Tokenizer.from_pretrained(str(tmp_path))


def test_chatml_template(tok):
    msgs = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]
    assert tok.apply_chat_template(msgs) == (
        "<|bos|><|im_start|>system\nbe brief<|im_end|>\n<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    )
    assert tok.apply_chat_template(msgs, add_generation_prompt=False).endswith("hi<|im_end|>\n")
    ids = tok.encode(tok.apply_chat_template(msgs))
    assert ids[:2] == [256, 258] and ids.count(256) == 1


def test_continue_final_message_leaves_the_last_message_open(tok, tmp_path):
    """continue_final_message: the text ends with the last message's text (its trailing spaces kept when the
    template keeps them; the last text part of a list), not with the template's end of turn."""
    msgs = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "Sure, the answer is "}]
    closed = tok.apply_chat_template(msgs, add_generation_prompt=False)
    opened = tok.apply_chat_template(msgs, add_generation_prompt=False, continue_final_message=True)
    assert opened == closed[: closed.rindex("<|im_end|>")] and opened.endswith("answer is ")
    parts = [msgs[0], {"role": "assistant", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}]
    assert tok.apply_chat_template(parts, False, continue_final_message=True).endswith("assistant\na\nb")
    trims = _with_template(tmp_path, "{% for m in messages %}<{{ m.content | trim }}>{% endfor %}")
    assert (
        trims.apply_chat_template([{"role": "user", "content": " x y  "}], False, continue_final_message=True) == "<x y"
    )
    with pytest.raises(ValueError, match="^continue_final_message: cannot be combined with add_generation_prompt"):
        tok.apply_chat_template(msgs, continue_final_message=True)
    with pytest.raises(ValueError, match="^continue_final_message: the last message has no text"):
        tok.apply_chat_template([msgs[0], {"role": "assistant", "content": " "}], False, continue_final_message=True)
    (tmp_path / "u").mkdir()
    upper = _with_template(tmp_path / "u", "{% for m in messages %}{{ m.content | upper }}{% endfor %}")
    with pytest.raises(ValueError, match="^continue_final_message: the chat template does not keep"):
        upper.apply_chat_template([{"role": "user", "content": "abc"}], False, continue_final_message=True)


def test_text_parts_and_image_parts(tok):
    parts = [{"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}]
    assert tok.apply_chat_template(parts, add_generation_prompt=False) == "<|bos|><|im_start|>user\na\nb<|im_end|>\n"
    image = [
        {"role": "user", "content": "x"},
        {"role": "user", "content": [{"type": "image_url", "image_url": {"url": "data:"}}]},
    ]
    with pytest.raises(ValueError, match=r"^messages\[1\]\.content: only text parts are supported$"):
        tok.apply_chat_template(image)
    with pytest.raises(ValueError, match="messages"):
        tok.apply_chat_template([])


def test_template_from_list_with_default(tmp_path):
    default = "{% for m in messages %}[{{ m.content }}]{% endfor %}"
    t = _with_template(tmp_path, [{"name": "tool_use", "template": "TOOLS"}, {"name": "default", "template": default}])
    assert t.apply_chat_template([{"role": "user", "content": "x"}, {"role": "user", "content": "y"}]) == "[x][y]"


def test_chat_template_jinja_file_wins(tmp_path):
    t = _with_template(tmp_path, "from config", jinja_file="{{ bos_token }}{{ eos_token }}|{{ messages[0].content }}")
    assert t.apply_chat_template([{"role": "user", "content": "z"}]) == "<|bos|><|eos|>|z"


def test_no_template_raises(tmp_path):
    t = _with_template(tmp_path)
    assert not t.has_chat_template
    with pytest.raises(ValueError, match="chat_template"):
        t.apply_chat_template([{"role": "user", "content": "x"}])


def test_template_helpers_as_transformers(tmp_path):
    source = (
        "{% if messages[0].role != 'user' %}{{ raise_exception('first message must be the user') }}{% endif %}"
        "{{ messages[0].content | tojson }}|{{ {'k': 'é<>'} | tojson(indent=None) }}|{{ strftime_now('%Y') | length }}"
        "|{{ tools is none }}|{{ custom }}|{{ messages[0].get('tool_calls', 'none') }}\n"
        "  {% for i in range(3) %}{% if i == 1 %}{% break %}{% endif %}{{ i }}{% endfor %}\n"
        "{% generation %}G{% endgeneration %}"
    )
    t = _with_template(tmp_path, source)
    out = t.apply_chat_template([{"role": "user", "content": '世 "q"', "tool_calls": None}], custom=7)
    assert out == '"世 \\"q\\""|{"k": "é<>"}|4|True|7|none\n0G'  # trim_blocks/lstrip_blocks as transformers
    with pytest.raises(ValueError, match="first message must be the user"):
        t.apply_chat_template([{"role": "assistant", "content": "x"}])


def test_null_content_reaches_the_template_and_failures_are_value_errors(tmp_path):
    """DeepSeek's template tests `content is none` on tool-call turns; a template failing on the messages (here a
    None added to a string) or not compiling is a ValueError (the server's 400), never another exception."""
    t = _with_template(tmp_path, "{% for m in messages %}{{ m.content is none }}{% endfor %}")
    assert t.apply_chat_template([{"role": "assistant", "content": None, "tool_calls": []}]) == "True"
    t = _with_template(tmp_path, "{% for m in messages %}{{ 'x' + m.content }}{% endfor %}")
    with pytest.raises(ValueError, match="chat template: failed to render these messages: TypeError"):
        t.apply_chat_template([{"role": "assistant", "content": None}])
    t = _with_template(tmp_path, "{% for m in messages %}")
    with pytest.raises(ValueError, match="does not compile"):
        t.apply_chat_template([{"role": "user", "content": "x"}])


@pytest.mark.parametrize("add_bos", [True, False, None])
def test_add_bos_token_governs_special_tokens(tmp_path, add_bos):
    """tokenizer_config.json's add_bos_token decides BOS on encode(add_special_tokens=True); unset, tokenizer.json's
    post-processor (which prepends it here)."""
    write_byte_level_tokenizer(str(tmp_path), 512, 256, 257)
    cfg = json.loads((tmp_path / "tokenizer_config.json").read_text())
    cfg.pop("add_bos_token")
    if add_bos is not None:
        cfg["add_bos_token"] = add_bos
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(cfg))
    t = Tokenizer.from_pretrained(str(tmp_path))
    want = [104, 105] if add_bos is False else [256, 104, 105]
    assert t.encode("hi", add_special_tokens=True) == want and t.encode("hi") == [104, 105]


# ---- parity with transformers ---------------------------------------------------------------------------------------


def test_matches_transformers(tiny_dir, tok):
    transformers = pytest.importorskip("transformers")
    hf = transformers.AutoTokenizer.from_pretrained(tiny_dir)
    assert len(hf) == tok.vocab_size and hf.bos_token_id == tok.bos_token_id and hf.eos_token_id == 257
    rng = random.Random(1)
    texts = SAMPLES + ["<|im_start|>user\nhi<|im_end|>", "a<|bos|>b<|t400|>c"]
    texts += [random_text(rng, rng.randint(1, 40)) for _ in range(100)]
    for s in texts:
        for add in (False, True):
            assert tok.encode(s, add_special_tokens=add) == hf.encode(s, add_special_tokens=add), repr(s)
    for _ in range(100):
        ids = [rng.randrange(tok.vocab_size) for _ in range(rng.randint(1, 30))]
        for skip in (False, True):
            assert tok.decode(ids, skip) == hf.decode(ids, skip_special_tokens=skip)
    chats = [
        [{"role": "user", "content": "hi"}],
        [
            {"role": "system", "content": "s"},
            {"role": "user", "content": "世界"},
            {"role": "assistant", "content": "ok"},
            {"role": "user", "content": "again"},
        ],
        [{"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}],
    ]
    for msgs in chats:
        for gen in (False, True):
            assert tok.apply_chat_template(msgs, add_generation_prompt=gen) == hf.apply_chat_template(
                msgs, tokenize=False, add_generation_prompt=gen
            )


# ---- make-random writes it ------------------------------------------------------------------------------------------


def test_make_random_writes_tokenizer(tiny_ckpt, tmp_path):
    t = Tokenizer.from_pretrained(tiny_ckpt)
    assert t is not None and t.vocab_size == 512 and t.bos_token_id == 256 and t.eos_token_ids == [257]
    from mlaserve.models.make_random import make_random

    out = make_random("tiny", str(tmp_path), layers=1, progress=False, tokenizer=False)
    assert not os.path.exists(os.path.join(out, "tokenizer.json"))
    assert Tokenizer.from_pretrained(out) is None
