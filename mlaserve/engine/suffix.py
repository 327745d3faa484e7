"""A prefix hit's short suffix in MLA's absorbed form: each chunk of at most SUFFIX_Q new tokens over cached context
runs as a decode row of SUFFIX_Q tokens (its real tokens last, padding rows first).

The naive (prefill) form gathers the request's whole cached latent and up-projects it (kv_b_proj, [C, H x (N + V)])
in every layer, then attends per head: its cost grows with the context whatever the suffix. The absorbed form
reads the latent cache in place, as decode does (mla_decode: token j of a block sees seq_len - q_len + j
positions), so a short suffix costs about a decode step of SUFFIX_Q tokens a request.

Taken only by plain decoding's steps of suffix chunks alone (no decode rows: a mixed step keeps its two graphs),
where every chunk asks for its last row's logits, has cached context, and its block's first row sees a position
(cached + new >= SUFFIX_Q). Its padding rows store no KV (slot -1) and their outputs are never read. On the GPU
such steps replay a suffix CUDA graph per padded request count (engine/cuda_graph.py); eagerly the same rows run,
planned as that graph (ForwardBatch.plan_decode_reqs). Not in the deterministic mode, whose prefill keeps one path.
MLASERVE_ABSORBED_SUFFIX=0 (KernelConfig.absorbed_suffix) turns it off.
"""

from __future__ import annotations

from ..attention.base import SeqChunk

SUFFIX_Q = 32  # tokens a suffix row holds: kernels/mla_decode.MAX_Q_LEN (a test holds them equal)
SUFFIX_BATCH_SIZES = (1, 2, 4, 8)  # the suffix graphs' requests; steps of more take the prefill path


def suffix_on(kernels) -> bool:
    """Whether a KernelConfig lets steps take suffix rows: opted in, and not the deterministic mode."""
    return kernels.absorbed_suffix and not kernels.deterministic


def suffix_rows(prefill: list[SeqChunk]) -> list[SeqChunk] | None:
    """The step's chunks as suffix rows of SUFFIX_Q tokens, or None where the step does not qualify (docstring)."""
    if not 1 <= len(prefill) <= SUFFIX_BATCH_SIZES[-1]:
        return None
    rows = []
    for c in prefill:
        n = len(c.token_ids)
        if not 1 <= n <= SUFFIX_Q or c.num_cached == 0 or c.num_cached + n < SUFFIX_Q or c.need_logits != "last":
            return None
        pad = SUFFIX_Q - n  # the padding rows sit at the request's positions before its suffix (slots -1)
        rows.append(SeqChunk([0] * pad + list(c.token_ids), c.num_cached - pad, c.pages, "last", pad=pad))
    return rows


def suffix_batch_size(n_reqs: int) -> int:
    """The suffix graph (requests) a step of n_reqs suffix rows pads to."""
    return next(b for b in SUFFIX_BATCH_SIZES if b >= n_reqs)
