"""ForwardBatch.build against the per-token layout it stands for, on batches that mix short chunks (laid out by
list) and long ones (by numpy): decode rows, a prefill chunk with cached context, short prefill chunks."""

import random

import torch

from mlaserve.attention.base import ForwardBatch, SeqChunk


def _reference(chunks: list[SeqChunk], page_size: int) -> dict:
    ids, pos, slots, rows, starts = [], [], [], [], [0]
    for c in chunks:
        n, first = len(c.token_ids), len(ids)
        ids += c.token_ids
        p = list(range(c.num_cached, c.num_cached + n))
        pos += p
        slots += [c.pages[q // page_size] * page_size + q % page_size for q in p]
        if c.need_logits == "last":
            rows.append(first + n - 1)
        elif c.need_logits == "all":
            rows += range(first, first + n)
        starts.append(len(ids))
    width = max((len(c.pages) for c in chunks), default=0)
    return dict(
        input_ids=ids,
        positions=pos,
        slot_mapping=slots,
        seq_lens=[c.num_cached + len(c.token_ids) for c in chunks],
        query_start_loc=starts,
        page_table=[c.pages + [0] * (width - len(c.pages)) for c in chunks],
        logits_indices=rows,
    )


def _chunk(rng: random.Random, n: int, cached: int, page_size: int, need: str) -> SeqChunk:
    pages = rng.sample(range(1, 4000), -(-(cached + n) // page_size))
    return SeqChunk([rng.randrange(50000) for _ in range(n)], cached, pages, need)


def test_build_matches_per_token_layout():
    rng = random.Random(0)
    page_size = 16
    for q, prefill_shapes in [
        (2, [(300, 37, "last"), (5, 0, "last"), (1, 40, "none"), (90, 0, "all")]),
        (1, [(3, 7, "last"), (17, 0, "last")]),  # one past the short edge
        (1, []),
        (3, [(16, 5, "last"), (200, 1000, "last"), (2, 3, "last")]),
    ]:
        decode = [_chunk(rng, q, rng.randrange(1, 500), page_size, "all") for _ in range(rng.randrange(0, 5))]
        prefill = [_chunk(rng, n, c, page_size, need) for n, c, need in prefill_shapes]
        if not decode and not prefill:
            continue
        batch = ForwardBatch.build(decode, prefill, page_size, "cpu")
        ref = _reference(decode + prefill, page_size)
        for name, want in ref.items():
            got = getattr(batch, name)
            assert got.tolist() == want, name
        assert batch.input_ids.dtype == batch.positions.dtype == batch.slot_mapping.dtype == torch.int64
        assert batch.logits_indices.dtype == torch.int64
        assert batch.seq_lens.dtype == batch.query_start_loc.dtype == batch.page_table.dtype == torch.int32
        assert batch.seq_lens_cpu == ref["seq_lens"]
        assert batch.query_lens_cpu == [len(c.token_ids) for c in decode + prefill]
        assert batch.num_decode_reqs == len(decode) and batch.decode_q_len == (q if decode else 0)
        assert batch.context_is_new == all(c.num_cached == 0 for c in prefill)
        # every part starts on 16 bytes of its buffer (kernels specialise on pointer alignment)
        for t in (batch.positions, batch.slot_mapping, batch.logits_indices):
            assert (t.data_ptr() - batch.input_ids.data_ptr()) % 16 == 0
        for t in (batch.query_start_loc, batch.page_table):
            assert (t.data_ptr() - batch.seq_lens.data_ptr()) % 16 == 0
