#!/usr/bin/env bash
# Several writers on one hot caller (not part of the test command): two
# `callguard serve` instances on one redis-server, each offered SECONDS of
# checks at RATE/s (examples/bench_serve.rs, one caller drawing nine checks
# in ten), once per --redis-mode in MODES (default "script cached"). This
# is what a switch pool that does not route by caller does to a flood.
# Prints each instance's latency line (errors: 503 answers) and how many
# contended batches the two logged.
#
#   scripts/bench-hot-caller.sh [RATE per instance, default 250] [SECONDS, default 10]
set -euo pipefail
cd "$(dirname "$0")/.."
rate="${1:-250}"
secs="${2:-10}"
export CARGO_TARGET_DIR="${CARGO_TARGET_DIR:-$HOME/.cache/callguard-target}"
cargo build --release --quiet --bin callguard --example bench_serve
# CALLGUARD_BIN: another build of callguard to measure (an A/B).
bin="${CALLGUARD_BIN:-$CARGO_TARGET_DIR/release/callguard}"
load="$CARGO_TARGET_DIR/release/examples/bench_serve"

source scripts/loopback.sh
start_redis
for mode in ${MODES:-script cached}; do
  redis-cli -p "$rport" flushall >/dev/null
  # (Not loopback.sh's `pids`: redis-server must stay tracked.)
  serve_pids=()
  ports=()
  for i in 1 2; do
    port="$(free_port)"
    "$bin" serve --listen "127.0.0.1:$port" --redis-url "redis://127.0.0.1:$rport" \
      --redis-mode "$mode" --rules data/rules.toml --max-future-skew-s 0 2>"$work/serve-$mode-$i.log" &
    serve_pids+=($!)
    track $!
    ports+=("$port")
  done
  for port in "${ports[@]}"; do
    for _ in $(seq 100); do curl -sf "http://127.0.0.1:$port/readyz" >/dev/null && break; sleep 0.1; done
  done
  CALL_ID_PREFIX=x "$load" "${ports[0]}" "$rate" "$secs" 4 1 > "$work/a.txt" &
  a=$!
  CALL_ID_PREFIX=y "$load" "${ports[1]}" "$rate" "$secs" 4 1 > "$work/b.txt"
  wait "$a"
  echo "== --redis-mode $mode: two serve instances, one hot caller, $rate checks/s each for $secs s"
  echo "instance 1: $(cat "$work/a.txt")"
  echo "instance 2: $(cat "$work/b.txt")"
  echo "contended batches logged: $(cat "$work"/serve-"$mode"-*.log | grep -c 'commit rounds' || true)"
  kill "${serve_pids[@]}" 2>/dev/null || true
  wait "${serve_pids[@]}" 2>/dev/null || true
done
