#!/usr/bin/env bash
# One GPU run of agentloop against real SGLang: install, run tests/gpu, run extra commands, collect.
#
# On the GPU host, from the repo root, with .whl/ staged (see docs/gpu.md;
# .gpu-out/jitcache.tgz from an earlier run is restored by install_on_device.sh when present):
#     bash tools/gpu_run.sh OUTDIR [EXTRA_COMMAND ...]
# Each EXTRA_COMMAND is one shell command string run after the tests with the same environment, e.g.
#     bash tools/gpu_run.sh "$OUT" "python3 benchmarks/lifecycle.py --engine sglang --engine-url \$AGENTLOOP_BENCH_URL --out \$GPU_RUN_OUT"
# Before the extra commands one SGLang server (Qwen2.5-0.5B shape, --load-format dummy, memory saver;
# `python -m agentloop.engine.launch --dummy`) is started once and its URL exported as
# $AGENTLOOP_BENCH_URL, so benchmarks attach instead of each paying the start-up; it is stopped at
# the end (GPU_BENCH_SERVER=0: none; GPU_BENCH_ARGS: more launch flags, e.g. "--cuda-graph").
# Extra commands write their result files into $GPU_RUN_OUT (a scratch folder); it comes back as
# OUTDIR/extra_results.tgz (the device tool returns at most 8 files).
#
# OUTDIR receives at most 8 files (the device tool brings back no more): env.txt, gpu_results.json
# (every measurement of tests/gpu, with versions, GPU and this command), pytest.log, extra.log,
# extra_results.tgz, sglang_logs.txt (tails of every SGLang server log), jitcache.tgz (when under 8 MB).
# Time limits (seconds): GPU_TEST_LIMIT (420) for pytest, GPU_EXTRA_LIMIT (150) per extra command.
set -u
OUTDIR=${1:?usage: bash tools/gpu_run.sh OUTDIR [EXTRA_COMMAND ...]}
shift
mkdir -p "$OUTDIR"
OUTDIR=$(cd "$OUTDIR" && pwd)
cd "$(dirname "$0")/.."
REPO=$(pwd)
T0=$(date +%s)
since() { echo "+$(( $(date +%s) - T0 ))s"; }

{
  echo "command: bash tools/gpu_run.sh $OUTDIR $*"
  date -u
  nvidia-smi --query-gpu=name,memory.used,memory.total,driver_version --format=csv,noheader
  nproc; free -g | head -2
} > "$OUTDIR/env.txt" 2>&1

source tools/gpu/install_on_device.sh >> "$OUTDIR/env.txt" 2>&1 || { cat "$OUTDIR/env.txt"; echo "install failed"; exit 1; }
echo "installed $(since)"; tail -1 "$OUTDIR/env.txt"
# agentloop from this checkout, no install needed; keep NVLink multicast off (shared host rule)
export PYTHONPATH="$REPO/src${PYTHONPATH:+:$PYTHONPATH}"
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
export AGENTLOOP_GPU_OUT=${AGENTLOOP_GPU_OUT:-/tmp/agentloop_gpu}
export AGENTLOOP_GPU_RESULTS="$OUTDIR/gpu_results.json"
export AGENTLOOP_GPU_COMMAND="bash tools/gpu_run.sh OUTDIR $*"
export GPU_RUN_OUT=/tmp/gpu_run_extra
mkdir -p "$AGENTLOOP_GPU_OUT" "$GPU_RUN_OUT"

# Own process group with a hard limit: a hung server must not eat the whole device call.
run_limited() {
  local limit=$1; shift
  setsid bash -c "$*" & local pid=$!
  ( sleep "$limit"; echo "!!! time limit ${limit}s: killing group $pid"; kill -TERM -- -"$pid" 2>/dev/null
    sleep 10; kill -KILL -- -"$pid" 2>/dev/null ) & local watcher=$!
  wait "$pid"; local rc=$?
  kill "$watcher" 2>/dev/null; wait "$watcher" 2>/dev/null
  kill -KILL -- -"$pid" 2>/dev/null  # leftovers of that group only (SGLang schedulers)
  return $rc
}

echo "=== pytest tests/gpu $(since)"
run_limited "${GPU_TEST_LIMIT:-420}" \
  "python3 -m pytest tests/gpu -m gpu -v -rA -p no:cacheprovider --timeout 400 ${GPU_PYTEST_ARGS:-} > '$OUTDIR/pytest.log' 2>&1"
echo "pytest rc=$? $(since)"
sed -n '/short test summary info/,$p' "$OUTDIR/pytest.log" | cut -c1-300 | tail -30

: > "$OUTDIR/extra.log"
BENCH_PID=
if [ $# -gt 0 ] && [ "${GPU_BENCH_SERVER:-1}" = 1 ]; then
  echo "=== benchmark server $(since)" | tee -a "$OUTDIR/extra.log"
  rm -f /tmp/bench_url
  setsid python3 -m agentloop.engine.launch --dummy /tmp/bench_model --mem-fraction "${GPU_BENCH_MEM:-0.5}" \
      --log "$AGENTLOOP_GPU_OUT/sglang_bench_server.log" --ready-file /tmp/bench_url ${GPU_BENCH_ARGS:-} \
      >> "$OUTDIR/extra.log" 2>&1 & BENCH_PID=$!
  for _ in $(seq 1 300); do [ -s /tmp/bench_url ] && break; kill -0 $BENCH_PID 2>/dev/null || break; sleep 1; done
  export AGENTLOOP_BENCH_URL=$(cat /tmp/bench_url 2>/dev/null)
  echo "AGENTLOOP_BENCH_URL=${AGENTLOOP_BENCH_URL:-<failed>} $(since)" | tee -a "$OUTDIR/extra.log"
fi
for cmd in "$@"; do
  echo "=== extra: $cmd $(since)" | tee -a "$OUTDIR/extra.log"
  run_limited "${GPU_EXTRA_LIMIT:-150}" "$cmd >> '$OUTDIR/extra.log' 2>&1"
  echo "extra rc=$? $(since)" | tee -a "$OUTDIR/extra.log"
done
if [ -n "$BENCH_PID" ]; then
  kill -TERM "$BENCH_PID" 2>/dev/null; for _ in $(seq 1 30); do kill -0 "$BENCH_PID" 2>/dev/null || break; sleep 1; done
  kill -KILL -- -"$BENCH_PID" 2>/dev/null
fi
[ -s "$OUTDIR/extra.log" ] || rm -f "$OUTDIR/extra.log"
[ -n "$(ls -A "$GPU_RUN_OUT")" ] && tar -czf "$OUTDIR/extra_results.tgz" -C "$GPU_RUN_OUT" .

# server logs: the tail of each, one file (the device tool returns at most 8 files)
for f in "$AGENTLOOP_GPU_OUT"/*.log; do
  [ -f "$f" ] || continue
  echo "===== $f ($(wc -c < "$f") bytes)"; grep -v "Decode batch\|Prefill batch" "$f" | tail -c 400000
done > "$OUTDIR/sglang_logs.txt" 2>/dev/null
[ -s "$OUTDIR/sglang_logs.txt" ] || rm -f "$OUTDIR/sglang_logs.txt"

( cd / && tar -czf "$OUTDIR/jitcache.tgz" tmp/jitcache 2>/dev/null )
SZ=$(stat -c %s "$OUTDIR/jitcache.tgz" 2>/dev/null || echo 0)
[ "$SZ" -gt 8000000 ] && rm -f "$OUTDIR/jitcache.tgz"
echo "jitcache.tgz $((SZ/1024)) KiB; done $(since)"
ls -la "$OUTDIR"
