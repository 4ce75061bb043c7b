#!/usr/bin/env bash
# Offline benchmark: `callguard tune` (one rule swept over N = 1..200) and
# `callguard features` on a generated call log, beside DuckDB computing the
# same sliding-window counts in the same run (and polars' rolling group-by
# computing the counts). `features` runs twice: the whole feature table (19
# columns), and `--columns call_id,count_minute,count_hour`, the table the
# peers write. Prints wall time and peak memory (max RSS) of each, the
# ratios, and checks that the peers' counts and sweep equal callguard's.
# The six runs go round ROUNDS times (default 3), in turn, so a slow spell
# of a shared machine falls on all of them; each time is the median of its
# rounds, each memory the peak, and each round's ratios are printed too.
# Each run starts after the one before has settled (SETTLE seconds, default
# 5): a run just after a peer's exit was up to 25% slower, whichever tool.
#
#   scripts/bench-offline.sh [ROWS]     (default 10000000; BENCH_DIR=out/bench,
#                                        ROUNDS=3)
set -euo pipefail
cd "$(dirname "$0")/.."
rows="${1:-10000000}"
rounds="${ROUNDS:-3}"
work="${BENCH_DIR:-out/bench}"
export CARGO_TARGET_DIR="${CARGO_TARGET_DIR:-$HOME/.cache/callguard-target}"
venv="${CALLGUARD_VENV:-$HOME/.cache/callguard-venv}"

cargo build --release --quiet
bin="$CARGO_TARGET_DIR/release/callguard"
if ! "$venv/bin/python" -c "import duckdb, polars" 2>/dev/null; then
  python3 -m venv "$venv"
  "$venv/bin/python" -m pip install -q duckdb polars
fi
py="$venv/bin/python"
mkdir -p "$work"
log="$work/calls-$rows.csv"
if [ ! -s "$log" ]; then
  echo "== generating $rows calls"
  "$bin" generate --rows "$rows" --seed 7 --output "$log"
fi
echo "== $(wc -l < "$log") lines, $(du -h "$log" | cut -f1) in $log"

results="$work/results.txt"
: > "$results"
# measure NAME CMD...: wall seconds and max RSS (KiB) of CMD, its output in
# NAME.log; a line `NAME ROUND SECONDS KIB` in the results.
measure() {
  local name="$1"
  shift
  sync
  sleep "${SETTLE:-5}"
  /usr/bin/time -f "%e %M" -o "$work/$name.time" "$@" > "$work/$name.log" 2>&1
  echo "$name $round $(cat "$work/$name.time")" | tee -a "$results"
}

for round in $(seq 1 "$rounds"); do
echo "== round $round of $rounds"
measure callguard-tune "$bin" tune -i "$log" --rule minute:sliding:60s --limits 1..200 \
  -o "$work/callguard-sweep.csv"
measure duckdb-tune "$py" scripts/bench_duckdb.py sweep "$log" "$work/duckdb-sweep.csv"
measure callguard-features "$bin" features -i "$log" \
  --rule minute:sliding:60s:10 --rule hour:sliding:1h:200 -o "$work/callguard-features.parquet"
measure callguard-counts "$bin" features -i "$log" \
  --rule minute:sliding:60s:10 --rule hour:sliding:1h:200 \
  --columns call_id,count_minute,count_hour -o "$work/callguard-counts.parquet"
measure duckdb-features "$py" scripts/bench_duckdb.py counts "$log" "$work/duckdb-counts.parquet"
measure polars-features "$py" scripts/bench_polars.py counts "$log" "$work/polars-counts.parquet"
done

echo "== same results?"
"$py" scripts/bench_duckdb.py check-sweep "$work/callguard-sweep.csv" "$work/duckdb-sweep.csv"
"$py" scripts/bench_duckdb.py check "$work/callguard-features.parquet" "$work/duckdb-counts.parquet"
"$py" scripts/bench_duckdb.py check "$work/callguard-features.parquet" "$work/polars-counts.parquet"
"$py" scripts/bench_duckdb.py check "$work/callguard-counts.parquet" "$work/duckdb-counts.parquet"

echo "== $rows rows, $rounds rounds"
awk '
  { n = ++runs[$1]; t[$1, n] = $3; if ($4 > m[$1]) m[$1] = $4; rt[$2, $1] = $3 }
  function median(k,   i, j, v, c, x) {
    c = runs[k]
    for (i = 1; i <= c; i++) v[i] = t[k, i]
    for (i = 2; i <= c; i++) { x = v[i]; for (j = i - 1; j >= 1 && v[j] > x; j--) v[j + 1] = v[j]; v[j + 1] = x }
    return c % 2 ? v[(c + 1) / 2] : (v[c / 2] + v[c / 2 + 1]) / 2
  }
  function ratio(label, a, b) {
    printf "%s: time ratio %s/%s %.2f, memory ratio %.2f (rounds:", label, a, b, median(a) / median(b), m[a] / m[b]
    for (r = 1; r <= runs[a]; r++) printf " %.2f", rt[r, a] / rt[r, b]
    printf ")\n"
  }
  END {
    printf "%-20s %10s %12s\n", "run", "median s", "peak MiB"
    for (k in runs) printf "%-20s %10.2f %12.0f\n", k, median(k), m[k] / 1024
    ratio("tune", "callguard-tune", "duckdb-tune")
    ratio("features", "callguard-features", "duckdb-features")
    ratio("features", "callguard-features", "polars-features")
    ratio("counts (same columns)", "callguard-counts", "duckdb-features")
    ratio("counts (same columns)", "callguard-counts", "polars-features")
  }' "$results"
