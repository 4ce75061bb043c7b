#!/usr/bin/env bash
# A month of call logs offline (not part of the test command): peak memory
# and time of `replay`, `tune` and `features` over D days of one generated
# population, for each D in DAYS (default "3 30"), ROWS calls a day
# (default 1000000), with the default sort budget or SORT_ROWS. A log
# longer than the budget is read from the file a second time when it is in
# time order (as generated), else sorted in runs on disk (docs/offline.md);
# the ratio of the longest to the shortest run's peak says whether memory
# is bounded by the log's length. Each command's peak use of the temporary
# directory (the sort's runs and id hashes) is sampled every 0.2 s.
# SHUFFLE=1 shuffles each log's rows first (an unordered log: sorted in
# runs). PARQUET=1 gives each log as Parquet (text columns, converted with
# polars from the notebook's virtualenv, CALLGUARD_VENV). Needs about 100 bytes of disk a call for the log, as much again
# for the sort's runs of an unordered log, and the outputs.
#
#   ROWS=1000000 DAYS="3 30" [SORT_ROWS=N] [SHUFFLE=1] [PARQUET=1] [CALLGUARD_BIN=B] scripts/bench-month.sh
set -euo pipefail
cd "$(dirname "$0")/.."
export CARGO_TARGET_DIR="${CARGO_TARGET_DIR:-$HOME/.cache/callguard-target}"
if [ -z "${CALLGUARD_BIN:-}" ]; then cargo build --release --quiet --bin callguard; fi
bin="${CALLGUARD_BIN:-$CARGO_TARGET_DIR/release/callguard}"
rows="${ROWS:-1000000}"
days="${DAYS:-3 30}"
sort=()
[ -n "${SORT_ROWS:-}" ] && sort=(--sort-rows "$SORT_ROWS")
work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT
export TMPDIR="$work/tmp"
mkdir -p "$TMPDIR"
rules=data/rules.toml

# "WALL_S, PEAK_MB (HOW, TMP_MB)" of a callguard command: how the log was
# put in order (memory, read again, or disk runs) and the peak size of the
# temporary directory.
measure() {
  /usr/bin/time -f "%e %M" "$bin" "$@" "${sort[@]}" > /dev/null 2> "$work/err" &
  local pid=$! tmp=0 now
  while kill -0 "$pid" 2>/dev/null; do
    now=$(du -sm "$TMPDIR" 2>/dev/null | awk '{print $1}')
    [ "${now:-0}" -gt "$tmp" ] && tmp=$now
    sleep 0.2
  done
  wait "$pid" || {
    cat "$work/err" >&2
    exit 1
  }
  local how=memory
  grep -q "read from the file a second time" "$work/err" && how="read again"
  grep -q "put in time order on disk" "$work/err" && how=disk
  tail -1 "$work/err" | awk -v d="$how" -v t="$tmp" '{printf "%.1f s, %.0f MB (%s, tmp %d MB)", $1, $2 / 1024, d, t}'
}

echo "| days | rows | replay | tune | features |"
echo "|---|---|---|---|---|"
for d in $days; do
  log="$work/calls-$d.csv"
  "$bin" generate --rows "$rows" --days "$d" --seed 5 -o "$log" > /dev/null
  if [ -n "${SHUFFLE:-}" ]; then
    { head -1 "$log"; tail -n +2 "$log" | shuf --random-source=<(yes); } > "$log.shuffled"
    mv "$log.shuffled" "$log"
  fi
  if [ -n "${PARQUET:-}" ]; then
    "${CALLGUARD_VENV:-$HOME/.cache/callguard-venv}/bin/python" -c \
      'import sys, polars as pl; pl.scan_csv(sys.argv[1], infer_schema=False).sink_parquet(sys.argv[2])' \
      "$log" "$work/calls-$d.parquet"
    rm -f "$log"
    log="$work/calls-$d.parquet"
  fi
  r=$(measure replay -i "$log" --rules "$rules" -o "$work/dec.parquet")
  t=$(measure tune -i "$log" --rules "$rules" --sweep minute --limits 1..40 \
    --label-column label -o "$work/tune.csv")
  f=$(measure features -i "$log" --rules "$rules" -o "$work/features.parquet")
  echo "| $d | $((rows * d)) | $r | $t | $f |"
  rm -f "$log" "$work"/dec.parquet "$work"/features.parquet
done
