"""Through the server: attn-tp2 with moe-tp2 and with ep2 give TP1's greedy tokens."""

import httpx
import pytest

from mlaserve import LLM

from ..server.conftest import ENGINE_KW, greedy_ids, start_server


@pytest.mark.parametrize(
    "kw", [dict(attn_tp_size=2, moe_tp_size=2), dict(attn_tp_size=2, ep_size=2)], ids=["moe-tp2", "ep2"]
)
def test_server_tp_matches_tp1(tiny_ckpt, kw):
    offline = LLM(tiny_ckpt, **ENGINE_KW)
    prompts = [[5, 6, 7], list(range(40, 90)), [300] * 20]
    want = [greedy_ids(offline, p, 10, ignore_eos=True) for p in prompts]
    run = start_server(tiny_ckpt, **kw)
    try:
        for p, w in zip(prompts, want):
            r = httpx.post(
                f"{run.url}/v1/completions",
                json={"prompt": p, "max_tokens": 10, "temperature": 0, "ignore_eos": True, "return_token_ids": True},
                timeout=60,
            )
            assert r.status_code == 200, r.text
            assert r.json()["choices"][0]["token_ids"] == w
    finally:
        assert run.stop() == 0
        run.llm.close()
