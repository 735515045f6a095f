#!/usr/bin/env bash
# examples/grpo_gpu.py on one GPU, both modes in one device call: the tiny-model learning run, then the
# real-size (Qwen2.5-0.5B shape) memory run with its no-sleep probe.
#
# On the GPU host, from the repo root, after `source shared/gpu/install_on_device.sh || exit 1`:
#     bash tools/gpu_grpo.sh OUTDIR
# GRPO_DRYRUN=1 runs the same with the CPU engine standing in for SGLang (tiny sizes; not GPU results).
# Limits (seconds): GRPO_TINY_LIMIT (290), GRPO_REAL_LIMIT (230); GRPO_TINY_ARGS / GRPO_REAL_ARGS: more
# flags for each run (e.g. "--steps 40"). Each run saves its JSON after every step and stops its SGLang
# server on SIGTERM, so a run cut short keeps what it measured and frees the GPU for the next.
# Expected on an H200: tiny ~230 s cold (server start ~60-85 s + ~80 s JIT compile without a JIT
# cache, held-out eval, 30 steps of ~2 s), real ~120 s (server start, 6 steps, probe): ~6.5 min.
#
# OUTDIR receives (<= 8 files): grpo_gpu_tiny.{json,png}, grpo_gpu_real.{json,png}, grpo_gpu.log
# (environment + both runs' output), grpo_gpu_server_logs.txt (SGLang logs without per-batch lines) and,
# when no .gpu-out/jitcache.tgz was restored, a fresh jitcache.tgz (under 16 MB).
set -u
OUTDIR=${1:?usage: bash tools/gpu_grpo.sh OUTDIR}
mkdir -p "$OUTDIR"
OUTDIR=$(cd "$OUTDIR" && pwd)
cd "$(dirname "$0")/.."
REPO=$(pwd)
LOG="$OUTDIR/grpo_gpu.log"
T0=$(date +%s)
say() { echo "=== $* +$(( $(date +%s) - T0 ))s" | tee -a "$LOG"; }
export PYTHONPATH="$REPO${PYTHONPATH:+:$PYTHONPATH}"
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

leftovers() {  # GPU processes still alive after a run (its SGLang server should be stopped): ours, kill them
  command -v nvidia-smi >/dev/null || return 0
  local pids; pids=$(nvidia-smi --query-compute-apps=pid --format=csv,noheader 2>/dev/null | tr -d ' ')
  [ -z "$pids" ] && return 0
  say "GPU processes left after the run: $pids (killing them)"
  for p in $pids; do kill -KILL "$p" 2>/dev/null; done; sleep 3
}

run_mode() {  # MODE LIMIT EXTRA_ARGS
  local mode=$1 limit=$2 extra=$3
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

for f in "$WORK"/tmp_*/sglang_*.log; do
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
