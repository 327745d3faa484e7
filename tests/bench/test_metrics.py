"""The benchmark maths against hand-computed values, including the seed's acceptance-proxy figure."""

import math

import pytest

from mlaserve.bench.metrics import (
    acceptance_proxy,
    counter,
    event_total,
    itls_ms,
    parse_prometheus,
    pct_improvement,
    stats,
    summarize_run,
    tpot_ms,
)


def test_seed_acceptance_proxy():
    # seeds/002: 8 requests x 8,192 output tokens, 33,016 events after each request's first
    assert acceptance_proxy(65536, 8, 33016) == pytest.approx(0.98473467, abs=5e-9)
    assert f"{acceptance_proxy(65536, 8, 33016) * 100:.6f}%" == "98.473467%"
    assert acceptance_proxy(10, 2, 0) is None


def test_seed_pct_changes():
    # the seed's medians and % changes, positive when the candidate is better
    assert pct_improvement(4405.845, 4302.860, higher_is_better=False) == pytest.approx(2.337, abs=5e-4)
    assert pct_improvement(27.375, 26.454, higher_is_better=False) == pytest.approx(3.364, abs=5e-4)
    assert pct_improvement(228633.556, 220785.828, higher_is_better=False) == pytest.approx(3.432, abs=5e-4)
    assert pct_improvement(280.960, 291.261, higher_is_better=True) == pytest.approx(3.666, abs=5e-4)
    assert pct_improvement(10.0, 11.0, higher_is_better=False) == pytest.approx(-10.0)
    assert pct_improvement(0.0, 1.0, higher_is_better=True) is None


def test_event_total_tpot_itl():
    assert event_total([[1, 2, 2, 1], [1], [], [1, 1]]) == 3 + 0 + 0 + 1
    assert tpot_ms(e2el_ms=110.0, ttft_ms=10.0, output_tokens=6) == pytest.approx(20.0)
    assert tpot_ms(50.0, 10.0, 1) is None
    assert itls_ms([10.0, 12.5, 20.0]) == pytest.approx([2.5, 7.5])
    assert itls_ms([3.0]) == []


def test_stats():
    s = stats([1.0, 2.0, 3.0, 4.0])
    assert s["mean"] == 2.5 and s["median"] == 2.5
    assert s["std"] == pytest.approx(math.sqrt(1.25))  # population std, like vLLM
    assert s["p99"] == pytest.approx(3.97)  # 1 + 0.99 * 3, linear interpolation
    assert stats([]) == {"mean": None, "median": None, "std": None, "p99": None}


def test_parse_prometheus_and_counter():
    text = """# HELP mlaserve:spec_decode_num_accepted_tokens_total Accepted.
# TYPE mlaserve:spec_decode_num_accepted_tokens_total counter
mlaserve:spec_decode_num_accepted_tokens_total{model_name="m",rank="0"} 40.0
mlaserve:spec_decode_num_accepted_tokens_total{model_name="m",rank="1"} 2.0
mlaserve:spec_decode_num_accepted_tokens_created{model_name="m"} 1.7e9
vllm:generation_tokens_total 1e3
"""
    s = parse_prometheus(text)
    assert s["mlaserve:spec_decode_num_accepted_tokens_total"] == 42.0
    assert counter(s, "spec_decode_num_accepted_tokens_total") == 42.0
    assert counter(s, "generation_tokens_total") == 1000.0
    assert counter(s, "spec_decode_num_draft_tokens_total") is None
    assert counter(None, "x") is None


def _req(index, events, times, output_tokens=None, success=True, accepted=None):
    ttft = times[0] if times else None
    e2el = times[-1] if times else None
    n = output_tokens if output_tokens is not None else sum(events)
    return {
        "index": index,
        "prompt_len": 4,
        "success": success,
        "error": None if success else "boom",
        "event_vector": events,
        "ttft_ms": ttft,
        "itl_ms": itls_ms(times),
        "e2el_ms": e2el,
        "tpot_ms": tpot_ms(e2el, ttft, n) if success else None,
        "output_tokens": n if success else 0,
        "prompt_tokens": 4,
        "cached_tokens": 0,
        "accepted_tokens": accepted,
        "rejected_tokens": None,
        "start_s": 0.0 if index == 0 else 0.1,
        "end_s": 0.1 + e2el / 1000.0 if success else 0.2,
    }


def test_summarize_run_by_hand():
    reqs = [
        _req(0, [1, 2, 2, 1], [10.0, 20.0, 30.0, 40.0], accepted=2),  # 6 tokens, tpot (40-10)/5 = 6
        _req(1, [1, 1, 2], [20.0, 30.0, 50.0], accepted=1),  # 4 tokens, tpot (50-20)/3 = 10
        _req(2, [], [], success=False),
    ]
    s = summarize_run(reqs)
    assert (s["completed"], s["failed"]) == (2, 1)
    assert s["errors"] == [{"index": 2, "error": "boom"}]
    assert s["total_output_tokens"] == 10 and s["total_input_tokens"] == 8
    assert s["event_total"] == 3 + 2
    assert s["acceptance_proxy"] == pytest.approx((10 - 2) / 5 - 1)
    assert s["accepted_tokens_proxy"] == 10 - 2 - 5
    assert s["accepted_tokens_usage"] == 3
    assert s["median_ttft_ms"] == pytest.approx(15.0)
    assert s["mean_tpot_ms"] == pytest.approx(8.0)
    assert s["median_itl_ms"] == pytest.approx(10.0)  # pooled gaps [10, 10, 10, 10, 20]
    assert s["median_e2el_ms"] == pytest.approx(45.0)
    # first send 0.0 s, last completion 0.1 + 0.05 s
    assert s["duration_s"] == pytest.approx(0.15)
    assert s["output_throughput"] == pytest.approx(10 / 0.15)
    assert s["request_throughput"] == pytest.approx(2 / 0.15)
    assert s["total_token_throughput"] == pytest.approx(18 / 0.15)


def test_counters_by_label_sum_lists_and_acceptance_by_position():
    from mlaserve.bench.metrics import acceptance_by_position, counters_by_label, sum_lists

    text = """# TYPE vllm:spec_decode_num_accepted_tokens_per_pos counter
vllm:spec_decode_num_accepted_tokens_per_pos_total{model_name="m",position="0"} 30.0
vllm:spec_decode_num_accepted_tokens_per_pos_total{model_name="m",position="1"} 12.0
vllm:spec_decode_num_accepted_tokens_per_pos_total{model_name="n",position="1"} 3.0
vllm:spec_decode_num_accepted_tokens_total{model_name="m"} 45.0
"""
    assert counters_by_label(text, "spec_decode_num_accepted_tokens_per_pos_total", "position") == {"0": 30, "1": 15}
    assert counters_by_label(text, "spec_decode_num_drafts_total", "position") == {}
    assert sum_lists([[1, 2], None, [3, 4, 5]]) == [4, 6, 5] and sum_lists([None]) is None
    a = acceptance_by_position([30, 15], 40)
    assert a == {"acceptance_per_position": [0.75, 0.375], "mean_accepted_length": 1 + 45 / 40}
    assert acceptance_by_position(None, 40)["mean_accepted_length"] is None
    assert acceptance_by_position([3], 0)["acceptance_per_position"] is None
