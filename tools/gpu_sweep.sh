#!/usr/bin/env bash
# The GPU benchmark sweep of issue 16 in one device call, most important parts first, under a time budget.
#
# On the GPU host, from the repo root, after `source tools/gpu/install_on_device.sh || exit 1`:
#     bash tools/gpu_sweep.sh OUTDIR
# One SGLang server (Qwen2.5-0.5B shape, --load-format dummy, memory saver, decode CUDA graphs up to
# batch SWEEP_MAX_BS=256, i.e. sized to the largest concurrency) serves, in this order:
#   1. lifecycle          benchmarks/lifecycle.py (wake-up/sleep vs raw calls, staged vs one-stage memory)
#   2. weights            benchmarks/weight_update.py (CUDA IPC: agentloop's one request, raw one request,
#                         buckets of 256 MB / 1 GB, SGLang's flattened_bucket; GB/s; per-request cost)
#   3. throughput points  benchmarks/rollout_throughput.py, one process per (concurrency, mean tool latency)
#                         point of SWEEP_POINTS (default below: the c=256 / 0.5 s operating point first);
#                         a point may name its modes and repeats (default 1; the modes' order rotates per
#                         repeat): "256:0.5:ceiling,agentloop,agentloop_depth_first:3" (default
#                         SWEEP_MODES: ceiling agentloop agentloop_gc_freeze turn_sync multiturn_raw),
#                         1024 trajectories x 3 turns, heavy-tailed turn lengths, lognormal tool latency
#                         (sigma 1); ceiling, agentloop and turn-sync each; client CPU-seconds per 1k tokens;
#                         SGLang's own "Decode batch" / "Prefill batch" log lines of each point's window are
#                         summarised next to the client's figures (tools/gpu_sweep_report.py)
#   4. long_tail          (after the first three points) over-sampling vs wait-for-all
#   5. 7b_throughput, 7b  only if SWEEP_7B_MIN (230) seconds are left: the 0.5B server is stopped, a Qwen2.5-7B-
#                         shaped dummy server started (--mem-fraction-static SWEEP_7B_MEM=0.45; decode CUDA graphs
#                         when 7b_throughput is asked for); 7b_throughput runs SWEEP_7B_POINTS (default
#                         "256:0.5:ceiling,agentloop,multiturn_raw") into rollout_throughput_sweep_sglang_7b.json,
#                         7b runs weight_update on it
# Every part runs under `timeout` with min(its limit, what is left of SWEEP_BUDGET); a part that cannot get
# SWEEP_MIN_PART (35) seconds is skipped and listed. SWEEP_BUDGET (default 520 s) counts from this
# script's start: with ~20-30 s of install before it, the call stays under 9.5 minutes.
#
# SWEEP_LONGTAIL_ARGS / SWEEP_LONGTAIL_LIMIT replace the long_tail part's sizes / time limit (default 90 s), e.g.
# the stop-tail check of issue 27 (768 in flight, 2 s tools; see benchmarks/README.md, "Stop tail").
# SWEEP_PARTS (default "lifecycle weights throughput long_tail 7b") picks parts, e.g. a second call for the points
# the budget left out: SWEEP_PARTS="throughput 7b" SWEEP_POINTS="128:2 64:2 128:0.05 64:0.05".
# SWEEP_DRYRUN=1: the CPU engine (agentloop serve, a small random Qwen2) stands in for SGLang, every part
# at --smoke-like sizes: proves the script end to end; not GPU results.
#
# OUTDIR receives: gpu_sweep.log (environment, budget, every part's output), sweep_results.tgz (every JSON and
# PNG: lifecycle_sglang, weight_update_sglang, weight_update_7b_sglang, long_tail_sglang,
# rollout_throughput_sweep_sglang (all points merged, with SGLang's log figures) and each point's own JSON),
# sglang_server_logs.txt (without per-batch lines) and, when no .gpu-out/jitcache.tgz was restored,
# jitcache.tgz.
set -u
OUTDIR=${1:?usage: bash tools/gpu_sweep.sh OUTDIR}
mkdir -p "$OUTDIR"
OUTDIR=$(cd "$OUTDIR" && pwd)
cd "$(dirname "$0")/.."
REPO=$(pwd)
LOG="$OUTDIR/gpu_sweep.log"
T0=$(date +%s)
BUDGET=${SWEEP_BUDGET:-520}
MIN_PART=${SWEEP_MIN_PART:-35}
DRYRUN=${SWEEP_DRYRUN:-0}
POINTS=${SWEEP_POINTS:-"256:0.5 64:0.5 128:0.5 256:0.05 256:2 128:2 128:0.05 64:0.05 64:2"}
MAX_BS=${SWEEP_MAX_BS:-256}
PARTS=" ${SWEEP_PARTS:-lifecycle weights throughput long_tail 7b} "
want() { [[ "$PARTS" == *" $1 "* ]]; }
now() { echo $(( $(date +%s) - T0 )); }
left() { echo $(( BUDGET - $(now) )); }
say() { echo "=== $* +$(now)s (left $(left)s)" | tee -a "$LOG"; }
export PYTHONPATH="$REPO/src${PYTHONPATH:+:$PYTHONPATH}"
source "$REPO/tools/gpu/server_lib.sh"
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 TOKENIZERS_PARALLELISM=false MPLBACKEND=Agg
WORK=${SWEEP_WORK:-/tmp/agentloop_sweep}
rm -rf "$WORK"; mkdir -p "$WORK/results" "$WORK/points"
RES="$WORK/results"
{
  echo "command: bash tools/gpu_sweep.sh OUTDIR (dryrun=$DRYRUN, budget ${BUDGET}s, parts:$PARTS points: $POINTS)"
  date -u; git -C "$REPO" rev-parse HEAD 2>/dev/null
  nvidia-smi --query-gpu=name,memory.used,memory.total,driver_version --format=csv,noheader 2>&1; nproc; free -g | head -2
  echo "time budget (estimates on an H200 with the JIT cache restored): server start + CUDA graph capture ~100 s,"
  echo "  lifecycle ~30 s, weights ~25 s, throughput c=256 ~45 s, c=128 ~60 s, c=64 ~100 s per point (tool 2 s: +40 s),"
  echo "  long_tail ~50 s, 7b server + weights ~200 s; parts run in this order until the budget is spent."
} > "$LOG" 2>&1
cat "$LOG"

if [ "$DRYRUN" = 1 ]; then
  SIZE_TP="--trajectories 24 --turns 2 --prompt-tokens 16 --gen-median 4 --gen-max 16 --tool-result-median 4"
  SIZE_LC="--repeats 2 --memory-repeats 1 --requests 4 --tokens 4"
  SIZE_LT="--smoke"
  SIZE_WU="--smoke"
else
  SIZE_TP="--trajectories 1024 --turns 3 --prompt-tokens 256 --gen-median 24 --gen-sigma 0.8 --traj-sigma 0.6 --gen-max 1024 --tool-result-median 48"
  SIZE_LC="--repeats 10 --memory-repeats 2 --requests 16 --tokens 32"
  SIZE_LT=${SWEEP_LONGTAIL_ARGS:-"--target-groups 8 --group-size 4 --oversample 1.5 --steps 3 --turns 2 --prompt-tokens 128 --gen-median 48 --gen-sigma 0.4 --traj-sigma 1.0 --gen-max 768 --tool-latency-mean 0.05 --tool-result-median 32"}
  SIZE_WU="--repeats 3 --bucket-mb 256 1024"
fi

# A server a cut-short earlier call left behind (SGLang runs in its own session, so a killed command does not
# take it along) would hold GPU memory and compute through every figure here (seen on the H200: ~45 GiB). The
# lent machine runs one call at a time, so whatever is on the GPU now is such a leftover (SWEEP_KEEP_GPU_PROCS=1: keep).
if [ "${SWEEP_KEEP_GPU_PROCS:-0}" != 1 ] && command -v nvidia-smi >/dev/null; then
  LEFT=$(nvidia-smi --query-compute-apps=pid,used_memory --format=csv,noheader 2>/dev/null | tr -d ' ')
  if [ -n "$LEFT" ]; then
    say "GPU processes from an earlier call: $(echo $LEFT) (killing them)"
    for p in $LEFT; do kill -KILL "${p%%,*}" 2>/dev/null; done; sleep 3
  fi
fi

SERVER_LOG=
start_server() {  # NAME CONFIG_PY MEM_FRACTION CUDA_GRAPH
  local name=$1 cfg=$2 mem=$3 cg=$4
  local model="$WORK/model_$name" port
  port=$(python3 -c "from agentloop.engine.launch import free_port; print(free_port())")
  SERVER_LOG="$WORK/sglang_$name.log"
  local argv ready
  if [ "$DRYRUN" = 1 ]; then
    python3 -c "from agentloop.models.random_model import make_random_model; make_random_model('$model', hidden_size=64, num_layers=2)" >/dev/null 2>&1
    argv="python3 -m agentloop.cli serve --model $model --port $port --num-threads 1 --max-running-requests 256"
    ready="serving on"
  else
    argv=$(python3 -c "
import shlex
from agentloop.engine.launch import SGLangLaunchConfig, write_dummy_model
$cfg
folder = write_dummy_model('$model', CONFIG)
print(shlex.join(SGLangLaunchConfig(model_path=str(folder), load_format='dummy', mem_fraction_static=$mem,
                                    cuda_graph=$cg, cuda_graph_max_bs=$MAX_BS).argv($port)))") || return 1
    ready=$(python3 -c "from agentloop.engine.launch import READY_LINE; print(READY_LINE)")
  fi
  URL="http://127.0.0.1:$port"
  say "server $name: $argv"
  if ! serve_start "$argv" "$ready" "$SERVER_LOG" "$URL" "$(left)"; then
    say "server $name not ready"; grep -v "Decode batch\|Prefill batch" "$SERVER_LOG" | tail -40 | tee -a "$LOG"; return 1
  fi
  say "server $name ready at $URL"
}
stop_server() { serve_stop; }
trap stop_server EXIT

SKIPPED=()
run_part() {  # NAME LIMIT BENCHMARK ARGS...: benchmarks/BENCHMARK.py against the server, under min(LIMIT, time left)
  local name=$1 limit=$2 bench=$3; shift 3
  local l; l=$(left); [ "$limit" -gt "$l" ] && limit=$l
  if [ "$limit" -lt "$MIN_PART" ]; then SKIPPED+=("$name"); say "skip $name (only ${l}s left)"; return 1; fi
  say "$name (limit ${limit}s)"
  local off0; off0=$(stat -c %s "$SERVER_LOG" 2>/dev/null || echo 0)
  timeout -k 10 "$limit" python3 "benchmarks/$bench.py" --engine sglang --engine-url "$URL" "$@" 2>&1 | grep --line-buffered -v "Loading weights\|Writing model" | cut -c1-300 >> "$LOG"
  local rc=${PIPESTATUS[0]}
  echo "$name $off0 $(stat -c %s "$SERVER_LOG" 2>/dev/null || echo 0) $rc" >> "$WORK/windows.txt"
  say "$name rc=$rc"; tail -4 "$LOG" | grep -v "^===" | cut -c1-200
  kill -0 "$SERVER" 2>/dev/null || { say "the server died"; return 2; }
}

QWEN05="from agentloop.engine.launch import QWEN2_05B_CONFIG as CONFIG"
if want lifecycle || want weights || want throughput || want long_tail; then
start_server 05b "$QWEN05" "${SWEEP_MEM:-0.5}" True || { tail -30 "$LOG"; exit 1; }
want lifecycle && run_part lifecycle 75 lifecycle --out "$RES" $SIZE_LC
want weights && run_part weights 60 weight_update --out "$RES" $SIZE_WU
run_points() {  # POINTS_DIR SUFFIX LONG_TAIL(0|1) POINT...: throughput points against $URL, then the merged report
  local dir=$1 suffix=$2 lt=$3; shift 3
  local n=0 pt c lat pmodes preps limit
  mkdir -p "$dir"
  for pt in "$@"; do
    IFS=: read -r c lat pmodes preps <<< "$pt"
    pmodes=${pmodes:-${SWEEP_MODES:-ceiling agentloop agentloop_gc_freeze turn_sync multiturn_raw}}
    preps=${preps:-1}
    [ "$DRYRUN" = 1 ] && c=$(( c / 32 ))  # 8/2/4: the CPU engine's scale
    limit=${SWEEP_POINT_LIMIT:-220}  # a point cut short keeps nothing (one JSON per point, written at its end)
    run_part "throughput${suffix}_c${c}_l${lat}" $limit rollout_throughput --out "$dir/c${c}_l${lat}" $SIZE_TP \
      --tool-latency-dist lognormal --tool-latency-means "$lat" --concurrency "$c" --repeats "$preps" --modes ${pmodes//,/ } \
      --server-log "$SERVER_LOG"
    [ $? = 2 ] && break
    n=$((n + 1))
    [ $n = 3 ] && [ "$lt" = 1 ] && run_part long_tail "${SWEEP_LONGTAIL_LIMIT:-90}" long_tail --out "$RES" $SIZE_LT
  done
  [ $n -lt 3 ] && [ "$lt" = 1 ] && run_part long_tail "${SWEEP_LONGTAIL_LIMIT:-90}" long_tail --out "$RES" $SIZE_LT
  if [ $# -gt 0 ]; then
    python3 tools/gpu_sweep_report.py --points "$dir" --windows "$WORK/windows.txt" --server-log "$SERVER_LOG" \
      --out "$RES" --suffix "$suffix" 2>&1 | tee -a "$LOG" | tail -12 || say "sweep report failed"
  fi
}
want throughput || POINTS=""
LT=0; want long_tail && LT=1
run_points "$WORK/points" "" $LT $POINTS
stop_server
fi

POINTS_7B=${SWEEP_7B_POINTS:-"256:0.5:ceiling,agentloop,multiturn_raw"}
if ! want 7b && ! want 7b_throughput; then
  :
elif [ "$(left)" -ge "${SWEEP_7B_MIN:-230}" ]; then
  QWEN7="CONFIG = {'architectures': ['Qwen2ForCausalLM'], 'model_type': 'qwen2', 'hidden_size': 3584, 'intermediate_size': 18944,
  'num_hidden_layers': 28, 'num_attention_heads': 28, 'num_key_value_heads': 4, 'vocab_size': 152064,
  'max_position_embeddings': 32768, 'rms_norm_eps': 1e-6, 'rope_theta': 1000000.0, 'hidden_act': 'silu',
  'torch_dtype': 'bfloat16', 'tie_word_embeddings': False, 'bos_token_id': 151643, 'eos_token_id': 151643,
  'use_sliding_window': False, 'sliding_window': 131072, 'max_window_layers': 28, 'attention_dropout': 0.0,
  'initializer_range': 0.02, 'use_cache': True}"
  # decode CUDA graphs only when the 7B server serves throughput points (capture costs start-up time)
  CG7=False; want 7b_throughput && CG7=True
  if start_server 7b "$QWEN7" "${SWEEP_7B_MEM:-0.45}" $CG7; then
    want 7b_throughput && run_points "$WORK/points7b" _7b 0 $POINTS_7B
    if want 7b; then
      mkdir -p "$WORK/w7b"
      run_part weights_7b $(( $(left) - 15 )) weight_update --out "$WORK/w7b" --repeats 2 --bucket-mb 1024
      cp "$WORK/w7b/weight_update_sglang.json" "$RES/weight_update_7b_sglang.json" 2>/dev/null
      cp "$WORK/w7b/weight_update_sglang.png" "$RES/weight_update_7b_sglang.png" 2>/dev/null
    fi
  fi
  stop_server
else
  SKIPPED+=("7b"); say "skip 7b (needs ${SWEEP_7B_MIN:-230}s)"
fi

say "skipped: ${SKIPPED[*]:-none}"
for d in "$WORK"/points/*/ "$WORK"/points7b/*/; do
  [ -d "$d" ] || continue
  tag=$(basename "$d"); [[ "$d" == */points7b/* ]] && tag="7b_$tag"
  for f in "$d"*.json; do [ -f "$f" ] && cp "$f" "$RES/point_${tag}_$(basename "$f")"; done
done
tar -czf "$OUTDIR/sweep_results.tgz" -C "$RES" . 2>/dev/null
for f in "$WORK"/sglang_*.log; do
  [ -f "$f" ] || continue
  echo "===== $f ($(wc -c < "$f") bytes)"; grep -v "Decode batch\|Prefill batch" "$f" | tail -c 250000
done > "$OUTDIR/sglang_server_logs.txt" 2>/dev/null
if [ "$DRYRUN" != 1 ] && [ ! -f "$REPO/.gpu-out/jitcache.tgz" ] && [ -d /tmp/jitcache ]; then
  ( cd / && tar -czf "$OUTDIR/jitcache.tgz" tmp/jitcache 2>/dev/null )
  [ "$(stat -c %s "$OUTDIR/jitcache.tgz" 2>/dev/null || echo 0)" -gt 16000000 ] && rm -f "$OUTDIR/jitcache.tgz"
fi
say "done"
tar -tzf "$OUTDIR/sweep_results.tgz" | tee -a "$LOG"
ls -la "$OUTDIR" | tee -a "$LOG"
