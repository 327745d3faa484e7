"""`mlaserve --version`, and every subcommand's --help showing its defaults."""

import pytest

from mlaserve import __version__
from mlaserve.cli import main


def test_version(capsys):
    with pytest.raises(SystemExit) as e:
        main(["--version"])
    assert e.value.code == 0 and capsys.readouterr().out.strip() == f"mlaserve {__version__}"


@pytest.mark.parametrize("argv", [["serve"], ["generate"], ["bench", "serve"], ["bench", "compare"]])
def test_help_shows_defaults(argv, capsys):
    with pytest.raises(SystemExit):
        main([*argv, "--help"])
    out = capsys.readouterr().out
    assert "(default:" in out
    if argv == ["serve"]:
        assert "--max-logprobs" in out and "(default: 20)" in " ".join(out.split())


def test_pasted_vllm_and_sglang_flags_mean_what_they_say():
    """vLLM's flags are accepted with their meaning here, SGLang's names are aliases."""
    import argparse

    from mlaserve.args import add_engine_args, compat_notes, engine_kwargs_from_args

    p = argparse.ArgumentParser()
    add_engine_args(p)
    a = p.parse_args(
        ["--mem-fraction-static", "0.5", "--context-length", "4096", "--max-running-requests", "7", "--tp-size", "2"]
        + ["--disable-cuda-graph", "--disable-radix-cache", "--trust-remote-code", "--swap-space", "4"]
    )
    kw = engine_kwargs_from_args(a)
    assert kw["gpu_memory_utilization"] == 0.5 and kw["max_model_len"] == 4096 and kw["max_num_seqs"] == 7
    assert kw["tp"] == 2 and kw["enforce_eager"] and kw["enable_prefix_caching"] is False
    assert [n.split(":")[0] for n in compat_notes(a)] == ["--trust-remote-code", "--swap-space"]
    assert p.parse_args([]).enable_prefix_caching is True
    assert p.parse_args(["--enable-prefix-caching"]).enable_prefix_caching is True
    assert p.parse_args(["--no-enable-prefix-caching"]).enable_prefix_caching is False
    assert p.parse_args(["--kv-cache-dtype", "auto"]).kv_cache_dtype == "auto"
    assert kw["kv_cache_dtype"] == "auto"


@pytest.mark.parametrize("value", ["auto", "fp8", "fp8_e4m3"])
def test_kv_cache_dtype_accepted_and_passed_to_the_engine(value):
    import argparse

    from mlaserve.args import add_engine_args, engine_kwargs_from_args
    from mlaserve.config import EngineConfig

    p = argparse.ArgumentParser()
    add_engine_args(p)
    kw = engine_kwargs_from_args(p.parse_args(["--kv-cache-dtype", value]))
    assert kw["kv_cache_dtype"] == value
    EngineConfig(model="m", **kw).validate()


@pytest.mark.parametrize(
    "value,says", [("fp8_e5m2", "e5m2 cache is not implemented"), ("float16", "not supported"), ("FP8", "fp8_e4m3")]
)
def test_kv_cache_dtype_outside_auto_and_fp8_is_refused_in_one_line(value, says, capsys):
    with pytest.raises(SystemExit) as e:
        main(["generate", "--kv-cache-dtype", value, "--prompt", "hi"])
    err = capsys.readouterr().err.strip().splitlines()
    assert e.value.code == 2 and "--kv-cache-dtype" in err[-1] and says in err[-1]


def test_an_error_is_one_line_with_exit_code_2_and_debug_shows_the_traceback(tmp_path, capsys):
    from mlaserve.config import ConfigError

    missing = str(tmp_path / "no-model")
    assert main(["generate", missing, "--prompt", "hi"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("mlaserve: error: ") and "config.json" in err[0]
    with pytest.raises(ConfigError):
        main(["generate", missing, "--prompt", "hi", "--debug"])
    with pytest.raises(ConfigError):
        main(["--debug", "generate", missing, "--prompt", "hi"])


def test_serve_checks_the_port_before_loading_the_model(tmp_path, capsys):
    import socket

    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        # the model folder does not exist either: the port's error coming first proves the order
        assert main(["serve", str(tmp_path / "no-model"), "--port", str(port)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and f"--port {port}" in err[0] and "config.json" not in err[0]


def test_generate_checks_the_sampling_flags_before_loading_the_model(tmp_path, capsys):
    # the model folder does not exist: the flag's error coming first proves the order
    assert main(["generate", str(tmp_path / "no-model"), "--max-tokens", "0", "--prompt", "x"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "max_tokens: must be a positive integer, got 0" in err[0]


def test_serve_refuses_bad_sizes_in_one_line(tmp_path, capsys):
    """A port outside 0-65535 names --port before the model loads; max_model_len 0 is refused, not read as unset;
    a KV budget of 0 GB or a negative prefill graph size names its field."""
    assert main(["serve", str(tmp_path / "no-model"), "--port", "99999"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--port: must be in 0-65535, got 99999" in err[0]
    from mlaserve.config import EngineConfig

    for bad in (0, 1, -4):
        with pytest.raises(ValueError, match=f"^max_model_len: must be >= 2 .*got {bad}$"):
            EngineConfig(model="m", max_model_len=bad).validate()
    EngineConfig(model="m", max_model_len=2).validate()
    for field, bad, says in (
        ("kv_cache_memory_gb", -1.0, "must be > 0"),
        ("kv_cache_memory_gb", 0.0, "must be > 0"),
        ("prefill_graph_max_tokens", -5, "must be >= 0"),
        ("prefill_graph_max_context", -1, "must be >= 0"),
    ):
        with pytest.raises(ValueError, match=f"^{field}: {says}"):
            EngineConfig(model="m", **{field: bad}).validate()
    EngineConfig(model="m", prefill_graph_max_tokens=0, prefill_graph_max_context=0).validate()


@pytest.mark.parametrize(
    "flags,says",
    [
        (["--tool-call-parser", "hermes"], "--tool-call-parser: must be one of kimi_k2, deepseek_v3, deepseek_v31"),
        (["--reasoning-parser", "qwen3"], "--reasoning-parser: must be one of deepseek_r1, deepseek_v3, kimi_k2"),
        (["--enable-auto-tool-choice"], "--enable-auto-tool-choice: needs --tool-call-parser"),
        (["--generation-config", "file"], "--generation-config: must be auto or vllm"),
    ],
)
def test_serve_refuses_unknown_parsers_before_loading_the_model(flags, says, tmp_path, capsys):
    assert main(["serve", str(tmp_path / "no-model"), *flags]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and says in err[0] and "config.json" not in err[0]


@pytest.mark.parametrize("value", ["fp8_e5m2", "bfloat16", "int8"])
def test_engine_config_refuses_a_kv_cache_dtype_naming_the_field(value):
    from mlaserve.config import EngineConfig

    with pytest.raises(ValueError, match=f"^kv_cache_dtype: '{value}' is not supported.*auto.*fp8_e4m3"):
        EngineConfig(model="m", kv_cache_dtype=value).validate()


def test_vllm_speculative_config_and_sglang_topk(tmp_path):
    """vLLM's --speculative-config JSON (method/model/num_speculative_tokens) and SGLang's --speculative-eagle-topk 1
    mean what they say; tree drafting, another method, bad JSON and both forms at once are one-line errors."""
    import argparse
    import json

    from mlaserve.args import add_engine_args, engine_kwargs_from_args
    from mlaserve.config import SpecConfig

    draft = tmp_path / "draft"
    draft.mkdir()
    p = argparse.ArgumentParser()
    add_engine_args(p)
    vllm = json.dumps({"method": "eagle3", "model": str(draft), "num_speculative_tokens": 3})
    kw = engine_kwargs_from_args(p.parse_args(["--speculative-config", vllm]))
    spec = SpecConfig.from_dict(kw["speculative_config"])
    assert (spec.algorithm, spec.draft_model, spec.num_steps, spec.num_draft_tokens) == ("EAGLE3", str(draft), 3, 4)
    sgl = ["--speculative-algorithm", "EAGLE3", "--speculative-draft-model-path", str(draft)]
    sgl += ["--speculative-num-steps", "2", "--speculative-eagle-topk", "1", "--speculative-num-draft-tokens", "3"]
    spec = SpecConfig.from_dict(engine_kwargs_from_args(p.parse_args(sgl))["speculative_config"])
    assert (spec.num_steps, spec.num_draft_tokens) == (2, 3)
    bad = [
        (["--speculative-eagle-topk", "4"], "--speculative-eagle-topk: tree drafting"),
        (["--speculative-config", "{method: eagle3}"], "--speculative-config: not JSON"),
        (["--speculative-config", "[1]"], "--speculative-config: a JSON object"),
        (["--speculative-config", vllm, "--speculative-algorithm", "EAGLE3"], "not both"),
        (["--speculative-simulate-acceptance", "0.5"], "--speculative-simulate-acceptance: needs"),
    ]
    for argv, says in bad:
        with pytest.raises(ValueError, match=says):
            engine_kwargs_from_args(p.parse_args(argv))
    for d, says in [
        ({"method": "medusa"}, "speculative_config.method: eagle3 .* or ngram"),
        ({"method": "eagle3", "model": str(draft), "draft_model": str(draft)}, "'model' .* and 'draft_model' both"),
        ({"method": "eagle3", "model": str(draft), "prompt_lookup_max": 4}, "prompt_lookup_min/max: only the NGRAM"),
        ({"method": "ngram", "suffix_tokens": 4}, r"unknown keys \['suffix_tokens'\]"),
    ]:
        with pytest.raises(ValueError, match=says):
            SpecConfig.from_dict(d)


def test_cli_error_for_tree_drafting_is_one_line(capsys):
    rc = main(["generate", "--prompt", "x", "--speculative-eagle-topk", "8"])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and len(err) == 1 and "--speculative-eagle-topk" in err[0], err
