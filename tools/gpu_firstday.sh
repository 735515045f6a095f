#!/usr/bin/env bash
# A GPU user's first day, measured: `agentloop rollout --engine-url` (as `python3 -m agentloop rollout`: the GPU host runs
# this checkout from PYTHONPATH, without installing it) against SGLang serving the shipped tiny
# tool model, with default settings (scheduler.concurrency: auto) and again at --concurrency 256 and at 32
# (the rollout command's old fixed default), the same data and shape each time (3 steps x 64 prompts x n 4).
# Each run's summary.json says the concurrency used and why, and how busy that kept the engine
# (engine_use: mean generate requests in flight, engine_busy_fraction = that / the server's running-batch
# cap, generate_busy_fraction); then the GPU tests of tests/gpu/test_firstday_gpu.py (the rollout command
# and the OpenAI-compatible agent on SGLang).
#
# On the GPU host, from the repo root, with .whl/ staged (docs/gpu.md):
#     bash tools/gpu_firstday.sh "$OUT"
# (device tool: run(command="bash tools/gpu_firstday.sh $OUT", carry=[".whl", ".gpu-out"], timeout_s=600)).
# FIRSTDAY_DRYRUN=1: the CPU engine (`agentloop serve`) stands in for SGLang, tiny sizes (not GPU results).
# Limits (seconds): FIRSTDAY_RUN_LIMIT (150) per rollout, FIRSTDAY_TEST_LIMIT (200) for the tests.
# Expected on an H200: install ~30 s, server start ~60-90 s (+~80 s JIT compile without .gpu-out/jitcache.tgz),
# each rollout ~10-30 s, tests ~120 s: 5-7 minutes.
#
# OUT receives (few files; the device tool brings back a handful): firstday.json (per run: the command,
# exit status, wall seconds, concurrency, engine_use, tokens/s, status and reward totals, per-step
# engine_use), firstday.log (every command and its whole output: the transcripts), firstday_default_timeline.png
# and firstday_default_training.png (the default run's pictures), gpu_firstday_tests.json (the GPU tests'
# results) and sglang_firstday_log.txt (the server log without per-batch lines).
set -u
OUT=${1:?usage: bash tools/gpu_firstday.sh OUTDIR}
mkdir -p "$OUT"
OUT=$(cd "$OUT" && pwd)
cd "$(dirname "$0")/.."
REPO=$(pwd)
LOG="$OUT/firstday.log"
T0=$(date +%s)
say() { echo "=== $* +$(( $(date +%s) - T0 ))s" | tee -a "$LOG"; }
{
  echo "command: bash tools/gpu_firstday.sh OUT"; date -u; git -C "$REPO" rev-parse HEAD 2>/dev/null
  nvidia-smi --query-gpu=name,memory.used,memory.total,driver_version --format=csv,noheader 2>&1; nproc
} > "$LOG" 2>&1
DRY=${FIRSTDAY_DRYRUN:-0}
if [ "$DRY" != 1 ]; then
  source tools/gpu/install_on_device.sh >> "$LOG" 2>&1 || { tail -20 "$LOG"; echo "install failed"; exit 1; }
fi
export PYTHONPATH="$REPO/src${PYTHONPATH:+:$PYTHONPATH}"
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 TOKENIZERS_PARALLELISM=false MPLBACKEND=Agg
WORK=${FIRSTDAY_WORK:-/tmp/agentloop_firstday}
rm -rf "$WORK"; mkdir -p "$WORK"
MODEL=$(python3 -c "from agentloop.models import tiny_tool_model; print(tiny_tool_model())")

# 192 fresh arithmetic rows: 3 steps x 64 prompts without reusing one (the bundled set has 64).
python3 - "$WORK/prompts.jsonl" <<'PY'
import json, sys
from agentloop.tasks.arithmetic import CALCULATOR_TOOL, generate_questions
with open(sys.argv[1], "w") as f:
    for i, q in enumerate(generate_questions(192, seed=4242)):
        f.write(json.dumps({"uid": f"q{i:03d}", "messages": [{"role": "user", "content": q.question}],
                            "tools": [CALCULATOR_TOOL], "agent": "tool", "reward": "arithmetic",
                            "ground_truth": q.answer}) + "\n")
PY

say "starting the engine server (tiny tool model; dry run: $DRY)"
rm -f "$WORK/url"
if [ "$DRY" = 1 ]; then
  PORT=$(python3 -c "from agentloop.engine.launch import free_port; print(free_port())")
  setsid python3 -m agentloop serve --model "$MODEL" --port "$PORT" --num-threads 1 >> "$WORK/server.log" 2>&1 & SERVER=$!
  ( for _ in $(seq 1 120); do
      python3 -c "import urllib.request; urllib.request.urlopen('http://127.0.0.1:$PORT/model_info', timeout=2)" \
        2>/dev/null && { echo "http://127.0.0.1:$PORT" > "$WORK/url"; break; }
      sleep 1; done ) &
else
  setsid python3 -m agentloop.engine.launch --model-path "$MODEL" --mem-fraction "${FIRSTDAY_MEM:-0.3}" \
      --log "$WORK/server.log" --ready-file "$WORK/url" -- --dtype bfloat16 >> "$LOG" 2>&1 & SERVER=$!
fi
for _ in $(seq 1 400); do [ -s "$WORK/url" ] && break; kill -0 $SERVER 2>/dev/null || break; sleep 1; done
URL=$(head -1 "$WORK/url" 2>/dev/null)
say "server ${URL:-<failed>}"
stop_server() {
  kill -TERM "$SERVER" 2>/dev/null
  for _ in $(seq 1 30); do kill -0 "$SERVER" 2>/dev/null || break; sleep 1; done
  kill -KILL -- -"$SERVER" 2>/dev/null
}

if [ -n "$URL" ]; then
  python3 - "$URL" <<'PY' 2>&1 | tee -a "$LOG"
import json, sys, urllib.request
info = json.load(urllib.request.urlopen(sys.argv[1] + "/server_info", timeout=30))
keep = {k: info.get(k) for k in ("version", "max_running_requests", "max_total_num_tokens", "dp_size", "context_length")}
keep["internal_states[].effective_max_running_requests_per_dp"] = [
    s.get("effective_max_running_requests_per_dp") for s in info.get("internal_states") or []]
print("server_info:", json.dumps(keep))
PY
  SIZE="--steps 3 --prompts-per-step 64 --n 4"
  [ "$DRY" = 1 ] && SIZE="--steps 2 --prompts-per-step 4 --n 2"
  for run in default c256 c32; do
    case $run in default) extra="";; c256) extra="--concurrency 256";; c32) extra="--concurrency 32";; esac
    cmd="python3 -m agentloop rollout --engine-url $URL --data $WORK/prompts.jsonl $SIZE $extra --out $WORK/$run --quiet"
    say "$cmd"
    s=$(date +%s.%N)
    timeout -k 20 "${FIRSTDAY_RUN_LIMIT:-150}" $cmd >> "$LOG" 2>&1
    echo "$run rc=$? wall=$(python3 -c "import time; print(round(time.time() - $s, 1))")" | tee -a "$LOG" > "$WORK/$run.rc"
  done
fi

python3 - "$WORK" "$OUT/firstday.json" "$URL" <<'PY' 2>&1 | tee -a "$LOG"
import json, sys
from pathlib import Path
work, out, url = Path(sys.argv[1]), Path(sys.argv[2]), sys.argv[3]
report = {"engine_url": url, "runs": {}}
for run in ("default", "c256", "c32"):
    entry = {}
    rc = work / f"{run}.rc"
    if rc.exists():
        words = dict(w.split("=", 1) for w in rc.read_text().split()[1:])
        entry["exit_status"], entry["wall_seconds"] = int(words["rc"]), float(words["wall"])
    summary = work / run / "summary.json"
    if summary.exists():
        s = json.loads(summary.read_text())
        entry.update({k: s.get(k) for k in ("concurrency", "engine_use", "tokens_per_second", "status", "reward_mean",
                                            "tool_calls", "trajectories", "generated_tokens", "seconds", "data_use")})
        entry["per_step"] = [{k: p.get(k) for k in ("step", "tokens_per_second", "engine_use", "seconds")}
                             for p in s.get("per_step", [])]
    report["runs"][run] = entry
    use = entry.get("engine_use") or {}
    print(f"{run}: concurrency {(entry.get('concurrency') or {}).get('used')}, "
          f"engine busy {use.get('engine_busy_fraction')}, in flight {use.get('generate_in_flight_mean')}, "
          f"{entry.get('tokens_per_second')} tok/s, reward {entry.get('reward_mean')}, rc {entry.get('exit_status')}")
out.write_text(json.dumps(report, indent=1))
PY
for f in timeline training; do cp "$WORK/default/$f.png" "$OUT/firstday_default_$f.png" 2>/dev/null; done
stop_server

say "GPU tests: tests/gpu/test_firstday_gpu.py"
[ "$DRY" = 1 ] && export AGENTLOOP_GPU_DRYRUN=1
mkdir -p "$WORK/tests"
AGENTLOOP_GPU_OUT="$WORK/tests" AGENTLOOP_GPU_RESULTS="$OUT/gpu_firstday_tests.json" \
AGENTLOOP_GPU_COMMAND="pytest tests/gpu/test_firstday_gpu.py -m gpu" \
  timeout -k 20 "${FIRSTDAY_TEST_LIMIT:-200}" python3 -m pytest tests/gpu/test_firstday_gpu.py -m gpu -q \
  -p no:cacheprovider 2>&1 | tail -15 | cut -c1-400 | tee -a "$LOG"

for f in "$WORK"/server.log "$WORK"/tests/*.log; do
  [ -f "$f" ] || continue
  echo "===== $f ($(wc -c < "$f") bytes)"; grep -v "Decode batch\|Prefill batch" "$f" | tail -c 200000
  echo "----- last per-batch lines"; grep "Decode batch\|Prefill batch" "$f" | tail -10
done > "$OUT/sglang_firstday_log.txt" 2>/dev/null
say "done"
ls -la "$OUT" | tee -a "$LOG"
