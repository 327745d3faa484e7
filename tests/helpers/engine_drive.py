"""Driving an engine through a scripted workload (arrivals and aborts at given step calls), and the workload of
requests that end inside a step: shared by the overlap and speculative-step tests."""

from __future__ import annotations

from mlaserve.types import SamplingParams


def drive(engine, arrivals: dict, aborts: dict) -> dict:
    """arrivals: {call: [(key, prompt, params)]}; aborts: {call: [key]} -> {key: events}."""
    ids, events, call = {}, {}, 0
    while engine.has_unfinished() or call <= max(arrivals):
        for key, prompt, params in arrivals.get(call, []):
            ids[key] = engine.add_request(prompt, params)
        for key in aborts.get(call, []):
            engine.abort_request(ids[key])
        for o in engine.step():
            key = next(k for k, r in ids.items() if r == o.request_id)
            events.setdefault(key, []).append(o)
        call += 1
    return events


def drive_checked(model: str, spec, arrivals: dict, eos: int, **cfg) -> tuple[dict, object]:
    """An engine of `model` on the CPU (spec: a SpecConfig, its greedy step graph run eagerly; or None) whose "eos" is
    token `eos`, driven through `arrivals` with the request "aborted" aborted at call 8; no KV page may leak.
    -> (drive's events, the engine)."""
    from mlaserve.config import EngineConfig
    from mlaserve.engine.engine import LLMEngine

    eng = LLMEngine(EngineConfig(model=model, device="cpu", **cfg), spec=spec)
    if spec is not None:
        eng.runner.capture_graphs(spec.num_steps + 1, eng.max_model_len, use_graphs=False)
        eng.capture_spec_step_graphs(use_graphs=False)
    eng.eos_token_ids = frozenset({eos})
    events = drive(eng, arrivals, {8: ["aborted"]})
    eng.pool.check()
    assert eng.pool.num_free == eng.pool.num_pages
    return events, eng


def summary(evs) -> tuple:
    """A request's events -> (tokens, text, finished, finish_reason, stop_reason, completion tokens)."""
    e = evs[-1]
    toks = [t for x in evs for t in x.new_token_ids]
    return toks, "".join(x.new_text for x in evs), e.finished, e.finish_reason, e.stop_reason, e.usage.completion_tokens


def assert_same_events(plain: dict, other: dict, label: str) -> None:
    """Every request's events in `other` are the plain engine's (summary), except the aborted one's, which may have
    more tokens (a step of several tokens lands the abort later in its output) but agrees where both have them."""
    for key in plain:
        a, b = summary(plain[key]), summary(other[key])
        if key == "aborted":
            assert a[0][: len(b[0])] == b[0][: len(a[0])] and not a[2] and not b[2]
            continue
        assert a == b, f"{key}: plain {a} vs {label} {b}"


def stop_string_in(text: str) -> str | None:
    """A printable 2-character piece from the second half of a greedy output: a stop string it is sure to meet."""
    return next(
        (
            text[i : i + 2]
            for i in range(len(text) // 2, len(text) - 2)
            if text[i : i + 2].strip() and "\ufffd" not in text[i : i + 2]
        ),
        None,
    )


def ending_mid_step(prompts: list, g0: list[int], max_tokens: int, greedy: SamplingParams) -> dict:
    """Arrivals whose requests end by length, stop token and EOS, with late arrivals at calls 3 and 5 (g0: the plain
    greedy output of prompts[0]). The caller adds its stop-string request and aborts."""
    g = dict(temperature=0, ignore_eos=True)
    return {
        0: [
            ("len", prompts[0], SamplingParams(max_tokens=7, **g)),
            ("stop_tok", prompts[0], SamplingParams(max_tokens=max_tokens, stop_token_ids=[g0[6]], **g)),
            ("eos", prompts[1], SamplingParams(temperature=0, max_tokens=max_tokens)),
            ("full", prompts[2], SamplingParams(max_tokens=max_tokens, **g)),
        ],
        3: [("late", prompts[3], SamplingParams(max_tokens=9, **g))],
        5: [("aborted", prompts[4], SamplingParams(max_tokens=max_tokens, **g)), ("late2", prompts[5], greedy)],
    }


def drafts_by_length(engine, prompts, params) -> tuple[list[list[int]], dict]:
    """Drive `engine` step by step over prompts -> (each request's output tokens, every running request's drafts
    after each step keyed by (its index, its length then): free of step timing, so engines that step differently
    compare)."""
    log = {}
    rids = [engine.add_request(p, params) for p in prompts]
    out = {r: [] for r in rids}
    while engine.has_unfinished():
        for o in engine.step():
            out[o.request_id] += o.new_token_ids
        for r in engine.scheduler.running:
            if r.request_id in engine.states:
                log.setdefault((rids.index(r.request_id), r.num_tokens), list(engine.states[r.request_id].drafts))
    return [out[r] for r in rids], log
