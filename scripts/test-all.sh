#!/usr/bin/env bash
# Runs every test of callguard on a Debian machine, installing what the tests
# need first: redis-server and redis-sentinel, promtool (prometheus), Chromium
# (the status page's browser test), Kamailio (with its http_client and ndb_redis
# modules) and SIPp (Debian packages), tansu (a Kafka-protocol broker, from
# crates.io) and the notebook's Python packages (in a virtualenv). Safe to
# run again: installed tools are skipped and the build directory is reused.
set -euo pipefail
cd "$(dirname "$0")/.."

export CARGO_TARGET_DIR="${CARGO_TARGET_DIR:-$HOME/.cache/callguard-target}"
export PATH="$HOME/.cargo/bin:$PATH"

as_root() { if [ "$(id -u)" = 0 ]; then "$@"; else sudo "$@"; fi; }

packages=(redis-server redis-sentinel fonts-dejavu-core kamailio kamailio-utils-modules kamailio-redis-modules sip-tester chromium)
missing=()
for p in "${packages[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q '^install ok installed$' || missing+=("$p")
done
if [ "${#missing[@]}" -gt 0 ]; then
  echo "== installing ${missing[*]}"
  as_root apt-get update -qq
  as_root env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${missing[@]}"
fi

# promtool, for the shipped alert rules (tests/it/deploy.rs); without the
# server's recommended extras.
if ! command -v promtool >/dev/null; then
  echo "== installing prometheus (promtool)"
  as_root apt-get update -qq
  as_root env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends prometheus
fi

if ! command -v tansu >/dev/null; then
  echo "== installing tansu (Kafka-protocol broker for the consumer tests; ~11 min once)"
  cargo install tansu --locked --features dynostore,libsql
fi

# The notebook test runs notebooks/threshold_tuning.ipynb with jupyter, and
# the features test reads a Parquet file with pyarrow and polars, from a
# virtualenv of their own (Debian's system Python takes no pip installs).
venv="${CALLGUARD_VENV:-$HOME/.cache/callguard-venv}"
if ! "$venv/bin/python" -c "import polars, pyarrow, matplotlib, nbconvert, nbclient, ipykernel, lightgbm, onnxmltools, onnx, onnxruntime" 2>/dev/null; then
  echo "== installing the notebook's Python packages into $venv"
  if ! python3 -c "import ensurepip, venv" 2>/dev/null; then
    as_root apt-get update -qq
    as_root env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq python3 python3-venv
  fi
  python3 -m venv "$venv"
  "$venv/bin/python" -m pip install -q --upgrade pip
  "$venv/bin/python" -m pip install -q -r notebooks/requirements.txt
fi
export PATH="$venv/bin:$PATH"

echo "== cargo test"
# Tests that need a server installed above fail without it (cargo test
# --lib alone, on a bare machine, skips the library's two that need one).
export CALLGUARD_REQUIRE_SERVERS=1
log="$(mktemp)"
trap 'rm -f "$log"' EXIT
status=0
cargo test --all-targets --no-fail-fast 2>&1 | tee "$log" || status=$?
# One closing line for the whole run (cargo prints one per test binary).
awk '/^test result:/ { for (i = 1; i <= NF; i++) { if ($(i+1) ~ /^passed/) p += $i; if ($(i+1) ~ /^failed/) f += $i } }
     END { printf "tests: %d passed, %d failed\n", p, f }' "$log"
exit "$status"
