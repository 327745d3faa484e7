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
#   MODEL=DIR DRAFT=DIR bash benchmarks/spec_agreement.sh  # a checkpoint of your own (loaded from disk)
#   PLAIN_FROM=DIR MISS=0 bash benchmarks/spec_agreement.sh  # reuse an earlier run's plain results and recording
#                                                           # (DIR/{default,det}-plain.json, -replay.jsonl)
MISS=${MISS:-"0.3 0"}
source benchmarks/serve_lib.sh
if [[ -z "$MODEL" ]]; then
  m1_dummy draft
  MODEL=/tmp/m1-dummy DRAFT=/tmp/m1-dummy-draft load=(--load-format dummy)
fi
det=(); tag=default
[[ -n "$DET" ]] && det=(--deterministic-inference) && tag=det
serve() {  # $1: label; the rest: extra serve flags
  start_server "$1" "$MODEL" "${load[@]}" "${det[@]}" --max-model-len $(( IN + OUTLEN + 64 )) \
    --no-prefix-caching --generation-config vllm "${@:2}"  # greedy as asked: no penalty from the model's defaults
}
if [[ -n "$PLAIN_FROM" ]]; then  # an earlier run's plain results and recording (the protocol is deterministic)
  cp "$PLAIN_FROM/$tag-plain.json" "$PLAIN_FROM/$tag-replay.jsonl" "$OUT/" || exit 1
else
  serve plain || exit 1
  bench_protocol "m1-$tag-plain" "$OUT/$tag-plain.json" --save-replay "$OUT/$tag-replay.jsonl"
  stop_server
fi
probe() {  # the plain server's top-2 logprobs at each first differing position of $1's run (a prefill of the common
  # prefix: the decode row that chose the token had these inputs)
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
  serve "replay$miss" --speculative-algorithm REPLAY --speculative-draft-model-path "$DRAFT" \
    --speculative-num-steps 1 --speculative-num-draft-tokens 2 --speculative-replay-path "$OUT/$tag-replay.jsonl" \
    --speculative-replay-miss-rate $miss || continue
  bench_protocol "m1-$tag-replay$miss" "$OUT/$tag-replay$miss.json"
  stop_server
done
differ() {  # 0 when some REPLAY run's texts differ from the plain run's
  python3 - "$OUT/$tag-plain.json" $(for m in $MISS; do echo "$OUT/$tag-replay$m.json"; done) <<'PY'
import json, os, sys
ids = lambda p: [r["output_token_ids"] for r in sorted(json.load(open(p))["requests"], key=lambda r: r["index"])]
plain = ids(sys.argv[1])
sys.exit(0 if any(os.path.exists(p) and ids(p) != plain for p in sys.argv[2:]) else 1)
PY
}
if differ; then
  serve plain-probe || exit 1  # logprobs are refused with speculation: the gaps come from a plain server
  for miss in $MISS; do probe "replay$miss"; done
  stop_server
else
  for miss in $MISS; do probe "replay$miss"; done  # all identical: no gap to ask for
fi
el "done"
