#!/usr/bin/env bash
# `callguard serve` against Kuadrant's limitador over HTTP (issue #54,
# item 6): the same redis-server, the same load (wrk, 2 threads, 32
# connections, POST checks for 100,000 callers drawn at random), one
# sliding 60 s limit of 10 calls per caller, in alternating rounds, each
# server started fresh on an emptied Redis. Both answer a reject with 429,
# so wrk's "Non-2xx" count is each one's rejects.
#
# Per round it prints checks/s, p50/p99 latency, rejects, and the server's
# own CPU per 1,000 checks (utime+stime from /proc), redis-server's and
# wrk's CPU per 1,000 checks, and how busy the machine's cores were over the run
# (all cores, from /proc/stat; "steal" is time the host gave to other
# guests), then the medians of the round ratios. The busy share says
# whether the machine, rather than a server, set the rate: wrk, the server
# and redis-server share its cores. limitador is not part of this project: build it apart
# and pass its binary (BENCHMARKS.md says how).
#
#   scripts/bench-limitador.sh LIMITADOR_BIN [SECONDS per round, default 20] [ROUNDS, default 3]
#
# LIMITADOR_STORAGE: redis (default; counters in Redis, exact, as
# callguard's store) or redis_cached (limitador's cache in front, which
# counts in memory and flushes to Redis later). FLOOR=1 adds a third server
# to each round: serve answering GET /healthz, the same HTTP work with no
# check, so the rate no check can pass on this machine shows beside them.
set -euo pipefail
cd "$(dirname "$0")/.."
limitador="${1:?usage: scripts/bench-limitador.sh LIMITADOR_BIN [SECONDS] [ROUNDS]}"
secs="${2:-20}"
rounds="${3:-3}"
storage="${LIMITADOR_STORAGE:-redis}"
[ -x "$limitador" ] || { echo "not an executable: $limitador" >&2; exit 1; }
command -v wrk >/dev/null || { echo "wrk is not installed (apt-get install wrk)" >&2; exit 1; }
export CARGO_TARGET_DIR="${CARGO_TARGET_DIR:-$HOME/.cache/callguard-target}"
# CALLGUARD_BIN: another build to measure (then nothing is built).
if [ -z "${CALLGUARD_BIN:-}" ]; then cargo build --release --quiet --bin callguard; fi
bin="${CALLGUARD_BIN:-$CARGO_TARGET_DIR/release/callguard}"

source scripts/loopback.sh
start_redis
redis_pid="${pids[-1]}"

cat > "$work/rules.toml" <<'EOF'
count = "attempts"
[[rule]]
name = "minute"
kind = "sliding"
window = "60s"
limit = 10
EOF
cat > "$work/limits.yaml" <<'EOF'
---
- namespace: callguard
  max_value: 10
  seconds: 60
  conditions: []
  variables:
    - descriptors[0].caller
EOF
# One request function for both servers, by PATH. For callguard the call id
# is the run, the thread and the request number (unique
# across the warm-up and the measured run; limitador gets no call id).
cat > "$work/load.lua" <<'EOF'
local threads = 0
function setup(thread)
  threads = threads + 1
  thread:set("tid", threads)
end
local n = 0
function init(args)
  path = args[1]
  run = args[2]
  math.randomseed(tid * 7919 + tonumber(run))
end
local headers = { ["Content-Type"] = "application/json" }
function request()
  n = n + 1
  local caller = string.format("+3460%07d", math.random(0, 99999))
  local body
  if path == "/healthz" then
    return wrk.format("GET", path)
  elseif path == "/check_and_report" then
    body = string.format('{"namespace":"callguard","values":{"caller":"%s"},"delta":1}', caller)
  else
    body = string.format('{"call_id":"w%s-%d-%d","caller":"%s","callee":"+34910000001"}', run, tid, n, caller)
  end
  return wrk.format("POST", path, headers, body)
end
EOF

cpu_ticks() { awk '{print $14 + $15}' "/proc/$1/stat"; }
# The machine's CPU ticks: "busy steal all" (all cores; busy excludes idle,
# iowait and steal).
machine_ticks() { awk '/^cpu / {print $2+$3+$4+$7+$8, $9, $2+$3+$4+$5+$6+$7+$8+$9}' /proc/stat; }
wait_http() {
  for _ in $(seq 200); do
    curl -s -o /dev/null "http://127.0.0.1:$1$2" && return 0
    sleep 0.1
  done
  echo "server on port $1 did not answer" >&2
  return 1
}
# run_round NAME: a fresh server on an emptied Redis, a 3 s warm-up, the
# measured run; prints "NAME rps p50 p99 rejects cpu_ms_per_1k".
run_round() {
  local name="$1" port pid path t0 t1 out rps p50 p99 rejects requests
  redis-cli -p "$rport" flushall >/dev/null
  port="$(free_port)"
  if [ "$name" = callguard ] || [ "$name" = floor ]; then
    "$bin" serve --listen "127.0.0.1:$port" --redis-url "redis://127.0.0.1:$rport" \
      --rules "$work/rules.toml" --reject-status 429 2>"$work/serve.log" &
    pid=$!; path=/v1/check
    wait_http "$port" /readyz
    if [ "$name" = floor ]; then path=/healthz; fi
  else
    "$limitador" -B 127.0.0.1 -P "$port" -b 127.0.0.1 -p "$(free_port)" \
      "$work/limits.yaml" "$storage" "redis://127.0.0.1:$rport" >"$work/limitador.log" 2>&1 &
    pid=$!; path=/check_and_report
    wait_http "$port" /status
  fi
  track "$pid"
  wrk -t2 -c32 -d3s -s "$work/load.lua" "http://127.0.0.1:$port" -- "$path" 1 >/dev/null
  t0="$(cpu_ticks "$pid")"; r0="$(cpu_ticks "$redis_pid")"; m0="$(machine_ticks)"
  out="$(/usr/bin/time -f "wrk-cpu %U %S" -o "$work/wrk.time" \
    wrk -t2 -c32 -d"${secs}s" --latency -s "$work/load.lua" "http://127.0.0.1:$port" -- "$path" 2)"
  t1="$(cpu_ticks "$pid")"; r1="$(cpu_ticks "$redis_pid")"; m1="$(machine_ticks)"
  kill "$pid"; wait "$pid" 2>/dev/null || true
  rps="$(awk '/^Requests\/sec:/ {print $2}' <<<"$out")"
  requests="$(awk '/requests in/ {print $1}' <<<"$out")"
  rejects="$(awk '/Non-2xx or 3xx responses:/ {print $5}' <<<"$out")"
  p50="$(awk '$1 == "50%" {print $2}' <<<"$out")"
  p99="$(awk '$1 == "99%" {print $2}' <<<"$out")"
  if grep -q 'Socket errors' <<<"$out"; then echo "$name: $(grep 'Socket errors' <<<"$out")" >&2; fi
  python3 - "$name" "$rps" "$p50" "$p99" "${rejects:-0}" "$requests" "$((t1 - t0))" "$(getconf CLK_TCK)" \
    "$((r1 - r0))" "$m0" "$m1" "$(awk '/^wrk-cpu/ {print $2 + $3}' "$work/wrk.time")" <<'EOF'
import sys
name, rps, p50, p99, rejects, requests, ticks, hz, rticks, m0, m1, wrk_s = sys.argv[1:]
busy, steal, total = (int(b) - int(a) for a, b in zip(m0.split(), m1.split()))
def ms(v):
    for unit, f in (("us", 1e-3), ("ms", 1.0), ("s", 1e3)):
        if v.endswith(unit) and (unit != "s" or not v.endswith(("us", "ms"))):
            return float(v[: -len(unit)]) * f
    raise SystemExit(f"unreadable latency {v!r}")
def per_1k(t):
    return int(t) * 1000 / int(hz) / max(int(requests), 1) * 1000
print(f"{name} {float(rps):.0f} {ms(p50):.3f} {ms(p99):.3f} {int(rejects) / max(int(requests), 1):.3f} "
      f"{per_1k(ticks):.1f} {per_1k(rticks):.1f} {100 * busy / max(total, 1):.0f} {100 * steal / max(total, 1):.0f} "
      f"{float(wrk_s) * 1e6 / max(int(requests), 1):.1f}")
EOF
}

echo "== serve vs limitador ($storage): redis-server $(redis-server --version | awk '{print $3}'), $(nproc) cores, wrk -t2 -c32, ${secs}s x $rounds rounds"
printf '%-10s %10s %9s %9s %8s %10s %10s %7s %7s %10s\n' server "checks/s" "p50 ms" "p99 ms" rejected "CPU ms/1k" \
  "redis ms/1k" "busy %" "steal %" "wrk ms/1k"
results=()
for r in $(seq "$rounds"); do
  servers=(callguard limitador)
  if [ -n "${FLOOR:-}" ]; then servers+=(floor); fi
  for name in "${servers[@]}"; do
    line="$(run_round "$name")"
    results+=("$line")
    # shellcheck disable=SC2086
    printf '%-10s %10s %9s %9s %8s %10s %10s %7s %7s %10s\n' $line
  done
done
printf '%s\n' "${results[@]}" | python3 -c '
import statistics, sys
rows = [l.split() for l in sys.stdin if l.strip()]
cg = [r for r in rows if r[0] == "callguard"]
lim = [r for r in rows if r[0] == "limitador"]
def med(i, f):
    return statistics.median(f(float(a[i]), float(b[i])) for a, b in zip(cg, lim))
print(f"callguard / limitador, medians of the rounds: checks/s {med(1, lambda a, b: a / b):.2f}x, "
      f"p99 {med(3, lambda a, b: a / b):.2f}x, CPU per check {med(5, lambda a, b: a / b):.2f}x")
for name, rs in (("callguard", cg), ("limitador", lim)):
    print(f"{name}: cores busy {statistics.median(float(r[7]) for r in rs):.0f}% (steal "
          f"{statistics.median(float(r[8]) for r in rs):.0f}%), server + redis-server CPU "
          f"{statistics.median(float(r[5]) + float(r[6]) for r in rs):.1f} ms per 1,000 checks, "
          f"with wrk {statistics.median(float(r[5]) + float(r[6]) + float(r[9]) for r in rs):.1f}")
# The cores the checks of callguard would need at twice the rate of
# limitador, at the CPU per check measured (server, redis-server and wrk).
need = statistics.median(
    2 * float(b[1]) * (float(a[5]) + float(a[6]) + float(a[9])) / 1e6 for a, b in zip(cg, lim))
print(f"cores callguard, redis-server and wrk would need at 2x the checks/s of limitador: {need:.2f}")
floor = [r for r in rows if r[0] == "floor"]
if floor:
    f = statistics.median(float(a[1]) / float(b[1]) for a, b in zip(floor, lim))
    print(f"HTTP floor (GET /healthz) / limitador checks/s, median: {f:.2f}x")
'
