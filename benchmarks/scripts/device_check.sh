#!/usr/bin/env bash
# The engine on a GPU, in one run: the engine and serving tests with every engine on
# the accelerator (EngineConfig's device "auto" takes CUDA where there is one; the tests
# size their caches with --kv-cache-memory-bytes, which a GPU honours too), then
# `zserve bench engine` and a short `zserve bench serve` against a 2 API server x 2
# engine `zserve serve` on it. Logs go to $OUT (or ./device-check).
#
# Where the packages the project needs are missing, put their wheels in .whl/ (an
# ignored folder: see the device tool's notes) and this installs them first.
# Knobs: SKIP_TESTS=1 / SKIP_BENCH=1 leave out a half; DEVICE=cpu PY=.venv/bin/python
# rehearse the benchmarks on a machine without a GPU.
set -uo pipefail
OUT=${OUT:-$PWD/device-check}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 PYTHONDONTWRITEBYTECODE=1
if ls .whl/*.whl >/dev/null 2>&1; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target /tmp/site .whl/*.whl || exit 1
    export PYTHONPATH=/tmp/site:$PWD
fi
export PYTHONPATH=${PYTHONPATH:-$PWD}
DEVICE=${DEVICE:-cuda}  # DEVICE=cpu rehearses the script here
PY=${PY:-python3}
nvidia-smi --query-gpu=name,memory.used,memory.total --format=csv 2>&1 | tee "$OUT/env.txt"
$PY -c "import torch, transformers; print('torch', torch.__version__, 'transformers',
transformers.__version__, 'cuda', torch.cuda.is_available())" 2>&1 | tee -a "$OUT/env.txt"

tests_on_device() {  # NAME LIMIT_S TEST_TIMEOUT_S FILES...: one pytest run, its log in $OUT
    local name=$1 limit=$2 per_test=$3
    shift 3
    echo "== $name tests"
    timeout "$limit" $PY -m pytest -q -p no:cacheprovider --timeout "$per_test" "$@" 2>&1 \
        | tee "$OUT/${name}_tests.log" | grep -E "passed|failed|Error|FAIL" | tail -30
}

if [ -z "${SKIP_TESTS:-}" ]; then
    tests_on_device engine 170 100 \
        tests/integration/test_engine_conformance.py tests/integration/test_engine_requests.py \
        tests/integration/test_engine_sampling.py tests/integration/test_native_forward.py \
        tests/integration/test_beam_search.py tests/integration/test_sleep_mode.py \
        tests/integration/test_lora_fidelity.py tests/integration/test_structured_output.py
    tests_on_device serving 240 120 \
        tests/e2e/test_openai_completions.py tests/e2e/test_openai_chat.py \
        tests/e2e/test_openai_streams.py tests/e2e/test_openai_sampling.py \
        tests/e2e/test_structured_outputs.py tests/e2e/test_lora_serving.py \
        tests/e2e/test_dev_routes.py tests/integration/test_topology.py
fi

[ -n "${SKIP_BENCH:-}" ] && exit 0
echo "== bench engine"
MODEL=/tmp/small-llama
$PY -m launcher.cli make-tiny-model "$MODEL" --size small >/dev/null 2>&1 || exit 1
timeout 110 $PY -m launcher.cli bench engine --model "$MODEL" --device "$DEVICE" --threads 4 \
    --batch-sizes 1,32,128 --repeats 3 --model-impls native,transformers \
    --kv-cache-memory-bytes $((1 << 30)) --json "$OUT/bench_engine.json" 2>&1 \
    | tee "$OUT/bench_engine.log" | tail -12

echo "== serve + bench serve"
PORT=18123
setsid $PY -m launcher.cli serve "$MODEL" --port $PORT --device "$DEVICE" --api-server-count 2 \
    --data-parallel-size 2 --kv-cache-memory-bytes 2GiB >"$OUT/serve.log" 2>&1 &
SERVER=$!
trap 'kill -- -$SERVER 2>/dev/null' EXIT
for _ in $(seq 60); do
    curl -sf "localhost:$PORT/v1/models" >/dev/null && break
    sleep 1
done
curl -s "localhost:$PORT/v1/completions" -H 'content-type: application/json' \
    -d '{"model":"'"$MODEL"'","prompt":"Hello","max_tokens":8,"temperature":0}' | tee "$OUT/one.json"
echo
timeout 60 $PY -m launcher.cli bench serve --base-url "http://localhost:$PORT" --model "$MODEL" \
    --num-prompts 400 --max-concurrency 64 --random-input-len 64 --random-output-len 64 \
    --ignore-eos 2>&1 | tee "$OUT/bench_serve.log" | grep -E "Successful|throughput|Median|P99"
kill -- -$SERVER 2>/dev/null
wait $SERVER 2>/dev/null
grep -E "Traceback|ERROR" "$OUT/serve.log" | head -5
echo "== done"
