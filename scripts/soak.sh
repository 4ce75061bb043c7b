#!/usr/bin/env bash
# Soak run (not part of the test command): `callguard consume` against tansu
# and redis-server on loopback for MINUTES (default 10) at a steady offered
# load of RATE events/s (default 2000), recording the consumer's RSS, Redis
# memory and decided events every 10 s to out/soak.csv. Memory should be
# flat once the windows are warm (TTLs expire idle callers).
#
#   scripts/soak.sh [MINUTES] [RATE]
set -euo pipefail
cd "$(dirname "$0")/.."
minutes="${1:-10}"
rate="${2:-2000}"
seconds=$((minutes * 60))
export CARGO_TARGET_DIR="${CARGO_TARGET_DIR:-$HOME/.cache/callguard-target}"
cargo build --release --bin callguard --example loadgen -q
bin="$CARGO_TARGET_DIR/release/callguard"
loadgen="$CARGO_TARGET_DIR/release/examples/loadgen"
mkdir -p out
source scripts/loopback.sh
start_redis --maxmemory-policy noeviction
start_tansu
mport=$(free_port)
for t in calls call-decisions call-features; do tansu topic create "$t" --partitions 4 --broker "tcp://127.0.0.1:$kport" >/dev/null; done
tansu topic create calls-dlq --partitions 1 --broker "tcp://127.0.0.1:$kport" >/dev/null

"$bin" consume --brokers "127.0.0.1:$kport" --redis-url "redis://127.0.0.1:$rport" \
  --rules scripts/soak-rules.toml --ttl-slack-s 30 --metrics-addr "127.0.0.1:$mport" -X fetch.wait.max.ms=50 \
  > "$work/consume.log" 2>&1 &
cpid=$!
track "$cpid"
sleep 3
"$loadgen" "127.0.0.1:$kport" calls "$rate" "$seconds" > "$work/loadgen.log" 2>&1 &
track $!

out=out/soak.csv
echo "elapsed_s,consumer_rss_kib,redis_used_memory,decided,keys" > "$out"
start=$(date +%s)
while [ $(( $(date +%s) - start )) -le "$seconds" ]; do
  sleep 10
  rss=$(ps -o rss= -p "$cpid" | tr -d ' ')
  used=$(redis-cli -p "$rport" info memory | awk -F: '/^used_memory:/ {print $2}' | tr -d '\r')
  keys=$(redis-cli -p "$rport" dbsize | tr -d '\r')
  decided=$(curl -s "127.0.0.1:$mport/metrics" | awk '/^callguard_events_total/ {s += $NF} END {print s+0}')
  line="$(( $(date +%s) - start )),$rss,$used,$decided,$keys"
  echo "$line" >> "$out"
  echo "$line"
done
cat "$work/loadgen.log"
echo "samples in $out"
