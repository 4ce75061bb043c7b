# Shared by the benchmark and soak scripts (sourced, not run): a scratch
# directory, redis-server and a tansu broker on free loopback ports, all
# stopped and removed on exit.
#
#   source scripts/loopback.sh
#   start_redis       # sets rport; extra redis-server options as arguments
#   start_tansu       # sets kport and brokers
#   track PID         # also stop PID on exit

work="$(mktemp -d)"
pids=()
free_port() { python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])'; }
track() { pids+=("$1"); }
cleanup() { for p in "${pids[@]}"; do kill "$p" 2>/dev/null || true; done; wait 2>/dev/null || true; rm -rf "$work"; }
trap cleanup EXIT

start_redis() {
  rport=$(free_port)
  redis-server --port "$rport" --bind 127.0.0.1 --save "" --appendonly no --dir "$work" \
    --daemonize no "$@" > "$work/redis.log" 2>&1 &
  track $!
  for _ in $(seq 100); do redis-cli -p "$rport" ping >/dev/null 2>&1 && return 0; sleep 0.1; done
  echo "redis-server did not start: $(cat "$work/redis.log")" >&2
  return 1
}

start_tansu() {
  command -v tansu >/dev/null || { echo "tansu is not installed (scripts/test-all.sh installs it)" >&2; return 1; }
  kport=$(free_port)
  brokers="127.0.0.1:$kport"
  # In-memory storage: the benchmarks' consumers read from the beginning
  # and never resume. (tansu 0.6's memory storage serves a fetch from an
  # offset inside a record batch from the next batch on: a consumer resumed
  # there would skip calls. The tests run tansu on sqlite.)
  tansu broker --listener-url "tcp://$brokers" --advertised-listener-url "tcp://$brokers" \
    --storage-engine memory://tansu/ > "$work/tansu.log" 2>&1 &
  track $!
  sleep 2
}
