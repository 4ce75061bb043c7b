#!/usr/bin/env bash
# Offline benchmark: `callguard tune` (one rule swept over N = 1..200) and
# `callguard features` on a generated call log, beside DuckDB computing the
# same sliding-window counts in the same run (and polars' rolling group-by
# computing the counts). `features` runs twice: the whole feature table (19
# columns), and `--columns call_id,count_minute,count_hour`, the table the
# peers write. Prints wall time and peak memory (max RSS) of each, the
# ratios, and checks that the peers' counts and sweep equal callguard's.
#
#   scripts/bench-offline.sh [ROWS]     (default 10000000; BENCH_DIR=out/bench)
set -euo pipefail
cd "$(dirname "$0")/.."
rows="${1:-10000000}"
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
# measure NAME CMD...: wall seconds and max RSS (KiB) of CMD, its output in NAME.log.
measure() {
  local name="$1"
  shift
  /usr/bin/time -f "%e %M" -o "$work/$name.time" "$@" > "$work/$name.log" 2>&1
  echo "$name $(cat "$work/$name.time")" | tee -a "$results"
}

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

echo "== same results?"
"$py" scripts/bench_duckdb.py check-sweep "$work/callguard-sweep.csv" "$work/duckdb-sweep.csv"
"$py" scripts/bench_duckdb.py check "$work/callguard-features.parquet" "$work/duckdb-counts.parquet"
"$py" scripts/bench_duckdb.py check "$work/callguard-features.parquet" "$work/polars-counts.parquet"
"$py" scripts/bench_duckdb.py check "$work/callguard-counts.parquet" "$work/duckdb-counts.parquet"

echo "== $rows rows"
awk '{ t[$1] = $2; m[$1] = $3 }
  END {
    printf "%-20s %10s %12s\n", "run", "wall s", "peak MiB"
    for (k in t) printf "%-20s %10.1f %12.0f\n", k, t[k], m[k] / 1024
    printf "tune:     time ratio callguard/duckdb %.2f, memory ratio %.2f\n",
      t["callguard-tune"] / t["duckdb-tune"], m["callguard-tune"] / m["duckdb-tune"]
    printf "features: time ratio callguard/duckdb %.2f, memory ratio %.2f\n",
      t["callguard-features"] / t["duckdb-features"], m["callguard-features"] / m["duckdb-features"]
    printf "features: time ratio callguard/polars %.2f, memory ratio %.2f\n",
      t["callguard-features"] / t["polars-features"], m["callguard-features"] / m["polars-features"]
    printf "counts (same columns): time ratio callguard/duckdb %.2f, memory ratio %.2f\n",
      t["callguard-counts"] / t["duckdb-features"], m["callguard-counts"] / m["duckdb-features"]
    printf "counts (same columns): time ratio callguard/polars %.2f, memory ratio %.2f\n",
      t["callguard-counts"] / t["polars-features"], m["callguard-counts"] / m["polars-features"]
  }' "$results"
