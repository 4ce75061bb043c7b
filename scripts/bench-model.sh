#!/usr/bin/env bash
# Model benchmark (not part of the test command): what scoring every call
# with a 200-tree, depth-6 LightGBM model (ONNX) costs. In one run:
#   1. trains the model (notebooks/model.py, the notebook's packages) on the
#      features of a generated day with low-and-slow dialers, and writes
#      data/rules.toml with it as [model] (in shadow: the decisions are the
#      rules', so the two runs decide alike and only the scoring differs);
#   2. scoring: `callguard features` on ROWS generated calls (default
#      1000000) without and with the model, alternating, 3 rounds: wall
#      time and the process's CPU time; the CPU time the model adds per
#      call (scoring, batched per chunk on every shard's thread);
#   3. with CONSUME=1, section 2 of scripts/bench-online.sh (consume end to
#      end, tansu + Redis, default mode) on data/rules.toml and on the rules
#      with the model, in that script's one run (MODEL_RULES);
#   4. with SERVE=1, scripts/bench-serve.sh (cached mode) on each rule set.
# Prints the release binary's size, as built and stripped.
#
#   scripts/bench-model.sh [ROWS]
set -euo pipefail
cd "$(dirname "$0")/.."
rows="${1:-1000000}"
export CARGO_TARGET_DIR="${CARGO_TARGET_DIR:-$HOME/.cache/callguard-target}"
cargo build --release --quiet --bin callguard
bin="${CALLGUARD_BIN:-$CARGO_TARGET_DIR/release/callguard}"
py="${PYTHON:-python3}"
work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT
inputs="count_burst,count_minute,count_hour,since_prev_ms,distinct_callees,local_hour"

echo "# 1. The model"
"$bin" generate --rows 200000 --low-and-slow 20 --seed 3 -o "$work/train.csv" > /dev/null
"$bin" features -i "$work/train.csv" --rules data/rules.toml -o "$work/train.parquet" > /dev/null
"$py" notebooks/model.py train "$work/train.parquet" "$work/model.onnx" --inputs "$inputs" --trees 200 --depth 6
cp data/rules.toml "$work/rules-model.toml"
cat >> "$work/rules-model.toml" <<TOML

[model]
path = "model.onnx"
inputs = ["${inputs//,/\", \"}"]
threshold = 0.9
shadow = true
TOML
ls -l "$work/model.onnx" | awk '{print "model file: " $5 " bytes"}'

echo
echo "# 2. Scoring: callguard features on $rows calls, without and with the model"
"$bin" generate --rows "$rows" --seed 11 -o "$work/calls.csv" > /dev/null
run() { # RULES -> "wall cpu" seconds
  /usr/bin/time -f "%e %U %S" "$bin" features -i "$work/calls.csv" --rules "$1" \
    -o "$work/f.parquet" 2>&1 >/dev/null | tail -1 | awk '{printf "%s %.2f", $1, $2 + $3}'
}
printf '| round | without: wall s | CPU s | with: wall s | CPU s | CPU µs per call added |\n|---|---|---|---|---|---|\n'
for round in 1 2 3; do
  read -r w0 c0 <<< "$(run data/rules.toml)"
  read -r w1 c1 <<< "$(run "$work/rules-model.toml")"
  printf '| %s | %s | %s | %s | %s | %.2f |\n' "$round" "$w0" "$c0" "$w1" "$c1" \
    "$(echo "($c1 - $c0) * 1000000 / $rows" | bc -l)"
done

if [ "${CONSUME:-0}" = 1 ]; then
  echo
  echo "# 3. consume without and with the model"
  MODES=default SKIP_STORE=1 SKIP_LATENCY=1 MODEL_RULES="$work/rules-model.toml" \
    scripts/bench-online.sh "${CONSUME_EVENTS:-300000}"
fi
if [ "${SERVE:-0}" = 1 ]; then
  echo
  echo "# 4. serve without and with the model"
  MODES=cached scripts/bench-serve.sh "${SERVE_SECS:-10}"
  MODES=cached RULES="$work/rules-model.toml" scripts/bench-serve.sh "${SERVE_SECS:-10}"
fi

echo
size=$(stat -c %s "$bin")
strip -o "$work/stripped" "$bin"
echo "release binary: $size bytes as built, $(stat -c %s "$work/stripped") bytes stripped"
