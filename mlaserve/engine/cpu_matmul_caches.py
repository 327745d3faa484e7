"""Bounded caches for the CPU's bf16 matmuls.

On the CPU a bf16 F.linear runs through oneDNN (ideep's matmul_forward), which compiles a primitive for each shape
(M, N, K) and keeps it in two LRU caches of 1,024 entries: ideep's, one per thread (LRU_CACHE_CAPACITY), and
oneDNN's, one per process (ONEDNN_PRIMITIVE_CACHE_CAPACITY). A served batch has a new token count M at almost every
step (and the reference MoE a new M per expert), so both caches fill over minutes of traffic and the heap grows by
hundreds of MB before it stops: what a soak reads as a leak (docs/experiments.md, Measurement, has the figures).
Entries enough for the recurring decode shapes keep the hits and bound the growth.

Both capacities are read once, at the first bf16 matmul (ideep's per thread, oneDNN's per process): bound them
before it. A value already in the environment wins.
"""

from __future__ import annotations

import os

MATMUL_CACHE_ENTRIES = 256  # per cache: a model's dozen linear shapes (N, K) x the decode batch sizes, and prefill's
CACHE_VARIABLES = ("LRU_CACHE_CAPACITY", "ONEDNN_PRIMITIVE_CACHE_CAPACITY")


def bound_matmul_caches(entries: int = MATMUL_CACHE_ENTRIES) -> dict[str, str]:
    """Set both capacities to `entries` unless the environment sets them -> the values in force."""
    return {name: os.environ.setdefault(name, str(entries)) for name in CACHE_VARIABLES}
