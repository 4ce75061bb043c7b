#!/usr/bin/env bash
# Online benchmark (not part of the test command). Starts its own
# redis-server and tansu broker on loopback and prints, in one run:
#   1. examples/bench_store.rs: Redis memory per caller per rule kind; the
#      store beside the seeds' one-key sliding script (the simple-script
#      ceiling) with one rule and with data/rules.toml, the ratios and Redis
#      CPU microseconds per event (`INFO cpu` deltas), median of 3 rounds;
#   2. end to end: EVENTS generated calls (default 200000) loaded into a
#      4-partition topic, then `callguard consume` (data/rules.toml) timed
#      until every call is decided, beside `callguard replay --store redis`
#      on the same log and a fresh Redis (the store through the same batch
#      path): events/s and the ratio, and consume's batches and store
#      time per batch (as in section 3), and the CPU µs per event of
#      each (callguard's process and Redis; the broker's left out);
#   3. latency: `examples/loadgen.rs` offering RATE events/s (default 20000),
#      then LOW events/s (default 5000), for SECONDS (default 10) each while
#      consume runs with its default settings; the time from each
#      event's wall-clock stamp to its decision record's Kafka timestamp,
#      p50/p90/p99/max (`examples/decision_latency.rs`), and how many were
#      decided; beside it the floor: the events' arrival at a plain
#      consumer of the input topic (same fetch setting), measured in the
#      same run; and, from consume's metrics, its batches' mean size and
#      the store's time per batch (mean, and the histogram bucket holding
#      p99); Redis's CPU over the load and its time per command (`INFO
#      commandstats`, commands called 100 times or more); and consume's
#      own time per call, from reading its message to
#      producing its records (`callguard_decision_delay_seconds`, no
#      broker in it), split into the batch's wait for the store
#      (`callguard_batch_wait_seconds`) and the store's time per batch.
#
#   Sections 2 and 3 run once per mode in MODES (default "default
#   script": "default" passes no --redis-mode, so it measures what a
#   user gets, the cached store; "script" and "cached" pass the flag). CONSUME_ARGS adds options to the consume of
#   sections 2 and 3 (e.g. "--batch-size 100"). SKIP_STORE=1 leaves section 1 out
#   (an A/B of two builds of `consume` through CALLGUARD_BIN). MODEL_RULES=FILE
#   runs section 2 again on that rule set (one with a [model]). AGGREGATE=1
#   runs section 2 again with a rule keyed by callee added, and with a
#   global rule added (a 1-s window, then a 1-min one); SKIP_LATENCY=1
#   leaves section 3 out. LATENCY_MEMORY=1 runs section 3 once more (both rates) with
#   `consume --store memory` (no Redis): callguard's Kafka path alone,
#   the reference that tells the store's share of the latency from the
#   rest of callguard's (reading, encoding, producing). ENDS=1 adds
#   section 2b: consume over the calls alone against the calls and their
#   ends (`produce --ends`), with a concurrent rule, events/s of each
#   (ENDS_RULES: another rule set, e.g. data/rules-fraud.toml with its
#   talk and spend caps).
#
#   scripts/bench-online.sh [EVENTS] [RATE] [SECONDS] [LOW]
set -euo pipefail
cd "$(dirname "$0")/.."
events="${1:-200000}"
rate="${2:-20000}"
seconds="${3:-10}"
low="${4:-5000}"
modes="${MODES:-default script}"
# The --redis-mode option for a mode of MODES ("default": none).
mode_flag() { if [ "$1" != default ]; then echo "--redis-mode $1"; fi; }
export CARGO_TARGET_DIR="${CARGO_TARGET_DIR:-$HOME/.cache/callguard-target}"
cargo build --release -q --bin callguard --example bench_store --example loadgen --example decision_latency
# CALLGUARD_BIN: another build of callguard to measure (an A/B against this one).
bin="${CALLGUARD_BIN:-$CARGO_TARGET_DIR/release/callguard}"
ex="$CARGO_TARGET_DIR/release/examples"

if [ "${SKIP_STORE:-0}" != 1 ]; then
  echo "# 1. Store against the simple-script ceiling"
  "$ex/bench_store" 100000
fi

source scripts/loopback.sh
start_redis
start_tansu
mport=$(free_port)
tansu topic create calls --partitions 4 --broker "tcp://$brokers" >/dev/null
tansu topic create calls-dlq --partitions 1 --broker "tcp://$brokers" >/dev/null
topic_modes="$modes"
[ "${LATENCY_MEMORY:-0}" = 1 ] && topic_modes="$modes memory"
for mode in $topic_modes; do
  for t in "call-decisions-$mode" "call-features-$mode" "load-$mode" "load-$mode-decisions" \
    "load-$mode-features" "low-$mode" "low-$mode-decisions" "low-$mode-features"; do
    tansu topic create "$t" --partitions 4 --broker "tcp://$brokers" >/dev/null
  done
  for t in "load-$mode-dlq" "low-$mode-dlq"; do
    tansu topic create "$t" --partitions 1 --broker "tcp://$brokers" >/dev/null
  done
done
redis="redis://127.0.0.1:$rport"
decided() { { curl -s "127.0.0.1:$mport/metrics" || true; } | awk '/^callguard_events_total/ {s += $NF} END {print s+0}'; }
# consume's batches and store time per batch, from its metrics.
batches() {
  { curl -s "127.0.0.1:$mport/metrics" || true; } | awk '
    /^callguard_batch_size_sum/ {bs = $NF} /^callguard_batch_size_count/ {bn = $NF}
    /^callguard_store_latency_seconds_sum/ {ls = $NF} /^callguard_store_latency_seconds_count/ {ln = $NF}
    /^callguard_cache_decided_ahead_total/ {ahead = $NF}
    /^callguard_store_latency_seconds_bucket/ {
      le = $1; sub(/.*le="/, "", le); sub(/".*/, "", le); n++; les[n] = le; cum[n] = $NF }
    END {
      if (bn == 0 || ln == 0) { print "no batches"; exit }
      p99 = "+Inf"
      for (i = 1; i <= n; i++) if (cum[i] >= 0.99 * ln) { p99 = les[i]; break }
      if (p99 != "+Inf") p99 = sprintf("%.1f", p99 * 1000)
      printf "%d batches of %.0f events on average; store time per batch mean %.2f ms, p99 <= %s ms; %d calls decided ahead\n", bn, bs / bn, ls / ln * 1000, p99, ahead }'
}
# p50/p90/p99 in ms of consume's histogram NAME (interpolated inside its
# buckets, as Prometheus's histogram_quantile does).
quantiles() {
  { curl -s "127.0.0.1:$mport/metrics" || true; } | awk -v name="callguard_$1" '
    index($1, name "_bucket{") == 1 {
      le = $1; sub(/.*le="/, "", le); sub(/".*/, "", le); n++; les[n] = le; cum[n] = $NF }
    END {
      if (n == 0 || cum[n] == 0) { print "none"; exit }
      split("0.5 0.9 0.99", qs, " ")
      for (k = 1; k <= 3; k++) {
        want = qs[k] * cum[n]; lo = 0; below = 0; v = "+Inf"
        for (i = 1; i <= n; i++) {
          if (cum[i] >= want) {
            if (les[i] == "+Inf") break
            v = sprintf("%.1f", (lo + (les[i] - lo) * (want - below) / (cum[i] - below)) * 1000); break }
          lo = les[i]; below = cum[i] }
        printf "%sp%s %s", (k > 1 ? " / " : ""), qs[k] * 100, v }
      printf " ms (%d observed)\n", cum[n] }'
}
now() { date +%s.%N; }
# The seeds' one-key sliding script (as examples/bench_store.rs runs it)
# over EVENTS calls on this Redis, events/s: the peer of `replay --store
# redis` (issue #54, item 5).
seeds_rate() {
  local sha
  redis-cli -p "$rport" flushall > /dev/null
  sha=$(redis-cli -p "$rport" script load "redis.call('ZREMRANGEBYSCORE', KEYS[1], 0, tonumber(ARGV[1]) - tonumber(ARGV[2])) local c = redis.call('ZCARD', KEYS[1]) if c < tonumber(ARGV[3]) then redis.call('ZADD', KEYS[1], ARGV[1], ARGV[4]) redis.call('PEXPIRE', KEYS[1], ARGV[2]) return 1 end return 0")
  redis-benchmark -p "$rport" -n "$events" -P 256 -c 8 -r 100000 -q \
    EVALSHA "$sha" 1 'seed:__rand_int__' 1764547200000 60000 20 '__rand_int__' \
    | tr '\r' '\n' | awk '{for (i = 2; i <= NF; i++) if ($i == "requests") v = $(i - 1)} END {print v + 0}'
}
# Redis's time per command over the load (`INFO commandstats` since the
# last reset): "EVALSHA 4235 calls, 366 µs each, 1.55 s; SET ...".
redis_commands() {
  redis-cli -p "$rport" info commandstats | tr -d '\r' | awk -F'[:,=]' '
    /^cmdstat_/ && $3 >= 100 {
      printf "%s%s %d calls, %.0f µs each, %.2f s", (n++ ? "; " : ""), toupper(substr($1, 9)), $3, $7, $5 / 1e6 }'
}
# Redis's CPU seconds so far (user + system).
redis_cpu() { redis-cli -p "$rport" info cpu | tr -d '\r' | awk -F: '/^used_cpu_(sys|user):/ {s += $2} END {printf "%.3f", s}'; }
# The CPU seconds (user + system) of a running process.
proc_cpu() { awk -v hz="$(getconf CLK_TCK)" '{printf "%.3f", ($14 + $15) / hz}' "/proc/$1/stat"; }
# The CPU seconds of `times`' children line ("0m1.5s 0m0.2s").
times_cpu() { tail -1 | awk '{n = 0; for (i = 1; i <= 2; i++) { split($i, a, /[ms]/); n += a[1] * 60 + a[2] } printf "%.3f", n}'; }
# "callguard A, Redis B, together C" CPU µs per event from CPU seconds.
per_event() { echo "$1 $2" | awk -v n="$events" '{printf "callguard %.1f, Redis %.1f, together %.1f", $1 * 1e6 / n, $2 * 1e6 / n, ($1 + $2) * 1e6 / n}'; }

"$bin" generate --rows "$events" --seed 11 --output "$work/calls.csv" >/dev/null
"$bin" produce -i "$work/calls.csv" --brokers "$brokers" --topic calls > /dev/null

# e2e MODE [RULES TAG]: the store (replay --store redis) and consume end to
# end, in MODE, on RULES (default data/rules.toml).
e2e() {
  local mode="$1" rules="${2:-data/rules.toml}" tag="${3:-}"
  echo
  echo "# 2. End to end, $events events, $rules, --redis-mode $mode"
  redis-cli -p "$rport" flushall > /dev/null
  local t0 t1 n n0 store_rate e2e_rate seeds
  local r0 store_cpu store_redis consume_cpu consume_redis
  seeds=$(seeds_rate)
  redis-cli -p "$rport" flushall > /dev/null
  r0=$(redis_cpu)
  t0=$(now)
  store_cpu=$( ( "$bin" replay -i "$work/calls.csv" --rules "$rules" --store redis --redis-url "$redis" \
    $(mode_flag "$mode") -o "$work/replay-$mode.csv" > /dev/null; times ) | times_cpu)
  t1=$(now)
  store_redis=$(echo "$(redis_cpu) - $r0" | bc -l)
  store_rate=$(echo "$events / ($t1 - $t0)" | bc -l)
  redis-cli -p "$rport" flushall > /dev/null
  r0=$(redis_cpu)
  "$bin" consume --brokers "$brokers" --redis-url "$redis" --rules "$rules" \
    $(mode_flag "$mode") --group "callguard-e2e-$mode$tag" \
    --decisions-topic "call-decisions-$mode" --features-topic "call-features-$mode" \
    --metrics-addr "127.0.0.1:$mport" ${CONSUME_ARGS:-} > "$work/consume-$mode.log" 2>&1 &
  local cpid=$!
  track "$cpid"
  t0=""
  for _ in $(seq 1 6000); do
    n=$(decided)
    if [ -z "$t0" ] && [ "$n" -gt 0 ]; then t0=$(now); n0=$n; fi
    [ "$n" -ge "$events" ] && break
    sleep 0.05
  done
  t1=$(now)
  consume_cpu=$(proc_cpu "$cpid")
  consume_redis=$(echo "$(redis_cpu) - $r0" | bc -l)
  e2e_rate=$(echo "($n - $n0) / ($t1 - $t0)" | bc -l)
  printf '| what | events/s |\n|---|---|\n'
  printf '| the seeds'"'"' one-key sliding script (redis-benchmark, P 256, 8 clients, 100,000 callers) | %.0f |\n' "$seeds"
  printf '| replay --store redis --redis-mode %s (the store) | %.0f |\n' "$mode" "$store_rate"
  printf '| consume, tansu + redis (from the first decision) | %.0f |\n' "$e2e_rate"
  printf 'ratio replay --store redis / the seeds'"'"' script: %.2f\n' "$(echo "$store_rate / $seeds" | bc -l)"
  printf 'ratio consume / store: %.2f (decided %s of %s)\n' "$(echo "$e2e_rate / $store_rate" | bc -l)" "$n" "$events"
  echo "consume: $(batches), over $(printf '%.2f' "$(echo "$t1 - $t0" | bc -l)") s"
  if [ -n "$tag" ]; then
    # How the aggregate rule's counters got their credits (no Redis call
    # for kind="reserve").
    echo "consume: counters by way: $(curl -s "http://127.0.0.1:$mport/metrics" \
      | awk -F'[{}"]' '/^callguard_lease_counters_total/ {printf "%s %s; ", $3, $5}')"
  fi
  # CPU per event: steadier than events/s on a machine whose speed moves
  # (the broker's own CPU is not counted).
  echo "CPU µs per event: store $(per_event "$store_cpu" "$store_redis"); consume $(per_event "$consume_cpu" "$consume_redis")"
  kill "$cpid" 2>/dev/null || true
  wait "$cpid" 2>/dev/null || true
}
for mode in $modes; do
  e2e "$mode"
  # MODEL_RULES=FILE: section 2 again on a rule set with a [model] (scripts/bench-model.sh).
  if [ -n "${MODEL_RULES:-}" ]; then e2e "$mode" "$MODEL_RULES" "-model"; fi
done
# AGGREGATE=1: section 2 again with a rule keyed by callee added, then with
# a global rule over every call added instead (issue #30).
if [ "${AGGREGATE:-0}" = 1 ]; then
  cp data/rules.toml "$work/rules-callee.toml"
  printf '\n[[rule]]\nname = "tdos"\nkey = "callee"\nkind = "fixed"\nwindow = "10s"\nlimit = 50\n' \
    >> "$work/rules-callee.toml"
  # The global rule twice: per second (the generated day is thin, a few
  # calls per 1-s bucket: nearly every call meets a new counter) and per
  # minute (hundreds of calls per bucket, as a live stream's seconds hold).
  for w in 1s 1m; do
    cp data/rules.toml "$work/rules-global-$w.toml"
    printf '\n[[rule]]\nname = "all"\nkey = "global"\nkind = "fixed"\nwindow = "%s"\nlimit = 1000000\n' \
      "$w" >> "$work/rules-global-$w.toml"
  done
  for mode in $modes; do
    e2e "$mode" "$work/rules-callee.toml" "-callee"
    e2e "$mode" "$work/rules-global-1s.toml" "-global-1s"
    e2e "$mode" "$work/rules-global-1m.toml" "-global-1m"
  done
fi

# ENDS=1: consume over attempts alone against attempts and their ends
# (one end per attempt, `produce --ends`), on data/rules.toml with a
# concurrent rule added (a rule set without one answers ends without
# Redis): events/s of each, counting ends as events, and the ratio
# (issue #52's target: >= 0.8).
ends_run() {
  local mode="$1" topic="$2" want="$3" tag="$4"
  redis-cli -p "$rport" flushall > /dev/null
  "$bin" consume --brokers "$brokers" --redis-url "$redis" --rules "$ends_rules" \
    $(mode_flag "$mode") --group "callguard-ends-$mode-$tag" --input-topic "$topic" \
    --decisions-topic "call-decisions-$mode" --features-topic "call-features-$mode" \
    --metrics-addr "127.0.0.1:$mport" ${CONSUME_ARGS:-} > "$work/consume-ends-$mode.log" 2>&1 &
  local cpid=$! t0="" t1 n n0 done_
  track "$cpid"
  for _ in $(seq 1 6000); do
    n=$(handled)
    if [ -z "$t0" ] && [ "$n" -gt 0 ]; then t0=$(now); n0=$n; fi
    [ "$n" -ge "$want" ] && break
    sleep 0.05
  done
  t1=$(now)
  ends_rate=$(echo "($n - $n0) / ($t1 - $t0)" | bc -l)
  printf '| %s | %s | %.0f |\n' "$tag" "$n" "$ends_rate"
  kill "$cpid" 2>/dev/null || true
  wait "$cpid" 2>/dev/null || true
}
# Decided calls and applied ends so far.
handled() { { curl -s "127.0.0.1:$mport/metrics" || true; } | awk '/^callguard_(events|call_ends)_total/ {s += $NF} END {print s+0}'; }
if [ "${ENDS:-0}" = 1 ]; then
  # Another rule set (with a concurrent or sum rule) is read where it is,
  # its callees and rates files beside it.
  ends_rules="$work/rules-channels.toml"
  if [ -n "${ENDS_RULES:-}" ]; then
    ends_rules="$(realpath "$ENDS_RULES")"
  else
    cp data/rules.toml "$ends_rules"
    printf '\n[[rule]]\nname = "channels"\nkind = "concurrent"\nlimit = 10\nmax_duration = "2h"\n' \
      >> "$ends_rules"
  fi
  tansu topic create calls-ends --partitions 4 --broker "tcp://$brokers" >/dev/null
  "$bin" produce --ends -i "$work/calls.csv" --brokers "$brokers" --topic calls-ends > "$work/produce-ends.log"
  with_ends=$(awk '/produced/ {print $2}' "$work/produce-ends.log")
  for mode in $modes; do
    echo
    echo "# 2b. Calls and their ends, $events calls ($with_ends events with ends), ${ENDS_RULES:-data/rules.toml + a concurrent rule}, --redis-mode $mode"
    printf '| input | events handled | events/s |\n|---|---|---|\n'
    ends_run "$mode" calls "$events" "attempts alone"
    alone=$ends_rate
    ends_run "$mode" calls-ends "$with_ends" "attempts and ends"
    printf 'ratio with ends / attempts alone: %.2f\n' "$(echo "$ends_rate / $alone" | bc -l)"
  done
fi

# latency RATE TOPIC GROUP: loadgen offers RATE events/s for $seconds s to
# TOPIC while a fresh consume (group GROUP, the defaults) decides them; then
# the latency of every decision record.
latency() {
  local r="$1" topic="$2" group="$3" mode="$4"
  echo
  local how="--redis-mode $mode" store_flags="--redis-url $redis $(mode_flag "$mode")"
  if [ "$mode" = memory ]; then how="--store memory (no Redis)"; store_flags="--store memory"; fi
  echo "# 3. Latency at $r events/s for $seconds s (loadgen -> consume -> decision record), $how"
  redis-cli -p "$rport" flushall > /dev/null
  "$bin" consume --brokers "$brokers" $store_flags --rules data/rules.toml \
    --input-topic "$topic" --decisions-topic "$topic-decisions" --features-topic "$topic-features" \
    --dlq-topic "$topic-dlq" --group "$group" --metrics-addr "127.0.0.1:$mport" \
    ${CONSUME_ARGS:-} > "$work/consume-$topic.log" 2>&1 &
  local pid=$!
  track "$pid"
  # The floor: the same events arriving at a plain consumer with
  # callguard's fetch setting, measured beside it.
  "$ex/decision_latency" "$brokers" "$topic" "$((r * seconds))" 20 --arrival \
    fetch.wait.max.ms=10 > "$work/arrival-$topic.log" 2>&1 &
  local apid=$!
  track "$apid"
  sleep 5
  redis-cli -p "$rport" config resetstat > /dev/null
  local r0
  r0=$(redis_cpu)
  "$ex/loadgen" "$brokers" "$topic" "$r" "$seconds" > "$work/loadgen-$topic.log" 2>&1
  sleep 3
  echo "consume decided $(decided) events"
  echo "consume: $(batches)"
  echo "Redis over the load: CPU $(echo "$r0 $(redis_cpu)" | awk '{printf "%.2f", $2 - $1}') s; by command (a script's own calls counted in it and again by themselves): $(redis_commands)"
  echo "consume's own time per call (read -> records produced): $(quantiles decision_delay_seconds)"
  echo "  of which a batch's wait (first read -> store): $(quantiles batch_wait_seconds); store per batch: $(quantiles store_latency_seconds)"
  "$ex/decision_latency" "$brokers" "$topic-decisions" "$((r * seconds))" 20
  wait "$apid" 2>/dev/null || true
  echo "floor, the events' arrival at a plain consumer: $(cat "$work/arrival-$topic.log")"
  echo "loadgen: $(tail -1 "$work/loadgen-$topic.log")"
  kill "$pid" 2>/dev/null || true
  wait "$pid" 2>/dev/null || true
}
[ "${SKIP_LATENCY:-0}" = 1 ] && exit 0
for mode in $modes; do
  latency "$rate" "load-$mode" "callguard-latency-$mode" "$mode"
  latency "$low" "low-$mode" "callguard-latency-low-$mode" "$mode"
done
if [ "${LATENCY_MEMORY:-0}" = 1 ]; then
  latency "$rate" "load-memory" "callguard-latency-memory" memory
  latency "$low" "low-memory" "callguard-latency-low-memory" memory
fi
