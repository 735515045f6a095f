#!/usr/bin/env bash
# The three rollout benchmarks against real SGLang on one GPU: one server, three benchmark processes.
#
# On the GPU host, from the repo root, with .whl/ staged (see docs/gpu.md;
# .gpu-out/jitcache.tgz from an earlier run saves SGLang's ~80 s cold kernel compile):
#     bash tools/gpu_benchmarks.sh OUTDIR
# 1. installs sglang (tools/gpu/install_on_device.sh);
# 2. writes a Qwen2.5-0.5B-shaped config.json (tools/gpu/qwen2_dummy.py) — nothing is downloaded;
# 3. launches `sglang.launch_server --load-format dummy` with agentloop's own launch flags
#    (agentloop.engine.launch.SGLangLaunchConfig: memory saver, skip-tokenizer-init, triton attention,
#    decode CUDA graphs up to batch 64) in its own process group;
# 4. runs, each attached with --engine sglang --engine-url, each under a hard time limit:
#    lifecycle (BENCH_LIFECYCLE_LIMIT, 60 s), long_tail (BENCH_LONGTAIL_LIMIT, 90 s),
#    rollout_throughput (BENCH_THROUGHPUT_LIMIT, 180 s); every benchmark saves as it goes, so one cut
#    short still leaves what it measured;
# 5. stops the server group.
# BENCH_DRYRUN=1 runs the same script with the CPU engine standing in for SGLang (--smoke sizes, no
# install): to debug the script without GPU time; its results are not GPU results.
# Expected: ~20 s install, 60-90 s server start (+~80 s without a JIT cache), ~4 min of benchmarks
# (lifecycle ~30 s, long_tail ~50 s, rollout_throughput ~150 s): about 6 minutes in all. Worst case,
# every limit hit (server start BENCH_START_LIMIT 180 s, kill grace, server stop): just under 10 minutes.
#
# OUTDIR receives 7 files (the device tool brings back at most 8): {rollout_throughput,lifecycle,
# long_tail}_sglang.{json,png} and gpu_benchmarks.log (environment, the benchmarks' output, the tail
# of the server log).
set -u
OUTDIR=${1:?usage: bash tools/gpu_benchmarks.sh OUTDIR}
mkdir -p "$OUTDIR"
OUTDIR=$(cd "$OUTDIR" && pwd)
cd "$(dirname "$0")/.."
REPO=$(pwd)
LOG="$OUTDIR/gpu_benchmarks.log"
T0=$(date +%s)
since() { echo "+$(( $(date +%s) - T0 ))s"; }
say() { echo "=== $* $(since)" | tee -a "$LOG"; }

{
  echo "command: bash tools/gpu_benchmarks.sh $OUTDIR"
  date -u
  git -C "$REPO" rev-parse HEAD 2>/dev/null
  nvidia-smi --query-gpu=name,memory.used,memory.total,driver_version --format=csv,noheader
  nproc; free -g | head -2
} > "$LOG" 2>&1
DRYRUN=${BENCH_DRYRUN:-0}  # 1: the CPU engine on a small random model stands in for SGLang (to debug this script)
if [ "$DRYRUN" = 1 ]; then
  echo "DRY RUN: CPU engine instead of SGLang; these are not GPU results" >> "$LOG"
else
  source tools/gpu/install_on_device.sh >> "$LOG" 2>&1 || { tail -20 "$LOG"; echo "install failed"; exit 1; }
  say "installed"
fi
export PYTHONPATH="$REPO/src${PYTHONPATH:+:$PYTHONPATH}"
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 TOKENIZERS_PARALLELISM=false

WORK=${BENCH_WORK:-/tmp/agentloop_bench}
MODEL="$WORK/qwen2_05b_dummy"
SERVER_LOG="$WORK/sglang_server.log"
mkdir -p "$WORK"
PORT=$(python3 -c "from agentloop.engine.launch import free_port; print(free_port())")
if [ "$DRYRUN" = 1 ]; then
  python3 -c "from agentloop.models.random_model import make_random_model; make_random_model('$MODEL', hidden_size=64, num_layers=2)" \
    > /dev/null 2>&1 || { echo "could not write the model" | tee -a "$LOG"; exit 1; }
  ARGV="python3 -m agentloop.cli serve --model $MODEL --port $PORT --num-threads 1 --max-running-requests 256"
  READY="serving on"
else
python3 -c "import sys; sys.path.insert(0, 'tools/gpu'); from qwen2_dummy import write_model_dir; write_model_dir('$MODEL')" \
  || { echo "could not write the model config" | tee -a "$LOG"; exit 1; }
ARGV=$(python3 -c "
import shlex
from agentloop.engine.launch import SGLangLaunchConfig
cfg = SGLangLaunchConfig(model_path='$MODEL', load_format='dummy', mem_fraction_static=${BENCH_MEM_FRACTION:-0.5},
                         cuda_graph=True, cuda_graph_max_bs=64)
print(shlex.join(cfg.argv($PORT)))") || { echo "could not build the server command" | tee -a "$LOG"; exit 1; }
# Ready: SGLang logs this line after its warm-up generate (agentloop.engine.launch.READY_LINE).
READY=$(python3 -c "from agentloop.engine.launch import READY_LINE; print(READY_LINE)")
fi
URL="http://127.0.0.1:$PORT"
say "starting: $ARGV"
setsid bash -c "exec $ARGV" > "$SERVER_LOG" 2>&1 &
SERVER=$!
stop_server() {
  kill -TERM -- -"$SERVER" 2>/dev/null
  for _ in $(seq 30); do kill -0 "$SERVER" 2>/dev/null || break; sleep 1; done
  kill -KILL -- -"$SERVER" 2>/dev/null  # what is left of that group only (scheduler, detokenizer)
}
trap stop_server EXIT

for _ in $(seq "${BENCH_START_LIMIT:-180}"); do
  grep -qF "$READY" "$SERVER_LOG" 2>/dev/null && break
  kill -0 "$SERVER" 2>/dev/null || break
  sleep 1
done
if ! grep -qF "$READY" "$SERVER_LOG" 2>/dev/null; then
  say "server not ready"; grep -v "Decode batch\|Prefill batch" "$SERVER_LOG" | tail -60 >> "$LOG"; tail -30 "$LOG"; exit 1
fi
if [ "$DRYRUN" = 1 ]; then  # its log line comes just before it listens
  for _ in $(seq 60); do python3 -c "import urllib.request; urllib.request.urlopen('$URL/model_info', timeout=2)" 2>/dev/null && break; sleep 1; done
fi
say "server ready at $URL"
EXTRA=""
[ "$DRYRUN" = 1 ] && EXTRA="--smoke"  # the CPU engine cannot run the GPU sizes in minutes

run_bench() {  # NAME LIMIT ARGS...
  local name=$1 limit=$2; shift 2
  say "$name (limit ${limit}s)"
  timeout -k 10 "$limit" python3 "benchmarks/$name.py" --engine sglang --engine-url "$URL" --out "$OUTDIR" "$@" $EXTRA \
    >> "$LOG" 2>&1
  local rc=$?
  say "$name rc=$rc"
  kill -0 "$SERVER" 2>/dev/null || { say "the server died"; return 1; }
}

# lifecycle first: the engine's wake/sleep costs and memory with nothing else in flight.
run_bench lifecycle "${BENCH_LIFECYCLE_LIMIT:-60}" --repeats 10 --memory-repeats 2 --requests 16 --tokens 32 &&
run_bench long_tail "${BENCH_LONGTAIL_LIMIT:-90}" --target-groups 8 --group-size 4 --oversample 1.5 --steps 3 \
  --turns 2 --prompt-tokens 128 --gen-median 48 --gen-sigma 0.4 --traj-sigma 1.0 --gen-max 768 \
  --tool-latency-mean 0.05 --tool-result-median 32 &&
run_bench rollout_throughput "${BENCH_THROUGHPUT_LIMIT:-180}" --trajectories 96 --turns 4 --prompt-tokens 128 \
  --gen-median 48 --gen-max 512 --tool-result-median 32 --tool-latency-means 0.05 0.5 --concurrency 64 32 16 \
  --repeats 1

say "done"
{
  echo "===== server log (without per-batch lines), tail"
  grep -v "Decode batch\|Prefill batch" "$SERVER_LOG" | tail -c 200000
} >> "$LOG"
ls -la "$OUTDIR"
