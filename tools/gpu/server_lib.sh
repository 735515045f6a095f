# Sourced by the GPU scripts (tools/gpu_sweep.sh, tools/gpu_continuous.sh): start one engine server in its own
# process group and wait until it answers; stop that whole group. The caller builds the command line.
#
#   serve_start ARGV READY_LINE LOGFILE URL SECONDS   sets SERVER (the group's pid); status 0 once the server
#                                                      logged READY_LINE and answers GET URL/model_info
#   serve_stop                                         TERM the group, KILL what is left after 30 s
SERVER=
serve_start() {
  local argv=$1 ready=$2 log=$3 url=$4 seconds=$5
  setsid bash -c "exec $argv" > "$log" 2>&1 &
  SERVER=$!
  for _ in $(seq "$seconds"); do
    grep -qF "$ready" "$log" 2>/dev/null && break
    kill -0 "$SERVER" 2>/dev/null || break
    sleep 1
  done
  grep -qF "$ready" "$log" 2>/dev/null || return 1
  for _ in $(seq 60); do  # the CPU engine logs its line just before it listens
    python3 -c "import urllib.request; urllib.request.urlopen('$url/model_info', timeout=2)" 2>/dev/null && return 0
    sleep 1
  done
  return 1
}
serve_stop() {
  [ -n "$SERVER" ] || return 0
  kill -TERM -- -"$SERVER" 2>/dev/null
  for _ in $(seq 30); do kill -0 "$SERVER" 2>/dev/null || break; sleep 1; done
  kill -KILL -- -"$SERVER" 2>/dev/null  # what is left of that group only (scheduler, detokenizer)
  SERVER=
}
