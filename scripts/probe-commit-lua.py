#!/usr/bin/env python3
"""What a caller's write costs Redis inside the commit script.

Usage: scripts/probe-commit-lua.py PORT [CALLS]

Against a redis-server on 127.0.0.1:PORT (a scratch one: it writes keys
under `probe:` and resets the command statistics), sends CALLS (default
2,000) `EVALSHA` calls of 64 callers each (one key and two arguments per
caller, a 308-byte state string, as the cached store's common write) for
four scripts, and prints Redis's time per call and per caller from
`INFO commandstats`:

  noop    returns at once: the cost of handing the keys and arguments to Lua;
  loop    reads each caller's arguments and flags;
  set     one `SET key value KEEPTTL GET` per caller, nothing else;
  commit  lua/commit.lua itself, every caller's version as expected.

Standard library only (the RESP protocol written by hand, no client).
"""

import os
import socket
import sys
import time

CALLERS = 64
BATCH = 50

SCRIPTS = {
    "noop": "return 0",
    "loop": (
        "local a = 1 "
        "for k = 1, #KEYS do "
        "  local head, value = ARGV[a], ARGV[a + 1] a = a + 2 "
        "  local x, y, z, w = string.byte(head, 1, 4) "
        "end "
        "return {}"
    ),
    "set": (
        "local a = 1 "
        "for k = 1, #KEYS do "
        "  redis.call('SET', KEYS[k], ARGV[a + 1], 'KEEPTTL', 'GET') a = a + 2 "
        "end "
        "return {}"
    ),
}


def encode(*args):
    """One command in RESP."""
    out = [b"*%d\r\n" % len(args)]
    for a in args:
        if isinstance(a, str):
            a = a.encode()
        elif isinstance(a, int):
            a = str(a).encode()
        out.append(b"$%d\r\n%s\r\n" % (len(a), a))
    return b"".join(out)


class Conn:
    def __init__(self, port):
        self.sock = socket.create_connection(("127.0.0.1", port))
        self.file = self.sock.makefile("rb")

    def reply(self):
        line = self.file.readline()
        kind, body = line[:1], line[1:-2]
        if kind == b"-":
            raise RuntimeError(body.decode())
        if kind in b"+:":
            return body
        if kind == b"$":
            n = int(body)
            return None if n < 0 else self.file.read(n + 2)[:-2]
        if kind == b"*":
            return [self.reply() for _ in range(max(int(body), 0))]
        raise RuntimeError(f"unexpected reply {line!r}")

    def call(self, *args):
        self.sock.sendall(encode(*args))
        return self.reply()


def evalsha_usec_per_call(conn):
    stats = conn.call("INFO", "commandstats").decode()
    for line in stats.split("\r\n"):
        if line.startswith("cmdstat_evalsha:"):
            return float(line.split("usec_per_call=")[1].split(",")[0])
    raise RuntimeError("no EVALSHA in INFO commandstats")


def main():
    if len(sys.argv) < 2:
        sys.exit(__doc__)
    port = int(sys.argv[1])
    calls = int(sys.argv[2]) if len(sys.argv) > 2 else 2000
    here = os.path.dirname(os.path.abspath(__file__))
    with open(os.path.join(here, "..", "lua", "commit.lua")) as f:
        scripts = dict(SCRIPTS, commit=f.read())
    conn = Conn(port)
    version = b"\x01" * 8
    state = version + os.urandom(300)
    keys = [f"probe:{{c{i}}}:s" for i in range(CALLERS)]
    # Flags '----' (state inline, no records apart, no block, TTL kept),
    # then the expected version: the common write.
    args = []
    for _ in keys:
        args += [b"----" + version, state]
    print(f"{CALLERS} callers per call, {calls} calls per script")
    for name, text in scripts.items():
        sha = conn.call("SCRIPT", "LOAD", text).decode()
        for k in keys:
            conn.call("SET", k, state)
        conn.call("CONFIG", "RESETSTAT")
        payload = encode("EVALSHA", sha, CALLERS, *keys, *args) * BATCH
        start = time.monotonic()
        for _ in range(calls // BATCH):
            conn.sock.sendall(payload)
            for _ in range(BATCH):
                conn.reply()
        wall = time.monotonic() - start
        us = evalsha_usec_per_call(conn)
        print(
            f"{name:7s} {us:7.1f} µs a call, {us / CALLERS:5.2f} µs a caller "
            f"(wall {wall * 1e6 / (calls // BATCH * BATCH) / CALLERS:5.2f})"
        )


if __name__ == "__main__":
    main()
