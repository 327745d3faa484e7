"""Serving benchmark (docs/benchmarking.md): `bench serve` (streaming client) and `bench compare` (A/B + identity)."""
