#!lua
-- callguard commit script: writes back window state that callguard decided
-- in process, for several callers, each only if nobody else wrote it since
-- it was read (optimistic concurrency on a version field).
--
-- Used by the cached Redis store (src/store/cached.rs, `--redis-mode
-- cached`): callguard keeps its callers' window state in memory, decides a
-- batch there with the reference engine (src/engine/window.rs), and sends
-- one call per group of callers. A caller whose version changed is not
-- written; its current state is returned so callguard re-reads it, decides
-- that caller's calls again and commits again. Never reads the Redis clock.
--
-- Layout, per caller (one key, hash-tagged by the caller):
--   <prefix>{<caller>}:s  hash
--     v          version: a random token, new at every commit
--     s          the window state, CallerState::pack's binary form
--     r:<id>     the record of call <id> (idempotency), in the window
--                script's reply form (src/engine/record.rs REPLY_FIELDS);
--                deleted when trimmed past the idempotency horizon
--   <prefix>{<caller>}:l  the sliding log, when kept apart from s (a
--                flooding caller's): its times as 8-byte little-endian
--                integers, appended to; the first ones may be trimmed
--                already (s says how many)
--   <prefix>block:{<caller>}  the block key, as with the window script
--
-- KEYS, per caller i: the state hash, the block key, the log (same hash
--   tag).
-- ARGV, per caller i, in KEYS order:
--   expected version ('' when callguard believes the key absent),
--   TTL to set on the hash (ms; '' to keep its TTL, which callguard sends
--   only while the TTL it set last still covers the needed span: the
--   idempotency horizon, or the retention when records are not kept, plus
--   the slack), new version, packed state,
--   log operation ('' log in s, no string; K keep the string; A append
--   the bytes; S set the string to the bytes; D delete the string), bytes,
--   s = number of records to set,
--   d = number of records to delete, block reason ('' for none),
--   block TTL (ms), then s pairs (field, value), then d fields.
-- Returns: a flat array, per caller that was not written: its index
--   (0-based, in KEYS order), its hash as HGETALL returns it and its log
--   string (nil when none).
-- Needs Redis >= 7.0 (#!lua: refused up front when out of memory, so a
-- call applies all of its writes or none).

local call, tonumber = redis.call, tonumber
local CHUNK = 1000

-- HSET/HDEL of ARGV[first..last] in chunks: Lua's unpack has a stack
-- limit. CHUNK is even, so field/value pairs stay together.
local function chunked(cmd, key, first, last)
  for i = first, last, CHUNK do
    call(cmd, key, unpack(ARGV, i, math.min(i + CHUNK - 1, last)))
  end
end

local a = 1
local out = {}
for i = 1, #KEYS / 3 do
  local key, bkey, lkey = KEYS[3 * i - 2], KEYS[3 * i - 1], KEYS[3 * i]
  local expected, ttl, new, packed = ARGV[a], ARGV[a + 1], ARGV[a + 2], ARGV[a + 3]
  local lop, lbytes = ARGV[a + 4], ARGV[a + 5]
  local s, d = tonumber(ARGV[a + 6]), tonumber(ARGV[a + 7])
  local reason, bttl = ARGV[a + 8], ARGV[a + 9]
  local sets = a + 10
  local dels = sets + 2 * s
  a = dels + d
  local v = call('HGET', key, 'v')
  if (v or '') ~= expected then
    out[#out + 1] = i - 1
    out[#out + 1] = call('HGETALL', key)
    out[#out + 1] = call('GET', lkey)
  else
    if s > 0 and 2 * s <= CHUNK then
      call('HSET', key, 'v', new, 's', packed, unpack(ARGV, sets, dels - 1))
    else
      call('HSET', key, 'v', new, 's', packed)
      if s > 0 then chunked('HSET', key, sets, dels - 1) end
    end
    if d > 0 then chunked('HDEL', key, dels, a - 1) end
    if lop == 'A' then
      call('APPEND', lkey, lbytes)
    elseif lop == 'S' then
      call('SET', lkey, lbytes)
    elseif lop == 'D' then
      call('DEL', lkey)
    end
    if ttl ~= '' then
      call('PEXPIRE', key, ttl)
      if lop == 'K' or lop == 'A' or lop == 'S' then call('PEXPIRE', lkey, ttl) end
    end
    if reason ~= '' then call('SET', bkey, reason, 'PX', bttl) end
  end
end
return out
