"""Engine fixtures: every engine a test makes is checked for leaked KV pages when the test ends."""

import pytest

from mlaserve.config import EngineConfig
from mlaserve.engine.engine import LLMEngine

_engines: list = []


def make_engine(model: str, spec=None, **kw) -> LLMEngine:
    kw.setdefault("device", "cpu")
    eng = LLMEngine(EngineConfig(model=model, **kw), spec=spec)
    _engines.append(eng)
    return eng


def run_all(engine: LLMEngine) -> dict[str, list[int]]:
    """Step until idle; token ids per request id."""
    out: dict[str, list[int]] = {}
    while engine.has_unfinished():
        for o in engine.step():
            out.setdefault(o.request_id, []).extend(o.new_token_ids)
    return out


def run_requests(engine: LLMEngine, prompts: list[list[int]], params: list) -> list[list[int]]:
    """Add one request a prompt (params: one each), step until idle -> each request's token ids, in prompt order."""
    rids = [engine.add_request(p, sp) for p, sp in zip(prompts, params)]
    out = run_all(engine)
    return [out.get(r, []) for r in rids]


@pytest.fixture(autouse=True)
def no_leaked_pages():
    yield
    engines, _engines[:] = list(_engines), []
    for eng in engines:
        assert not eng.has_unfinished(), "a test left requests unfinished"
        eng.pool.check()
        assert eng.pool.num_free == eng.pool.num_pages, f"{eng.pool.num_used} KV pages leaked"
