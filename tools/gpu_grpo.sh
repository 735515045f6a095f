#!/usr/bin/env bash
# examples/grpo_gpu.py on one GPU, both modes in one device call: the tiny-model learning run, then the
# real-size (Qwen2.5-0.5B shape) memory run with its no-sleep probe.
#
# On the GPU host, from the repo root, after `source tools/gpu/install_on_device.sh || exit 1`:
#     bash tools/gpu_grpo.sh OUTDIR
# GRPO_DRYRUN=1 runs the same with the CPU engine standing in for SGLang (tiny sizes; not GPU results).
# Then, if GRPO_TOOLTEST_MIN (110) seconds of GRPO_BUDGET (540, counted from this script's start) are left,
# the tool-runtime GPU test (tests/gpu/test_runtime_tool_gpu.py::test_runtime_steps_with_tool_loop_on_sglang:
# the shipped tiny tool model on SGLang under Runtime, 3 steps; its mean reward per step is what the
# CPU engine's run of the same test is compared with) into gpu_tool_runtime.json.
# Limits (seconds): GRPO_TINY_LIMIT (290), GRPO_REAL_LIMIT (230), each cut to what is left of the budget;
# GRPO_TINY_ARGS / GRPO_REAL_ARGS: more flags for each run (e.g. "--steps 40"). Each run saves its JSON
# after every step and stops its SGLang server on SIGTERM, so a run cut short keeps what it measured and
# frees the GPU for the next.
# Expected on an H200: tiny ~230 s cold (server start ~60-85 s + ~80 s JIT compile without a JIT
# cache, held-out evals, 30 steps of ~2 s; ~150 s with the cache), real ~130 s (server start, 6 steps,
# probe), tool test ~100 s: 6-8 minutes, plus ~20-30 s of install before this script.
#
# OUTDIR receives (<= 8 files): grpo_gpu_tiny.{json,png}, grpo_gpu_real.{json,png}, grpo_gpu.log
# (environment + every run's output), grpo_gpu_server_logs.txt (SGLang logs without per-batch lines),
# gpu_tool_runtime.json and, when no .gpu-out/jitcache.tgz was restored, a fresh jitcache.tgz (< 16 MB).
set -u
OUTDIR=${1:?usage: bash tools/gpu_grpo.sh OUTDIR}
mkdir -p "$OUTDIR"
OUTDIR=$(cd "$OUTDIR" && pwd)
cd "$(dirname "$0")/.."
REPO=$(pwd)
LOG="$OUTDIR/grpo_gpu.log"
T0=$(date +%s)
BUDGET=${GRPO_BUDGET:-540}
left() { echo $(( BUDGET - $(date +%s) + T0 )); }
say() { echo "=== $* +$(( $(date +%s) - T0 ))s" | tee -a "$LOG"; }
export PYTHONPATH="$REPO/src${PYTHONPATH:+:$PYTHONPATH}"
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 TOKENIZERS_PARALLELISM=false MPLBACKEND=Agg
ENGINE=sglang
[ "${GRPO_DRYRUN:-0}" = 1 ] && ENGINE=cpu
{
  echo "command: bash tools/gpu_grpo.sh OUTDIR (engine $ENGINE)"; date -u; git -C "$REPO" rev-parse HEAD 2>/dev/null
  nvidia-smi --query-gpu=name,memory.used,memory.total,driver_version --format=csv,noheader 2>&1; nproc; free -g | head -2
} > "$LOG" 2>&1
WORK=${GRPO_WORK:-/tmp/agentloop_grpo}
rm -rf "$WORK"; mkdir -p "$WORK"

leftovers() {  # GPU processes still alive (WHEN: after a run, or before the first): this session's, kill them
  command -v nvidia-smi >/dev/null || return 0
  local pids; pids=$(nvidia-smi --query-compute-apps=pid,used_memory --format=csv,noheader 2>/dev/null | tr -d ' ')
  [ -z "$pids" ] && return 0
  say "GPU processes left ${1:-after the run}: $(echo $pids) (killing them)"
  for p in $pids; do kill -KILL "${p%%,*}" 2>/dev/null; done; sleep 3
}
# A server a cut-short earlier call left behind (SGLang runs in its own session, so a killed command does
# not take it along) would hold GPU memory through every figure of this run (seen on the H200: ~45 GiB).
# The lent machine runs one call at a time, so whatever is on the GPU now is such a leftover.
[ "${GRPO_KEEP_GPU_PROCS:-0}" = 1 ] || leftovers "from an earlier call, before the first run"

run_mode() {  # MODE LIMIT EXTRA_ARGS
  local mode=$1 limit=$2 extra=$3
  [ "$limit" -gt "$(left)" ] && limit=$(left)
  [ "$limit" -lt 60 ] && { say "skip --mode $mode (${limit}s left)"; return; }
  say "grpo_gpu --mode $mode (limit ${limit}s)"
  mkdir -p "$WORK/tmp_$mode"  # SGLang's server log lands there (sglang_<port>.log)
  TMPDIR="$WORK/tmp_$mode" timeout -k 20 "$limit" python3 examples/grpo_gpu.py --mode "$mode" --engine "$ENGINE" \
    --out "$OUTDIR" --work "$WORK/$mode" $extra 2>&1 | grep --line-buffered -v "Loading weights\|Writing model" \
    | cut -c1-400 | tee -a "$LOG"
  say "grpo_gpu --mode $mode rc=${PIPESTATUS[0]}"
  leftovers
}

run_mode tiny "${GRPO_TINY_LIMIT:-290}" "${GRPO_TINY_ARGS:-}"
run_mode real "${GRPO_REAL_LIMIT:-230}" "${GRPO_REAL_ARGS:-}"

if [ "$(left)" -ge "${GRPO_TOOLTEST_MIN:-110}" ]; then
  say "tool-runtime test (limit $(left)s)"
  [ "$ENGINE" = cpu ] && export AGENTLOOP_GPU_DRYRUN=1
  mkdir -p "$WORK/tmp_tooltest"
  AGENTLOOP_GPU_OUT="$WORK/tmp_tooltest" AGENTLOOP_GPU_RESULTS="$OUTDIR/gpu_tool_runtime.json" \
  AGENTLOOP_GPU_COMMAND="pytest tests/gpu/test_runtime_tool_gpu.py -k test_runtime_steps_with_tool_loop_on_sglang" \
    timeout -k 20 "$(left)" python3 -m pytest tests/gpu/test_runtime_tool_gpu.py -m gpu -q -p no:cacheprovider \
    -k test_runtime_steps_with_tool_loop_on_sglang 2>&1 | tail -15 | cut -c1-300 | tee -a "$LOG"
  python3 - "$OUTDIR/gpu_tool_runtime.json" <<'PY' 2>&1 | tee -a "$LOG"
import json, sys
r = json.load(open(sys.argv[1]))["tests"].get("test_runtime_steps_with_tool_loop_on_sglang", {})
print("tool test:", r.get("outcome"), "mean_reward per step:", [s.get("mean_reward") for s in r.get("steps", [])],
      "tool calls:", [s.get("tool_calls") for s in r.get("steps", [])])
PY
  leftovers
else
  say "skip the tool-runtime test ($(left)s left)"
fi

for f in "$WORK"/tmp_*/sglang_*.log "$WORK"/tmp_tooltest/*.log; do
  [ -f "$f" ] || continue
  echo "===== $f ($(wc -c < "$f") bytes)"; grep -v "Decode batch\|Prefill batch" "$f" | tail -c 300000
  echo "----- last per-batch lines"; grep "Decode batch\|Prefill batch" "$f" | tail -20
done > "$OUTDIR/grpo_gpu_server_logs.txt" 2>/dev/null
[ -s "$OUTDIR/grpo_gpu_server_logs.txt" ] || rm -f "$OUTDIR/grpo_gpu_server_logs.txt"
if [ "$ENGINE" = sglang ] && [ ! -f "$REPO/.gpu-out/jitcache.tgz" ] && [ -d /tmp/jitcache ]; then
  ( cd / && tar -czf "$OUTDIR/jitcache.tgz" tmp/jitcache 2>/dev/null )
  SZ=$(stat -c %s "$OUTDIR/jitcache.tgz" 2>/dev/null || echo 0)
  say "jitcache.tgz $((SZ / 1024)) KiB"
  [ "$SZ" -gt 16000000 ] && rm -f "$OUTDIR/jitcache.tgz"
fi
say "done"
ls -la "$OUTDIR" | tee -a "$LOG"
