#!/usr/bin/env bash
# Greedy agreement and speed of EAGLE3 against plain decode through the server (issue #27): the seed's protocol
# (docs/benchmarking.md: 8 prompts, 8,192 in, OUTLEN out, concurrency 8, seed 20260724, greedy, no warm-ups) on a
# plain server, which records its outputs (--save-replay), then on a REPLAY server per miss rate in MISS (a random
# EAGLE3 draft's forward runs each step; its tokens are replaced by the recorded ones, each position a deliberate
# miss at the rate: 0.3 is 0.7 acceptance, 0 is full). For each REPLAY run: how many texts equal the plain ones, and
# for each that differs the first differing position and the logit gap there (top-2 logprobs after the common
# prefix). M1 shapes (Moonlight-16B-A3B, random weights in place), one GPU. Results under $OUT.
#   bash benchmarks/spec_agreement.sh                      # default kernels, MISS="0.3 0"
#   DET=1 bash benchmarks/spec_agreement.sh                # both servers with --deterministic-inference
set -o pipefail
export PYTHONUNBUFFERED=1 OUT=${OUT:-out} TOKENIZERS_PARALLELISM=false PYTHONPATH=$PWD
IN=${IN:-8192}; OUTLEN=${OUTLEN:-8192}; PORT=${PORT:-8000}; MISS=${MISS:-"0.3 0"}
mkdir -p "$OUT"
source benchmarks/wheels.sh
t0=$(date +%s); el() { echo "[+$(( $(date +%s) - t0 ))s] $*"; }
python3 - <<'PY'
import json, os
from mlaserve.models.make_random import load_preset
from mlaserve.models.make_random_draft import make_random_draft
raw = load_preset("moonlight-16b-a3b"); raw.pop("_note", None)
os.makedirs("/tmp/m1-dummy", exist_ok=True); json.dump(raw, open("/tmp/m1-dummy/config.json", "w"), indent=1)
if not os.path.exists("/tmp/m1-dummy-draft/config.json"):
    make_random_draft("kimi-k2.5-eagle3", "/tmp/m1-dummy-draft", target="/tmp/m1-dummy", dtype="bfloat16")
PY
det=(); tag=default
[[ -n "$DET" ]] && det=(--deterministic-inference) && tag=det
start_server() {  # $1: label; the rest: extra serve flags
  label=$1; shift
  el "starting the server ($label)"
  setsid python3 -m mlaserve serve /tmp/m1-dummy --load-format dummy --port $PORT "${det[@]}" \
    --max-model-len $(( IN + OUTLEN + 64 )) --no-prefix-caching "$@" > "$OUT/server-$label.log" 2>&1 &
  SERVER=$!
  for i in $(seq 1 600); do
    curl -sf http://127.0.0.1:$PORT/health >/dev/null && break
    kill -0 $SERVER 2>/dev/null || { el "server died"; tail -40 "$OUT/server-$label.log"; return 1; }
    sleep 1
  done
  el "server up"
}
bench() {  # $1: label; the rest: extra bench flags
  label=$1; shift
  timeout ${BENCH_S:-400} python3 -m mlaserve bench serve --base-url http://127.0.0.1:$PORT --num-prompts 8 \
    --max-concurrency 8 --input-len $IN --output-len $OUTLEN --seed 20260724 --num-warmups 0 --temperature 0 \
    --ignore-eos --disable-tqdm --label "m1-$tag-$label" --save-result "$OUT/$tag-$label.json" "$@" 2>&1 \
    | grep -E "Successful|Failed|Median (TTFT|TPOT)|Output token throughput|Acceptance"
}
stop_server() { kill -INT $SERVER; sleep 4; kill -9 -$SERVER 2>/dev/null; }
start_server plain
bench plain --save-replay "$OUT/$tag-replay.jsonl"
stop_server
probe() {  # top-2 logprobs at each first differing position of $1's run: a 1-token request is a prefill only, the
  # same computation on any server of these kernels (asked of the REPLAY server still up)
  python3 - "$OUT/$tag-plain.json" "$OUT/$tag-$1.json" "$OUT/$tag-replay.jsonl" "$OUT/$tag-$1-agreement.json" $PORT <<'PY'
import json, sys
import httpx
plain, spec, rec, out, port = sys.argv[1:6]
a = {r["index"]: r for r in json.load(open(plain))["requests"]}
b = {r["index"]: r for r in json.load(open(spec))["requests"]}
prompts = [json.loads(l)["prompt_token_ids"] for l in open(rec)]
rows = []
for i in sorted(a):
    x, y = a[i]["output_token_ids"], b[i]["output_token_ids"]
    if x == y:
        rows.append(dict(index=i, identical=True))
        continue
    d = next((j for j, (p, q) in enumerate(zip(x, y)) if p != q), min(len(x), len(y)))
    r = httpx.post(f"http://127.0.0.1:{port}/v1/completions", timeout=120, json=dict(
        prompt=prompts[i] + x[:d], max_tokens=1, temperature=0, logprobs=2, return_tokens_as_token_ids=True))
    top = r.json()["choices"][0]["logprobs"]["top_logprobs"][0]
    lp = sorted(top.values(), reverse=True)
    rows.append(dict(index=i, identical=False, first_diff=d, plain_token=x[d], spec_token=y[d],
                     top2=top, logit_gap=lp[0] - lp[1] if len(lp) > 1 else None))
    print(f"  request {i}: first differing token {d} (plain {x[d]}, EAGLE3 {y[d]}), top-2 logprob gap {rows[-1]['logit_gap']:.4g}")
same = sum(r["identical"] for r in rows)
print(f"{sys.argv[2]}: {same} of {len(rows)} texts identical to the plain server's")
json.dump(dict(identical=same, of=len(rows), requests=rows), open(out, "w"), indent=1)
PY
}
for miss in $MISS; do
  start_server "replay$miss" --speculative-algorithm REPLAY --speculative-draft-model-path /tmp/m1-dummy-draft \
    --speculative-num-steps 1 --speculative-num-draft-tokens 2 --speculative-replay-path "$OUT/$tag-replay.jsonl" \
    --speculative-replay-miss-rate $miss || continue
  bench "replay$miss"
  probe "replay$miss"
  stop_server
done
el "done"
