#!/usr/bin/env bash
# Redis's time per call of lua/window.lua (not part of the test command):
# replays a generated log of ROWS calls (default 200,000) with
# `--store redis --redis-mode script` on a scratch redis-server, once per
# rule set (data/rules.toml, data/rules-fraud.toml), and prints
# `INFO commandstats` for EVALSHA (32 events per call). Set BIN to time
# another build of callguard; OUT to keep each run's decisions there
# (OUT/<rules>.csv), to compare two builds byte for byte.
#
# Time on a shared machine spreads by 15% from run to run. With
# INSTRUCTIONS=1 redis-server runs under valgrind's callgrind instead
# and the script prints the instructions it ran per EVALSHA, which
# repeat to 0.1% (about 40 s per rule set at ROWS=10000; startup
# included, the same for every build).
#
#   scripts/probe-window-lua.sh [ROWS]
#   INSTRUCTIONS=1 scripts/probe-window-lua.sh 10000
#   RULES="a.toml b.toml" scripts/probe-window-lua.sh   (other rule sets)
set -euo pipefail
cd "$(dirname "$0")/.."
rows="${1:-200000}"
export CARGO_TARGET_DIR="${CARGO_TARGET_DIR:-$HOME/.cache/callguard-target}"
if [ -z "${BIN:-}" ]; then
  cargo build --release --quiet --bin callguard
  BIN="$CARGO_TARGET_DIR/release/callguard"
fi
source scripts/loopback.sh
"$BIN" generate --rows "$rows" --output "$work/log.csv" 2>/dev/null

# One replay on a fresh redis-server (under callgrind with INSTRUCTIONS=1).
probe() {
  local rules=$1 timeout=2000 counted=""
  if [ -n "${INSTRUCTIONS:-}" ]; then
    command -v valgrind >/dev/null || { echo "INSTRUCTIONS=1 needs valgrind" >&2; exit 1; }
    rport=$(free_port)
    valgrind --tool=callgrind --callgrind-out-file="$work/cg.out" redis-server --port "$rport" \
      --bind 127.0.0.1 --save "" --appendonly no --dir "$work" > "$work/redis.log" 2>&1 &
    counted=$!
    for _ in $(seq 600); do redis-cli -p "$rport" ping >/dev/null 2>&1 && break; sleep 0.2; done
    timeout=600000
  else
    start_redis
  fi
  "$BIN" replay --input "$work/log.csv" --output "$work/out.csv" --rules "$rules" \
    --store redis --redis-mode script --redis-url "redis://127.0.0.1:$rport" \
    --redis-timeout-ms "$timeout" >/dev/null 2>&1
  [ -n "${OUT:-}" ] && cp "$work/out.csv" "$OUT/$(basename "$rules" .toml).csv"
  local stats
  stats=$(redis-cli -p "$rport" info commandstats | tr -d '\r' | grep '^cmdstat_evalsha')
  redis-cli -p "$rport" shutdown nosave >/dev/null 2>&1 || true
  if [ -n "$counted" ]; then
    wait "$counted" || true
    local calls ir
    calls=$(sed -n 's/^cmdstat_evalsha:calls=\([0-9]*\),.*/\1/p' <<< "$stats")
    ir=$(awk '/^(summary|totals):/ { print $2; exit }' "$work/cg.out")
    stats="$stats instructions_per_call=$((ir / calls))"
  fi
  echo "$rules: $stats"
}

for rules in ${RULES:-data/rules.toml data/rules-fraud.toml}; do probe "$rules"; done
