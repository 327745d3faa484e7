#!/usr/bin/env bash
# Speculative decoding's speed at a set acceptance through the server (issue #27): the seed's protocol
# (docs/benchmarking.md: 8 prompts, IN in, OUTLEN out, concurrency 8, seed 20260724, greedy, no warm-ups) on a plain
# server, then on EAGLE3 servers (random draft, K = STEPS draft tokens) with --speculative-simulate-acceptance A for
# each A in ACC (benchmark only: each draft position accepted with probability A whatever the target computes, so
# the acceptance holds at 8k-16k contexts, where a REPLAY of recorded outputs does not; the texts are then not the
# model's). Output tokens per second against plain's. M1 shapes (random weights in place), one GPU. Under $OUT.
#   bash benchmarks/spec_speed_serve.sh                    # ACC="0 0.7 1" STEPS=1
#   STEPS=3 ACC="0.7 1" PLAIN_FROM=DIR bash benchmarks/spec_speed_serve.sh   # an earlier run's plain.json
#   REPEAT=1 ACC=0 bash benchmarks/spec_speed_serve.sh   # each EAGLE3 server runs the protocol twice; `bench compare`
#   REPEAT=1 ACC=off ...                                  # "off": no simulated acceptance (the random draft's own)
# REPEAT at acceptance 0 (every draft rejected, so the texts are the target's greedy ones): texts, event vectors,
# event total and acceptance proxy must be identical between the two runs (issue #27). At other rates the second run
# draws other acceptances (the generator goes on), so its texts differ by design.
ACC=${ACC:-"0 0.7 1"}; STEPS=${STEPS:-1}; REPEAT=${REPEAT:-0}
source benchmarks/serve_lib.sh
m1_dummy draft
serve() {  # $1: label; the rest: extra serve flags
  start_server "$1" /tmp/m1-dummy --load-format dummy --max-model-len $(( IN + OUTLEN + 64 )) --no-prefix-caching \
    --generation-config vllm "${@:2}"
}
if [[ -n "$PLAIN_FROM" ]]; then
  cp "$PLAIN_FROM/plain.json" "$OUT/" || exit 1
else
  serve plain || exit 1
  bench_protocol m1-plain "$OUT/plain.json"
  stop_server
fi
for a in $ACC; do
  sim=(--speculative-simulate-acceptance $a); [[ "$a" == off ]] && sim=()
  serve "sim$a-k$STEPS" --speculative-algorithm EAGLE3 --speculative-draft-model-path /tmp/m1-dummy-draft \
    --speculative-num-steps $STEPS --speculative-num-draft-tokens $(( STEPS + 1 )) "${sim[@]}" || continue
  bench_protocol "m1-eagle3-k$STEPS-sim$a" "$OUT/sim$a-k$STEPS.json"
  if [[ "$REPEAT" == 1 ]]; then
    bench_protocol "m1-eagle3-k$STEPS-sim$a-run2" "$OUT/sim$a-k$STEPS-run2.json"
    python3 -m mlaserve bench compare --baseline "$OUT/sim$a-k$STEPS.json" --candidate "$OUT/sim$a-k$STEPS-run2.json" \
      2>&1 | tail -8
  fi
  stop_server
done
python3 - "$OUT/plain.json" $(for a in $ACC; do echo "$OUT/sim$a-k$STEPS.json"; done) <<'PY'
import json, os, sys
plain = json.load(open(sys.argv[1]))
print(f"plain: median TPOT {plain['median_tpot_ms']:.2f} ms, {plain['output_throughput']:.0f} output tok/s")
for p in sys.argv[2:]:
    if not os.path.exists(p):
        print(f"{p}: no result"); continue
    r = json.load(open(p))
    a = r.get("speculative", {}).get("simulate_acceptance")
    print(f"EAGLE3 K={r['speculative']['num_steps']}, simulated acceptance {a} (measured per position "
          f"{r.get('acceptance_per_position')}): median TPOT {r['median_tpot_ms']:.2f} ms, "
          f"{r['output_throughput']:.0f} tok/s, x{r['output_throughput'] / plain['output_throughput']:.3f} plain")
PY
el "done"
