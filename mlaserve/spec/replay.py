"""The REPLAY draft, for benchmarks only: it proposes the target's own greedy continuation, recorded by an earlier
plain run, so that the speed of speculative decoding is measured at a known acceptance rate on real shapes.

Each draft position is a deliberate miss with probability `replay_miss_rate`: the proposed token is then the
recorded one plus one (mod vocab), never the target's. The choice is a hash of (seed, prompt, output index), so a
rerun, or any batching of the same requests, misses at the same places. A request without a recording, or whose
output has left it (the target no longer reproduces it), gets the EAGLE3 draft's tokens when one runs, else its last
token repeated; those proposals are counted in `unrecorded_tokens`. With a draft model the EAGLE3 draft runs each
step as it would (its forward, graphs and host copies) and only its tokens are replaced: the verify and the draft
cost what an EAGLE3 step costs.

The recording: one JSON object a line, {"prompt_token_ids": [...], "output_token_ids": [...]}
(`mlaserve bench serve --save-replay FILE` writes it from a plain greedy run).
"""

from __future__ import annotations

import hashlib
import json
import logging
from dataclasses import dataclass

import numpy as np

from ..types import Request

log = logging.getLogger("mlaserve.spec")

_M64 = (1 << 64) - 1


def _mix(x: int) -> int:
    """splitmix64's finalizer: a well-spread 64-bit hash of a 64-bit integer."""
    x = (x + 0x9E3779B97F4A7C15) & _M64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _M64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _M64
    return x ^ (x >> 31)


def prompt_key(prompt_token_ids: list[int]) -> int:
    digest = hashlib.blake2b(np.asarray(prompt_token_ids, dtype=np.int64).tobytes(), digest_size=8).digest()
    return int.from_bytes(digest, "little")


def is_miss(seed: int, key: int, index: int, rate: float) -> bool:
    """Whether output index `index` of the prompt with `key` is a deliberate miss (uniform in [0, 1) < rate)."""
    return _mix(_mix(_mix(seed & _M64) ^ key) ^ index) / 2.0**64 < rate


def write_recordings(path: str, records) -> int:
    """records: (prompt ids, output ids) pairs -> a jsonl file; returns how many were written."""
    n = 0
    with open(path, "w") as f:
        for prompt, output in records:
            f.write(json.dumps({"prompt_token_ids": list(prompt), "output_token_ids": list(output)}) + "\n")
            n += 1
    return n


def read_recordings(path: str) -> dict[tuple[int, ...], list[int]]:
    out = {}
    with open(path) as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                r = json.loads(line)
                out[tuple(r["prompt_token_ids"])] = [int(t) for t in r["output_token_ids"]]
            except (ValueError, KeyError, TypeError) as e:
                raise ValueError(
                    f"speculative_config.replay_path: {path} line {n} is not "
                    '{"prompt_token_ids": [...], "output_token_ids": [...]}'
                ) from e
    if not out:
        raise ValueError(f"speculative_config.replay_path: {path} holds no recording")
    return out


@dataclass
class _Track:
    req: Request
    key: int
    recorded: list[int] | None  # None: no recording, or the output has left it
    checked: int = 0  # output tokens compared with the recording so far


class ReplayProposer:
    benchmark_only = True

    def __init__(self, spec, runner, inner=None):
        self.k = spec.num_steps
        self.rate, self.seed = float(spec.replay_miss_rate), spec.replay_seed
        self.vocab = runner.model_cfg.vocab_size
        self.recordings = read_recordings(spec.replay_path)
        self.inner = inner  # an Eagle3Proposer whose forward runs (and whose tokens are replaced), or None
        self.tracks: dict[str, _Track] = {}
        self.proposed_tokens = self.unrecorded_tokens = 0
        log.warning(
            "speculative decoding with the REPLAY draft (benchmark only): proposing %d recorded greedy outputs from "
            "%s, each position a deliberate miss with probability %.3f (seed %d)%s",
            len(self.recordings),
            spec.replay_path,
            self.rate,
            self.seed,
            " after the EAGLE3 draft's forward" if inner is not None else "; no draft model runs",
        )

    def capture_graphs(self, max_bs: int, max_pages: int, use_graphs: bool = True) -> None:
        if self.inner is not None:
            self.inner.capture_graphs(max_bs, max_pages, use_graphs)

    def _track(self, req: Request) -> _Track:
        t = self.tracks.get(req.request_id)
        if t is None or t.req is not req:
            if len(self.tracks) > 1024:  # forget finished requests
                self.tracks = {k: v for k, v in self.tracks.items() if not v.req.finished}
            rec = self.recordings.get(tuple(req.prompt_token_ids))
            t = self.tracks[req.request_id] = _Track(req, prompt_key(req.prompt_token_ids), rec)
        out = req.output_token_ids
        if t.recorded is not None:
            rec = t.recorded
            if len(out) > len(rec) or out[t.checked :] != rec[t.checked : len(out)]:
                t.recorded = None  # the target left the recording (or outgrew it): nothing more to replay
        t.checked = len(out)
        return t

    def tokens(self, req: Request, fallback: list[int] | None) -> list[int]:
        """The K draft tokens for output indexes n .. n+K-1 (n: the output tokens so far)."""
        t = self._track(req)
        n, out = len(req.output_token_ids), []
        for i in range(self.k):
            j = n + i
            if t.recorded is not None and j < len(t.recorded):
                tok = t.recorded[j]
                out.append((tok + 1) % self.vocab if is_miss(self.seed, t.key, j, self.rate) else tok)
            else:
                self.unrecorded_tokens += 1
                last = req.output_token_ids[-1] if req.output_token_ids else req.prompt_token_ids[-1]
                out.append(fallback[i] if fallback is not None else last)
        self.proposed_tokens += self.k
        return out

    def propose_verified(self, y, acc, hidden, reqs, starts=None, shift=None):
        """The device step after a decode-only verify (Eagle3Proposer.propose_verified): the draft model's drafts
        [B, K] when one runs, or nothing to draft ([B, 0]); the replayed tokens are chosen once the step is read back
        (verified_drafts). None: the draft model's static step does not fit."""
        if self.inner is None:
            return y.new_empty((y.shape[0], 0))
        return self.inner.propose_verified(y, acc, hidden, reqs, starts, shift)

    def verified_drafts(self, req: Request, drafts: list[int]) -> list[int]:
        """The drafts after a device step, once the step's tokens are appended: the recording's, the draft model's
        (`drafts`) as the fallback."""
        return self.tokens(req, drafts or None)

    def propose(self, chunks) -> dict[str, list[int]]:
        base = self.inner.propose(chunks) if self.inner is not None else {}
        return {c.req.request_id: self.tokens(c.req, base.get(c.req.request_id)) for c in chunks if c.propose}
