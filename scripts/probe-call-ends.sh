#!/usr/bin/env bash
# What a call's end costs the store against an attempt (not part of the
# test command). Replays a generated log of ROWS calls (default 10,000)
# with `data/rules.toml` plus a concurrent rule, twice: as attempts only
# (durations blanked) and with every call's end (`ts + duration_ms`).
#
# * The window script (`--redis-mode script`): redis-server runs under
#   valgrind's callgrind, and the script prints the instructions it ran
#   per attempt and per end (a run without a replay is subtracted: Redis's
#   own start and stop). Instruction counts repeat to 0.1%.
# * The in-memory store: events per second of each replay (best of 3).
#
#   scripts/probe-call-ends.sh [ROWS]
set -euo pipefail
cd "$(dirname "$0")/.."
rows="${1:-10000}"
export CARGO_TARGET_DIR="${CARGO_TARGET_DIR:-$HOME/.cache/callguard-target}"
if [ -z "${BIN:-}" ]; then
  cargo build --release --quiet --bin callguard
  BIN="$CARGO_TARGET_DIR/release/callguard"
fi
command -v valgrind >/dev/null || { echo "this probe needs valgrind" >&2; exit 1; }
source scripts/loopback.sh
"$BIN" generate --rows "$rows" --output "$work/with.csv" 2>/dev/null
awk -F, 'BEGIN { OFS = "," } NR == 1 { print; next } { $5 = ""; print }' \
  "$work/with.csv" > "$work/without.csv"
ends=$(awk -F, 'NR > 1 && $5 != "" { n++ } END { print n + 0 }' "$work/with.csv")
{ cat data/rules.toml
  printf '\n[[rule]]\nname = "channels"\nkind = "concurrent"\nlimit = 10\nmax_duration = "4h"\n'
} > "$work/rules.toml"

# Instructions redis-server runs while `$1` (a log, or "none") is replayed.
instructions() {
  local log=$1 port out="$work/cg.$RANDOM"
  port=$(free_port)
  valgrind --tool=callgrind --callgrind-out-file="$out" redis-server --port "$port" \
    --bind 127.0.0.1 --save "" --appendonly no --dir "$work" > "$work/redis.log" 2>&1 &
  local pid=$!
  for _ in $(seq 600); do redis-cli -p "$port" ping >/dev/null 2>&1 && break; sleep 0.2; done
  if [ "$log" != none ]; then
    "$BIN" replay --input "$log" --output "$work/out.csv" --rules "$work/rules.toml" \
      --store redis --redis-mode script --redis-url "redis://127.0.0.1:$port" \
      --redis-timeout-ms 600000 >/dev/null 2>&1
  fi
  redis-cli -p "$port" shutdown nosave >/dev/null 2>&1 || true
  wait "$pid" || true
  awk '/^(summary|totals):/ { print $2; exit }' "$out"
}

# Best events per second of three in-memory replays of `$1`.
memory_rate() {
  local best=0 n=$2
  for _ in 1 2 3; do
    local start end rate
    start=$(date +%s.%N)
    "$BIN" replay --input "$1" --output "$work/mem.csv" --rules "$work/rules.toml" >/dev/null 2>&1
    end=$(date +%s.%N)
    rate=$(awk -v n="$n" -v s="$start" -v e="$end" 'BEGIN { printf "%d", n / (e - s) }')
    [ "$rate" -gt "$best" ] && best=$rate
  done
  echo "$best"
}

base=$(instructions none)
attempts_only=$(instructions "$work/without.csv")
with_ends=$(instructions "$work/with.csv")
echo "calls $rows, ends $ends"
echo "window script, instructions per attempt: $(( (attempts_only - base) / rows ))"
echo "window script, instructions per end:     $(( (with_ends - attempts_only) / ends ))"
echo "memory store, attempts only: $(memory_rate "$work/without.csv" "$rows") events/s"
echo "memory store, with ends:     $(memory_rate "$work/with.csv" "$((rows + ends))") events/s"
