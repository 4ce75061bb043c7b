#!/usr/bin/env bash
# A month of call logs offline (not part of the test command): peak memory
# and time of `replay`, `tune` and `features` over D days of one generated
# population, for each D in DAYS (default "3 30"), ROWS calls a day
# (default 1000000), with the default sort budget or SORT_ROWS. A log
# longer than the budget is put in order on disk (docs/offline.md); the
# ratio of the longest to the shortest run's peak says whether memory is
# bounded by the log's length. Needs about 100 bytes of disk a call for the
# log, as much again for the sort's runs, and the outputs.
#
#   ROWS=1000000 DAYS="3 30" [SORT_ROWS=N] scripts/bench-month.sh
set -euo pipefail
cd "$(dirname "$0")/.."
export CARGO_TARGET_DIR="${CARGO_TARGET_DIR:-$HOME/.cache/callguard-target}"
cargo build --release --quiet --bin callguard
bin="${CALLGUARD_BIN:-$CARGO_TARGET_DIR/release/callguard}"
rows="${ROWS:-1000000}"
days="${DAYS:-3 30}"
sort=()
[ -n "${SORT_ROWS:-}" ] && sort=(--sort-rows "$SORT_ROWS")
work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT
rules=data/rules.toml

# "WALL_S PEAK_MB" of a callguard command, and whether it sorted on disk.
measure() {
  /usr/bin/time -f "%e %M" "$bin" "$@" "${sort[@]}" > /dev/null 2> "$work/err" || {
    cat "$work/err" >&2
    exit 1
  }
  local disk=memory
  grep -q "put in time order on disk" "$work/err" && disk=disk
  tail -1 "$work/err" | awk -v d="$disk" '{printf "%.1f s, %.0f MB (%s)", $1, $2 / 1024, d}'
}

echo "| days | rows | replay | tune | features |"
echo "|---|---|---|---|---|"
for d in $days; do
  log="$work/calls-$d.csv"
  "$bin" generate --rows "$rows" --days "$d" --seed 5 -o "$log" > /dev/null
  r=$(measure replay -i "$log" --rules "$rules" -o "$work/dec.parquet")
  t=$(measure tune -i "$log" --rules "$rules" --sweep minute --limits 1..40 \
    --label-column label -o "$work/tune.csv")
  f=$(measure features -i "$log" --rules "$rules" -o "$work/features.parquet")
  echo "| $d | $((rows * d)) | $r | $t | $f |"
  rm -f "$log" "$work"/dec.parquet "$work"/features.parquet
done
