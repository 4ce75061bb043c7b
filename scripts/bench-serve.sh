#!/usr/bin/env bash
# Check-API benchmark: `callguard serve` on loopback with its own
# redis-server and the example rule set (data/rules.toml), under an
# open-loop load from examples/bench_serve.rs (latency from each check's
# scheduled send time). Prints, in one run:
#   * the HTTP floor: GET /healthz on the same server at the same rate;
#   * checks at 5,000/s (target: p99 under 2 ms), with the ratio to the floor;
#   * a ramp of rates, and the highest whose p99 stays under 10 ms.
# Client, server and Redis share the machine's cores, as on an SBC host.
# Runs once per --redis-mode in MODES (default "script cached"). RULES
# names another rule file (e.g. with a rule keyed by callee added).
#
#   scripts/bench-serve.sh [SECONDS per step, default 15]
set -euo pipefail
cd "$(dirname "$0")/.."
secs="${1:-15}"
rules="${RULES:-data/rules.toml}"
export CARGO_TARGET_DIR="${CARGO_TARGET_DIR:-$HOME/.cache/callguard-target}"
cargo build --release --quiet --bin callguard --example bench_serve
# CALLGUARD_BIN: another build to measure (an A/B against this one).
bin="${CALLGUARD_BIN:-$CARGO_TARGET_DIR/release/callguard}"
load="$CARGO_TARGET_DIR/release/examples/bench_serve"

source scripts/loopback.sh
start_redis
# bench_mode MODE: a fresh Redis and serve in MODE, then the steps.
bench_mode() {
local mode="$1" best rate line p errors floor at5k
redis-cli -p "$rport" flushall >/dev/null
redis-cli -p "$rport" config resetstat >/dev/null
redis-cli -p "$rport" latency reset >/dev/null
hport="$(free_port)"
# Record Redis's own stalls of 1 ms or more (printed at the end).
redis-cli -p "$rport" config set latency-monitor-threshold 1 >/dev/null
"$bin" serve --listen "127.0.0.1:$hport" --redis-url "redis://127.0.0.1:$rport" \
  --redis-mode "$mode" --rules "$rules" --max-future-skew-s 0 2>"$work/serve-$mode.log" &
spid=$!
track $spid
for _ in $(seq 100); do curl -sf "http://127.0.0.1:$hport/readyz" >/dev/null && break; sleep 0.1; done

echo "== --redis-mode $mode, rules $rules: redis-server $(redis-server --version | awk '{print $3}'), $(nproc) cores, ${secs}s per step"
"$load" "$hport" 5000 "$secs" 64 20000 >/dev/null   # warm-up: callers and keys created, steady state
floor="$("$load" "$hport" 5000 "$secs" 64 20000 healthz)"
echo "healthz 5000/s: $floor"
at5k="$("$load" "$hport" 5000 "$secs" 64 20000)"
echo "check   5000/s: $at5k"
p99() { sed -E 's/.* p99 ([0-9.]+) ms.*/\1/' <<<"$1"; }
echo "p99 at 5,000/s: $(p99 "$at5k") ms (target < 2 ms); HTTP floor $(p99 "$floor") ms; ratio $(python3 -c "print(round($(p99 "$at5k")/max($(p99 "$floor"),0.001),2))")"
best=0
if python3 -c "import sys; sys.exit(0 if $(p99 "$at5k") < 10 else 1)"; then best=5000; fi
for rate in 6000 7000 8000 9000 10000 12000 15000 20000; do
  line="$("$load" "$hport" "$rate" "$secs" 64 20000)"
  echo "check $rate/s: $line"
  p="$(p99 "$line")"
  errors="$(sed -E 's/.* errors ([0-9]+).*/\1/' <<<"$line")"
  if python3 -c "import sys; sys.exit(0 if $p < 10 and $errors == 0 else 1)"; then best=$rate; else break; fi
done
echo "highest sustained rate with p99 < 10 ms: $best checks/s"
echo "redis: $(redis-cli -p "$rport" info commandstats | grep -E '^cmdstat_evalsha' || true)"
echo "redis: $(redis-cli -p "$rport" info cpu | grep -E '^used_cpu_(user|sys):' | tr -d '\r' | tr '\n' ' ')"
echo "redis stalls of 1 ms or more (event, last unix time, last ms, max ms):"
redis-cli -p "$rport" latency latest | paste -d' ' - - - -
kill "$spid" 2>/dev/null || true
wait "$spid" 2>/dev/null || true
}
for mode in ${MODES:-script cached}; do bench_mode "$mode"; done
