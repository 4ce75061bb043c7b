#!/usr/bin/env bash
# Cost at a carrier's shape (not part of the test command): a day of a
# population of N subscribers (`generate --subscribers N`: most call 1 to 5
# times a day, PBX trunks hundreds, a few floods thousands), for each N of
# SIZES (default "1000000 5000000 20000000"), ROWS calls of it (default
# 4000000: about a whole day of 1 M subscribers, a thinned day of the
# larger ones, whose active callers mostly call once), data/rules.toml,
# idempotency on, the default cached store and cache. For each N:
#
#   1. `replay --store redis` on a fresh redis-server: events/s, callguard's
#      peak RSS, its cache line (lookups, share in memory, read back,
#      dropped, held); Redis `used_memory` at the end and its peak, in all
#      and per active caller (distinct callers of the log);
#   2. the seeds' own layout for the same rules and callers on the same
#      server: one key per rule and caller (INCR + PEXPIRE), each caller
#      holding a live window of every rule; `used_memory` per active caller,
#      and callguard's per caller against it;
#   3. unless CONSUME=0: the log produced to a 4-partition topic of a tansu
#      broker, then `consume` (default settings) on a fresh redis-server,
#      timed from its first decision to its last: events/s, peak RSS, the
#      cache's metrics and Redis's memory as above.
#
#   [SIZES="1000000 5000000 20000000"] [ROWS=4000000] [CONSUME=1] scripts/bench-population.sh
set -euo pipefail
cd "$(dirname "$0")/.."
export CARGO_TARGET_DIR="${CARGO_TARGET_DIR:-$HOME/.cache/callguard-target}"
cargo build --release --quiet --bin callguard
bin="${CALLGUARD_BIN:-$CARGO_TARGET_DIR/release/callguard}"
sizes="${SIZES:-1000000 5000000 20000000}"
rows="${ROWS:-4000000}"
consume="${CONSUME:-1}"
rules=data/rules.toml
source scripts/loopback.sh
[ "$consume" = 1 ] && start_tansu
now() { date +%s.%N; }

# A fresh redis-server for one run (its peak memory is its own): sets rport.
redis_pid=""
fresh_redis() {
  if [ -n "$redis_pid" ]; then kill "$redis_pid" 2>/dev/null || true; wait "$redis_pid" 2>/dev/null || true; fi
  start_redis
  redis_pid="${pids[-1]}"
}
# Redis INFO memory field NAME, bytes.
mem() { redis-cli -p "$rport" info memory | tr -d '\r' | awk -F: -v k="$1" '$1 == k {print $2}'; }
mb() { echo "$1" | awk '{printf "%.0f", $1 / 1048576}'; }
per() { echo "$1 $2" | awk '{printf "%.0f", $1 / $2}'; }
# "used at the end MB (B/caller), peak MB (B/caller), N keys" of the server now.
redis_line() {
  local used peak base="$1" active="$2"
  used=$(( $(mem used_memory) - base ))
  peak=$(( $(mem used_memory_peak) - base ))
  echo "$(mb "$used") MB ($(per "$used" "$active") B a caller) at the end, $(mb "$peak") MB ($(per "$peak" "$active") B) at the peak, $(redis-cli -p "$rport" dbsize) keys"
}

echo "# Population benchmark: $rows calls a run, $rules, idempotency on, default cache"
for n in $sizes; do
  log="$work/pop-$n.csv"
  echo
  echo "## $n subscribers"
  "$bin" generate --subscribers "$n" --rows "$rows" --seed 5 -o "$log"
  active=$(tail -n +2 "$log" | cut -d, -f2 | sort -u | tee "$work/callers" | wc -l)
  events=$(( $(wc -l < "$log") - 1 ))
  echo "active callers: $active; calls: $events"

  # 1. replay --store redis.
  fresh_redis
  base=$(mem used_memory)
  t0=$(now)
  /usr/bin/time -f "%M" -o "$work/rss" "$bin" replay -i "$log" --rules "$rules" --store redis \
    --redis-url "redis://127.0.0.1:$rport" -o "$work/dec.parquet" > "$work/replay.out" 2> "$work/replay.err" || {
    cat "$work/replay.err" >&2
    exit 1
  }
  t1=$(now)
  ours=$(( $(mem used_memory) - base ))
  echo "replay --store redis: $(echo "$events / ($t1 - $t0)" | bc -l | xargs printf '%.0f') events/s, peak RSS $(( $(tail -1 "$work/rss") / 1024 )) MB"
  echo "  $(grep '^cache' "$work/replay.out" | sed 's/^cache *//')"
  echo "  Redis: $(redis_line "$base" "$active")"

  # 2. The seeds' layout for the same rules and callers.
  redis-cli -p "$rport" flushall > /dev/null
  base=$(mem used_memory)
  awk '{ for (r = 1; r <= 3; r++) { k = "seed:{" $1 "}:" r; print "INCR " k; print "PEXPIRE " k " 3600000" } }' \
    "$work/callers" | redis-cli -p "$rport" --pipe > /dev/null
  seeds=$(( $(mem used_memory) - base ))
  echo "seeds' layout (3 keys a caller, INCR + PEXPIRE): $(mb "$seeds") MB, $(per "$seeds" "$active") B a caller; callguard / seeds: $(echo "$ours $seeds" | awk '{printf "%.2f", $1 / $2}')"

  # 3. consume.
  if [ "$consume" = 1 ]; then
    fresh_redis
    base=$(mem used_memory)
    topic="pop-$n"
    tansu topic create "$topic" --partitions 4 --broker "tcp://$brokers" > /dev/null
    tansu topic create "$topic-dlq" --partitions 1 --broker "tcp://$brokers" > /dev/null
    for t in decisions features; do tansu topic create "$topic-$t" --partitions 4 --broker "tcp://$brokers" > /dev/null; done
    "$bin" produce -i "$log" --brokers "$brokers" --topic "$topic" > /dev/null
    mport=$(free_port)
    metrics() { curl -s "127.0.0.1:$mport/metrics" || true; }
    "$bin" consume --brokers "$brokers" --input-topic "$topic" --redis-url "redis://127.0.0.1:$rport" --rules "$rules" \
      --group "pop-$n" --decisions-topic "$topic-decisions" --features-topic "$topic-features" \
      --dlq-topic "$topic-dlq" --metrics-addr "127.0.0.1:$mport" > "$work/consume.log" 2>&1 &
    cpid=$!
    track "$cpid"
    t0="" d=0 d0=0
    # Bounded: at most 20 minutes.
    for _ in $(seq 1 24000); do
      d=$(metrics | awk '/^callguard_events_total/ {s += $NF} END {print s+0}')
      if [ -z "$t0" ] && [ "$d" -gt 0 ]; then t0=$(now); d0=$d; fi
      [ "$d" -ge "$events" ] && break
      kill -0 "$cpid" 2>/dev/null || { cat "$work/consume.log" >&2; exit 1; }
      sleep 0.05
    done
    t1=$(now)
    rss=$(awk '/^VmHWM/ {print int($2 / 1024)}' "/proc/$cpid/status")
    echo "consume: $(echo "($d - $d0) / ($t1 - $t0)" | bc -l | xargs printf '%.0f') events/s (decided $d of $events), peak RSS $rss MB"
    echo "  cache: $(metrics | awk '
      /^callguard_cache_lookups_total/ { if ($1 ~ /hit/) h = $NF; else m = $NF }
      /^callguard_cache_rereads_total/ { r = $NF } /^callguard_cache_evictions_total/ { e = $NF }
      /^callguard_cache_callers / { c = $NF } /^callguard_cache_bytes / { b = $NF }
      END { n = h + m; printf "%d callers looked up, %.1f%% in memory; %d read back, %d dropped; %d held (about %d MiB)", n, (n ? 100 * h / n : 0), r, e, c, b / 1048576 }')"
    echo "  Redis: $(redis_line "$base" "$active")"
    kill "$cpid" 2>/dev/null || true
    wait "$cpid" 2>/dev/null || true
  fi
  rm -f "$log"
done
