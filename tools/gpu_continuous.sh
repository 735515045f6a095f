#!/usr/bin/env bash
# Issue 27's H200 measurements in one device call, most important first, under a time budget.
#
# On the GPU host, from the repo root (carry: [".whl", ".gpu-out"], see docs/gpu.md):
#     source tools/gpu/install_on_device.sh || exit 1; bash tools/gpu_continuous.sh "$OUT"
# One SGLang server (Qwen2.5-0.5B shape, --load-format dummy, memory saver, decode CUDA graphs up to
# batch CONT_MAX_BS=256, --mem-fraction-static 0.5: the issue's server) serves, in this order (CONT_PARTS,
# default "continuous long_tail"; continuous leaves long_tail its CONT_LT_LIMIT when both are wanted):
#   1. continuous  benchmarks/continuous.py --gpu-scale: per_step vs over_admission vs streaming vs
#                  bare_refill, 10 steps of 64 groups x 4 (the issue's step of 256), the same workload; 2 s tools first at
#                  768 / 1536 in flight, then 0.5 s; per_step gets CONT_PER_STEP_LIMIT (120 s),
#                  every other run CONT_RUN_LIMIT (60 s); runs the budget cannot fit are skipped
#                  and listed in the JSON ("skipped")
#   2. long_tail   benchmarks/long_tail.py at the issue's scale: 64 groups x 4 per step, --oversample 3
#                  (768 in flight), 3 steps each way, 4 turns, 256-token prompts, lognormal(64, sigma 1)
#                  turns up to 1024, 32-token tool results, exponential 2 s tools capped at 3 s
#                  (stop_tail_s per step; returned tokens/s of over-sampling vs wait-all)
# CONT_BUDGET (default 540 s) counts from this script's start: with ~30 s of install before it the call
# stays under 9.5 minutes; with both parts: at 2 s tools per_step (~100 s) + the 3 others at 768 in
# flight, then long_tail (~170 s); CONT_PARTS=continuous gives continuous the whole budget.
# CONT_SERVER_ARGS adds flags to the server's command, e.g. "--enable-priority-scheduling --max-running-requests 256"
# (with CONT_LT_ARGS="--ways wait_all oversample oversample_priority": SGLang's priority scheduling).
# CONT_LT_ARGS / CONT_ARGS add arguments (explicit flags win over --gpu-scale's), e.g. a second call for what the first skipped:
#   CONT_PARTS=continuous CONT_ARGS="--modes over_admission streaming bare_refill --active 1536 256"
# CONT_DRYRUN=1: the CPU engine (agentloop serve, a small random Qwen2) stands in for SGLang at --smoke
# sizes: proves the script end to end; not GPU results.
#
# OUTDIR receives: gpu_continuous.log (environment, budget, both benchmarks' output), server_info.json,
# long_tail_sglang.{json,png}, continuous_sglang.{json,png}, sglang_server_log.txt (without per-batch
# lines) and, when no .gpu-out/jitcache.tgz was restored, jitcache.tgz.
set -u
OUTDIR=${1:?usage: bash tools/gpu_continuous.sh OUTDIR}
mkdir -p "$OUTDIR"
OUTDIR=$(cd "$OUTDIR" && pwd)
cd "$(dirname "$0")/.."
REPO=$(pwd)
LOG="$OUTDIR/gpu_continuous.log"
T0=$(date +%s)
BUDGET=${CONT_BUDGET:-540}
DRYRUN=${CONT_DRYRUN:-0}
MAX_BS=${CONT_MAX_BS:-256}
PARTS=" ${CONT_PARTS:-continuous long_tail} "
want() { [[ "$PARTS" == *" $1 "* ]]; }
now() { echo $(( $(date +%s) - T0 )); }
left() { echo $(( BUDGET - $(now) )); }
say() { echo "=== $* +$(now)s (left $(left)s)" | tee -a "$LOG"; }
export PYTHONPATH="$REPO/src${PYTHONPATH:+:$PYTHONPATH}"
source "$REPO/tools/gpu/server_lib.sh"
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 TOKENIZERS_PARALLELISM=false MPLBACKEND=Agg
WORK=${CONT_WORK:-/tmp/agentloop_continuous}
rm -rf "$WORK"; mkdir -p "$WORK"
{
  echo "command: bash tools/gpu_continuous.sh OUTDIR (dryrun=$DRYRUN, budget ${BUDGET}s, parts:$PARTS)"
  date -u; git -C "$REPO" rev-parse HEAD 2>/dev/null
  nvidia-smi --query-gpu=name,memory.used,memory.total,driver_version --format=csv,noheader 2>&1; nproc; free -g | head -2
} > "$LOG" 2>&1
cat "$LOG"

if [ "$DRYRUN" = 1 ]; then
  LT_SIZE="--smoke"; CONT_SIZE="--smoke"; LT_LIMIT=200; CONT_LIMIT=400
else
  LT_SIZE="--target-groups 64 --group-size 4 --oversample 3 --steps 3 --turns 4 --prompt-tokens 256 --gen-median 64
    --gen-sigma 1.0 --traj-sigma 0 --gen-max 1024 --tool-result-median 32 --tool-latency-dist exponential
    --tool-latency-mean 2 --tool-latency-cap 3"
  CONT_SIZE="--gpu-scale --per-step-limit ${CONT_PER_STEP_LIMIT:-120} --run-limit ${CONT_RUN_LIMIT:-60}"
  LT_LIMIT=${CONT_LT_LIMIT:-170}; CONT_LIMIT=100000
fi

# A server a cut-short earlier call left behind would hold GPU memory and compute through every figure.
if [ "${CONT_KEEP_GPU_PROCS:-0}" != 1 ] && command -v nvidia-smi >/dev/null; then
  LEFT=$(nvidia-smi --query-compute-apps=pid,used_memory --format=csv,noheader 2>/dev/null | tr -d ' ')
  if [ -n "$LEFT" ]; then
    say "GPU processes from an earlier call: $(echo $LEFT) (killing them)"
    for p in $LEFT; do kill -KILL "${p%%,*}" 2>/dev/null; done; sleep 3
  fi
fi

SERVER_LOG="$WORK/sglang.log"
start_server() {
  local model="$WORK/model" port argv ready
  port=$(python3 -c "from agentloop.engine.launch import free_port; print(free_port())")
  if [ "$DRYRUN" = 1 ]; then
    python3 -c "from agentloop.models.random_model import make_random_model; make_random_model('$model', hidden_size=64, num_layers=2)" >/dev/null 2>&1
    argv="python3 -m agentloop.cli serve --model $model --port $port --num-threads 1 --max-running-requests 256 ${CONT_SERVER_ARGS:-}"
    ready="serving on"
  else
    argv=$(python3 -c "
import shlex
from agentloop.engine.launch import QWEN2_05B_CONFIG, SGLangLaunchConfig, write_dummy_model
folder = write_dummy_model('$model', QWEN2_05B_CONFIG)
print(shlex.join(SGLangLaunchConfig(model_path=str(folder), load_format='dummy', mem_fraction_static=0.5,
                                    cuda_graph=True, cuda_graph_max_bs=$MAX_BS,
                                    extra_args=shlex.split('${CONT_SERVER_ARGS:-}')).argv($port)))") || return 1
    ready=$(python3 -c "from agentloop.engine.launch import READY_LINE; print(READY_LINE)")
  fi
  URL="http://127.0.0.1:$port"
  say "server: $argv"
  if ! serve_start "$argv" "$ready" "$SERVER_LOG" "$URL" "$(left)"; then
    say "server not ready"; grep -v "Decode batch\|Prefill batch" "$SERVER_LOG" | tail -40 | tee -a "$LOG"; return 1
  fi
  say "server ready at $URL"
  # what `per_server_concurrency: auto` reads: the decode CUDA graph batch this server resolved
  python3 - "$URL" "$OUTDIR/server_info.json" <<'PY' 2>&1 | tee -a "$LOG"
import json, sys, urllib.request
info = json.load(urllib.request.urlopen(sys.argv[1] + "/server_info", timeout=30))
json.dump(info, open(sys.argv[2], "w"), indent=1, default=str)
keys = ("cuda_graph_config", "cuda_graph_max_bs", "cuda_graph_max_bs_decode", "cuda_graph_bs", "disable_cuda_graph",
        "max_running_requests", "max_total_num_tokens", "enable_priority_scheduling", "schedule_low_priority_values_first",
        "priority_scheduling_preemption_threshold", "disable_priority_preemption")
print("server_info:", json.dumps({k: info.get(k) for k in keys if k in info}, default=str)[:2000])
PY
}
stop_server() { serve_stop; }
trap stop_server EXIT

run_part() {  # NAME LIMIT BENCHMARK ARGS...: benchmarks/BENCHMARK.py against the server, under min(LIMIT, time left)
  local name=$1 limit=$2 bench=$3; shift 3
  local l; l=$(left); [ "$limit" -gt "$l" ] && limit=$l
  if [ "$limit" -lt 30 ]; then say "skip $name (only ${l}s left)"; return 1; fi
  say "$name (limit ${limit}s)"
  # The DRYRUN's engine is the CPU one; the result files are named after --engine either way.
  local engine=sglang; [ "$DRYRUN" = 1 ] && engine=cpu
  timeout -k 10 "$limit" python3 "benchmarks/$bench.py" --engine $engine --engine-url "$URL" --out "$OUTDIR" "$@" 2>&1 \
    | grep --line-buffered -v "Loading weights\|Writing model" | cut -c1-300 >> "$LOG"
  local rc=${PIPESTATUS[0]}
  say "$name rc=$rc"; tail -6 "$LOG" | grep -v "^===" | cut -c1-200
}

start_server || { tail -30 "$LOG"; exit 1; }
if want continuous; then
  # the benchmark skips (and lists) the runs that would end past the budget: its deadline is what is left,
  # less long_tail's share when that part is wanted too
  share=0; want long_tail && share=$LT_LIMIT
  # shellcheck disable=SC2086  # the size strings are word lists on purpose
  run_part continuous "$CONT_LIMIT" continuous $CONT_SIZE --deadline $(( $(left) - share - 15 )) ${CONT_ARGS:-}
fi
# shellcheck disable=SC2086
want long_tail && run_part long_tail "$LT_LIMIT" long_tail $LT_SIZE ${CONT_LT_ARGS:-}
stop_server
grep -v "Decode batch\|Prefill batch" "$SERVER_LOG" 2>/dev/null | tail -c 200000 > "$OUTDIR/sglang_server_log.txt"
if [ "$DRYRUN" != 1 ] && [ ! -f "$REPO/.gpu-out/jitcache.tgz" ] && [ -d /tmp/jitcache ]; then
  ( cd / && tar -czf "$OUTDIR/jitcache.tgz" tmp/jitcache 2>/dev/null )
  [ "$(stat -c %s "$OUTDIR/jitcache.tgz" 2>/dev/null || echo 0)" -gt 16000000 ] && rm -f "$OUTDIR/jitcache.tgz"
fi
say "done"
ls -la "$OUTDIR" | tee -a "$LOG"
