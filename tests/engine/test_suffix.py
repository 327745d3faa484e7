"""Short suffixes over cached context as decode rows in MLA's absorbed form (engine/suffix.py): the rule, the rows'
layout, and an engine's prefix hits taking them eagerly and on the suffix graphs' static path with the tokens of a
full prefill."""

import random

import pytest

from mlaserve.attention.base import ForwardBatch, SeqChunk
from mlaserve.engine.suffix import SUFFIX_MAX_TOKENS, SUFFIX_Q, last_rows, suffix_batch_size, suffix_rows
from mlaserve.kernel_config import KernelConfig
from mlaserve.types import SamplingParams

from .conftest import make_engine, run_all


def test_suffix_q_is_mla_decode_max_q_len():
    from mlaserve.kernels.mla_decode import MAX_Q_LEN

    assert SUFFIX_Q == MAX_Q_LEN


def test_suffix_rows_rule_and_layout():
    pages = list(range(10))
    c = SeqChunk([7, 8, 9], 40, pages, "last")
    (row,) = suffix_rows([c])
    assert row.token_ids == [0] * (SUFFIX_Q - 3) + [7, 8, 9] and row.pad == SUFFIX_Q - 3
    assert row.num_cached + len(row.token_ids) == 43 and row.pages is pages  # the same length and pages
    assert suffix_rows([SeqChunk([1] * (SUFFIX_MAX_TOKENS + 1), 200, pages)]) is None  # too long: the context graph
    assert suffix_rows([SeqChunk([1] * 5, 0, pages)]) is None  # no cached context: a prompt's prefill
    assert suffix_rows([SeqChunk([1] * 5, 20, pages)]) is None  # the block's first row would see nothing
    assert suffix_rows([SeqChunk([1] * 33, 20, pages)]) is None  # the same for two rows (31 padding positions)
    assert suffix_rows([SeqChunk([1] * 5, 40, pages, "all")]) is None  # prompt logprobs
    assert suffix_rows([SeqChunk([1] * 5, 40, pages, "none")]) is None
    assert suffix_rows([c] * 9) is None and len(suffix_rows([c] * 8)) == 8
    assert suffix_rows([c] * 7 + [SeqChunk([1] * 33, 40, pages)]) is None  # 9 rows
    assert [suffix_batch_size(n) for n in (1, 2, 3, 5, 8)] == [1, 2, 4, 8, 8]


def test_a_longer_suffix_takes_several_rows_over_the_same_pages():
    pages = list(range(10))
    ids = list(range(100, 170))  # 70 tokens: three rows, 26 padding positions in the first
    a, b, c = suffix_rows([SeqChunk(ids, 40, pages, "last")])
    assert [r.token_ids for r in (a, b, c)] == [[0] * 26 + ids[:6], ids[6:38], ids[38:]]
    assert [r.num_cached for r in (a, b, c)] == [14, 46, 78] and [r.pad for r in (a, b, c)] == [26, 0, 0]
    assert [r.need_logits for r in (a, b, c)] == ["none", "none", "last"]  # logits of the chunk's last token
    assert all(r.pages is pages for r in (a, b, c)) and c.num_cached + SUFFIX_Q == 40 + 70
    rows = suffix_rows([SeqChunk([7], 40, pages), SeqChunk(ids, 40, pages), SeqChunk([8, 9], 50, pages)])
    assert len(rows) == 5 and last_rows(rows) == [0, 3, 4]
    b = ForwardBatch.build(rows, [], page_size=16, device="cpu")
    assert b.seq_lens.tolist() == [41, 46, 78, 110, 52] and b.logits_indices.tolist() == [31, 127, 159]
    assert b.slot_mapping.tolist()[32 : 32 + 27] == [-1] * 26 + [2 * 16 + 8]  # the second chunk's first row


def test_padding_rows_store_no_kv():
    (row,) = suffix_rows([SeqChunk([5, 6], 40, [3, 1, 2], "last")])
    b = ForwardBatch.build([row], [], page_size=16, device="cpu")
    slots = b.slot_mapping.tolist()
    assert slots[: SUFFIX_Q - 2] == [-1] * (SUFFIX_Q - 2)
    assert slots[-2:] == [2 * 16 + 8, 2 * 16 + 9]  # positions 40, 41: page 2 (the third), offsets 8, 9
    assert b.positions.tolist()[-2:] == [40, 41] and b.seq_lens.tolist() == [42]
    assert b.logits_indices.tolist() == [SUFFIX_Q - 1] and b.decode_q_len == SUFFIX_Q


ON = KernelConfig(absorbed_suffix=True)


def _prompts(seed=11):
    rng = random.Random(seed)
    prefix = [rng.randrange(512) for _ in range(48)]  # three pages of 16: a hit for every later prompt
    lens = (1, 5, 17, 32, 33, 64, 100, SUFFIX_MAX_TOKENS + 1)  # one to four rows; the last takes the context graph
    return prefix, [prefix + [rng.randrange(512) for _ in range(n)] for n in lens]


@pytest.mark.parametrize("graphs,kv", [(False, "auto"), (True, "auto"), (True, "fp8")])
def test_prefix_hits_take_suffix_rows_with_a_full_prefills_tokens(tiny_ckpt, graphs, kv, monkeypatch):
    """Each prompt after the prefix, run alone, is a prefix hit whose suffix (1-128 tokens in one to four rows; 129
    is one too many) runs as suffix rows: eagerly, or on the suffix graphs' static path. Greedy tokens equal an
    engine without prefix caching (every prompt prefilled whole, in the naive form; the same KV cache dtype), and no
    page leaks (conftest)."""
    import mlaserve.engine.runner as runner_mod

    prefix, prompts = _prompts()
    sp = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    kw = dict(page_size=16, max_num_seqs=4, dtype="float32", kernels=ON, kv_cache_dtype=kv)
    ref_eng = make_engine(tiny_ckpt, enable_prefix_caching=False, **kw)
    eng = make_engine(tiny_ckpt, **kw)
    if graphs:
        eng.runner.capture_graphs(1, eng.max_model_len, use_graphs=False)
        assert eng.runner.graphs.suffix_sizes == [1, 2, 4, 8]
    eager_rows = []
    rows_fn = runner_mod.suffix_rows
    monkeypatch.setattr(runner_mod, "suffix_rows", lambda p: (eager_rows.append(rows_fn(p)), eager_rows[-1])[1])

    def gen(e, prompt):
        rid = e.add_request(prompt, sp)
        return run_all(e)[rid]

    gen(eng, prefix)
    gen(ref_eng, prefix)
    for p in prompts:
        assert gen(eng, p) == gen(ref_eng, p), len(p)
    assert eng.pool.hits
    if graphs:
        assert eng.runner.graphs.static_runs["suffix"] == 7, eng.runner.graphs.static_runs
    else:  # the runner's eager path took rows (the last prompt's do not fit)
        assert sorted(len(r) for r in eager_rows if r is not None) == [1, 1, 1, 1, 2, 2, 4]


def test_a_suffix_beside_decode_rows_takes_the_suffix_graph(tiny_ckpt):
    """A prefix hit whose suffix shares a step with other requests' decode rows runs the decode graph's static path,
    then the suffix graph's (runner.split_keys), with the tokens of an engine without prefix caching."""
    prefix, prompts = _prompts(seed=5)
    rng = random.Random(3)
    other = [rng.randrange(512) for _ in range(20)]  # decodes while the prefix hits arrive
    sp = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    kw = dict(page_size=16, max_num_seqs=4, dtype="float32", kernels=ON)
    outs, splits = [], []
    for caching in (False, True):
        eng = make_engine(tiny_ckpt, enable_prefix_caching=caching, **kw)
        eng.runner.capture_graphs(1, eng.max_model_len, use_graphs=False)
        split = eng.runner.split_keys
        eng.runner.split_keys = lambda d, p, *a, split=split: (splits.append(split(d, p, *a)), splits[-1])[1]
        rid = eng.add_request(prefix, SamplingParams(temperature=0, max_tokens=1))  # caches the prefix
        first = run_all(eng)[rid]
        rids = [eng.add_request(other, sp)]
        got = {}
        for p in (prompts[1], prompts[5]):  # 5 and 64 new tokens: one row, two rows
            for _ in range(2):
                for o in eng.step():
                    got.setdefault(o.request_id, []).extend(o.new_token_ids)
            rids.append(eng.add_request(p, sp))
        for rid, toks in run_all(eng).items():
            got.setdefault(rid, []).extend(toks)
        outs.append([first] + [got[r] for r in rids])
        if caching:
            assert eng.pool.hits
    assert outs[0] == outs[1]
    kinds = [(k[0][0], k[1][0], k[1][1]) for k in splits if k is not None]
    assert ("decode", "suffix", 1) in kinds and ("decode", "suffix", 2) in kinds, kinds


def test_no_suffix_graphs_under_speculation_or_determinism_or_when_off(tiny_ckpt):
    default = make_engine(tiny_ckpt, page_size=16, max_num_seqs=1)  # on by default
    default.runner.capture_graphs(1, default.max_model_len, use_graphs=False)
    assert default.runner.graphs.suffix_sizes == [1, 2, 4]  # up to one request's most rows
    off = make_engine(tiny_ckpt, page_size=16, max_num_seqs=4, kernels=KernelConfig(absorbed_suffix=False))
    off.runner.capture_graphs(1, off.max_model_len, use_graphs=False)
    assert off.runner.graphs.suffix_sizes == []
    eng = make_engine(tiny_ckpt, page_size=16, max_num_seqs=4, kernels=ON)
    eng.runner.capture_graphs(3, eng.max_model_len, use_graphs=False)  # a verify of 3 tokens a request
    assert eng.runner.graphs.suffix_sizes == []
    det = make_engine(tiny_ckpt, page_size=16, max_num_seqs=4, deterministic=True, kernels=ON)
    det.runner.capture_graphs(1, det.max_model_len, use_graphs=False)
    assert det.runner.graphs.suffix_sizes == []
    step = [SeqChunk([1] * 4, 40, list(range(4)))]
    assert det.runner.graphs.key_for([], step, suffix=True)[0] == "context"
