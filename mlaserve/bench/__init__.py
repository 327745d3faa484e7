"""Serving benchmark: `bench serve` (streaming client, BENCHMARK.md protocol) and `bench compare` (A/B + identity)."""
