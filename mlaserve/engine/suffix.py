"""A prefix hit's short suffix in MLA's absorbed form: each chunk of at most SUFFIX_MAX_TOKENS new tokens over cached
context runs as decode rows of SUFFIX_Q tokens (its real tokens last, padding rows first in its first row).

The naive (prefill) form gathers the request's whole cached latent and up-projects it (kv_b_proj, [C, H x (N + V)])
in every layer, then attends per head: its cost grows with the context whatever the suffix. The absorbed form
reads the latent cache in place, as decode does (mla_decode: token j of a block sees seq_len - q_len + j
positions), so a short suffix costs about a decode step of SUFFIX_Q tokens a row. A chunk of n tokens takes
ceil(n / SUFFIX_Q) rows, each a decode request of its own over the same pages, its length ending at its last token:
a later row sees the earlier rows' tokens, whose KV the layer's store wrote before its attention. Only a chunk's last
row asks for logits.

Taken by plain decoding's steps of suffix chunks, alone or beside decode rows (runner.split_keys: the decode graph,
then the suffix graph), where every chunk asks for its last row's logits, has cached context, and its first row
sees a position (cached + new >= its rows x SUFFIX_Q), in SUFFIX_BATCH_SIZES[-1] rows at most. Padding rows store
no KV (slot -1) and their outputs are never read. On the GPU such steps replay a suffix CUDA graph per padded row
count (engine/cuda_graph.py); eagerly the same rows run, planned as that graph (ForwardBatch.plan_decode_reqs). Not
in the deterministic mode, whose prefill keeps one path. MLASERVE_ABSORBED_SUFFIX=0 (KernelConfig.absorbed_suffix)
turns it off.
"""

from __future__ import annotations

from ..attention.base import SeqChunk

SUFFIX_Q = 32  # tokens a suffix row holds: kernels/mla_decode.MAX_Q_LEN (a test holds them equal)
SUFFIX_BATCH_SIZES = (1, 2, 4, 8)  # the suffix graphs' rows; steps of more take the prefill path
SUFFIX_MAX_TOKENS = 4 * SUFFIX_Q  # a chunk's new tokens; longer ones take the context graph (docs/performance.md)


def suffix_on(kernels) -> bool:
    """Whether a KernelConfig lets steps take suffix rows: opted in, and not the deterministic mode."""
    return kernels.absorbed_suffix and not kernels.deterministic


def suffix_rows(prefill: list[SeqChunk]) -> list[SeqChunk] | None:
    """The step's chunks as suffix rows of SUFFIX_Q tokens, each chunk's in order, or None where the step does not
    qualify (module docstring)."""
    if not prefill:
        return None
    rows = []
    for c in prefill:
        n = len(c.token_ids)
        k = -(-n // SUFFIX_Q)  # rows
        pad = k * SUFFIX_Q - n  # the padding rows sit at the request's positions before its suffix (slots -1)
        if not 1 <= n <= SUFFIX_MAX_TOKENS or c.num_cached == 0 or c.num_cached < pad or c.need_logits != "last":
            return None
        ids = [0] * pad + list(c.token_ids)
        start = c.num_cached - pad
        for j in range(k):
            last = j == k - 1
            rows.append(
                SeqChunk(
                    ids[j * SUFFIX_Q : (j + 1) * SUFFIX_Q],
                    start + j * SUFFIX_Q,
                    c.pages,
                    "last" if last else "none",
                    pad=pad if j == 0 else 0,
                )
            )
        if len(rows) > SUFFIX_BATCH_SIZES[-1]:
            return None
    return rows


def last_rows(rows: list[SeqChunk]) -> list[int]:
    """Each chunk's last row, the one whose logits it asked for, among the suffix rows."""
    return [i for i, r in enumerate(rows) if r.need_logits == "last"]


def suffix_batch_size(n_rows: int) -> int:
    """The suffix graph (rows) a step of n_rows suffix rows pads to."""
    return next(b for b in SUFFIX_BATCH_SIZES if b >= n_rows)
