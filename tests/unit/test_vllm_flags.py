"""vLLM's serve flags that change what runs: --tokenizer, --chat-template (a file or the template itself),
--enable-expert-parallel, --root-path, --uvicorn-log-level, and --disable-log-requests accepted with its meaning."""

import argparse

import pytest

from mlaserve import LLM, default_model_path
from mlaserve.args import add_engine_args, compat_notes, engine_kwargs_from_args
from mlaserve.cli import build_parser


def _engine_args(argv):
    p = argparse.ArgumentParser()
    add_engine_args(p)
    return p.parse_args(argv)


def test_enable_expert_parallel_puts_the_experts_on_every_rank():
    kw = engine_kwargs_from_args(_engine_args(["--tp", "4", "--enable-expert-parallel"]))
    assert (kw["tp"], kw["moe_tp_size"], kw["ep_size"]) == (4, 1, 4)
    with pytest.raises(ValueError, match="--enable-expert-parallel"):
        engine_kwargs_from_args(_engine_args(["--tp", "4", "--moe-tp-size", "2", "--enable-expert-parallel"]))
    assert "ep_size" not in engine_kwargs_from_args(_engine_args(["--tp", "4"]))


def test_disable_log_requests_is_accepted_with_its_meaning():
    notes = compat_notes(_engine_args(["--disable-log-requests"]))
    assert notes == ["--disable-log-requests: accepted; mlaserve logs no prompts or outputs"]


def test_chat_template_from_a_file_or_inline(tmp_path, capsys):
    f = tmp_path / "t.jinja"
    f.write_text("{{ messages[0].content }}!")
    assert _engine_args(["--chat-template", str(f)]).chat_template == "{{ messages[0].content }}!"
    assert _engine_args(["--chat-template", "{{ 1 }}"]).chat_template == "{{ 1 }}"
    with pytest.raises(SystemExit):
        _engine_args(["--chat-template", str(tmp_path / "missing.jinja")])
    assert "neither a file nor a jinja template" in capsys.readouterr().err


def test_chat_template_replaces_the_tokenizers(tiny_ckpt):
    llm = LLM(
        tiny_ckpt, device="cpu", chat_template="<{{ messages[0].content }}>{% if add_generation_prompt %}A:{% endif %}"
    )
    assert llm.tokenizer.apply_chat_template([{"role": "user", "content": "hi"}]) == "<hi>A:"
    llm.close()
    with pytest.raises(ValueError, match="chat_template: the template does not compile"):
        LLM(tiny_ckpt, device="cpu", chat_template="{% for %}")


def test_tokenizer_from_another_folder(tiny_ckpt, tmp_path):
    from mlaserve.tokenizer import Tokenizer

    llm = LLM(tiny_ckpt, device="cpu", tokenizer=default_model_path())
    other = Tokenizer.from_pretrained(default_model_path())
    assert llm.tokenizer.encode("def f(x):", True) == other.encode("def f(x):", True)
    llm.close()
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match="tokenizer: .* holds no tokenizer"):
        LLM(tiny_ckpt, device="cpu", tokenizer=str(tmp_path / "empty"))


def test_root_path_and_uvicorn_log_level_reach_uvicorn(tiny_ckpt):
    from mlaserve.server.api import Server

    argv = ["serve", "--root-path", "/llm", "--uvicorn-log-level", "warning"]
    args = build_parser(argv).parse_args(argv)
    assert (args.root_path, args.uvicorn_log_level) == ("/llm", "warning")
    llm = LLM(tiny_ckpt, device="cpu")
    server = Server(llm.engine, "m", root_path=args.root_path, log_level=args.uvicorn_log_level)
    assert server.uvicorn.config.root_path == "/llm" and server.uvicorn.config.log_level == "warning"
    server.async_engine.shutdown()
    llm.close()
