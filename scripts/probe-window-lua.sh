#!/usr/bin/env bash
# Redis's time per call of lua/window.lua (not part of the test command):
# replays a generated log of ROWS calls (default 200,000) with
# `--store redis --redis-mode script` on a scratch redis-server, once per
# rule set (data/rules.toml, data/rules-fraud.toml), and prints
# `INFO commandstats` for EVALSHA (32 events per call). Set BIN to time
# another build of callguard; OUT to keep each run's decisions there
# (OUT/<rules>.csv), to compare two builds byte for byte.
#
#   scripts/probe-window-lua.sh [ROWS]
set -euo pipefail
cd "$(dirname "$0")/.."
rows="${1:-200000}"
export CARGO_TARGET_DIR="${CARGO_TARGET_DIR:-$HOME/.cache/callguard-target}"
if [ -z "${BIN:-}" ]; then
  cargo build --release --quiet --bin callguard
  BIN="$CARGO_TARGET_DIR/release/callguard"
fi
source scripts/loopback.sh
start_redis
"$BIN" generate --rows "$rows" --output "$work/log.csv" 2>/dev/null
for rules in data/rules.toml data/rules-fraud.toml; do
  redis-cli -p "$rport" flushall >/dev/null
  redis-cli -p "$rport" config resetstat >/dev/null
  "$BIN" replay --input "$work/log.csv" --output "$work/out.csv" --rules "$rules" \
    --store redis --redis-mode script --redis-url "redis://127.0.0.1:$rport" >/dev/null 2>&1
  [ -n "${OUT:-}" ] && cp "$work/out.csv" "$OUT/$(basename "$rules" .toml).csv"
  echo "$rules: $(redis-cli -p "$rport" info commandstats | tr -d '\r' | grep '^cmdstat_evalsha')"
done
