#!lua
-- callguard commit script: writes back window state that callguard decided
-- in process, for several callers, each only if nobody else wrote it since
-- it was read (optimistic concurrency on a version).
--
-- Used by the cached Redis store (src/store/cached.rs, `--redis-mode
-- cached`): callguard keeps its callers' window state in memory, decides a
-- batch there with the reference engine (src/engine/window.rs), and sends
-- one call per group of callers. A caller whose version changed is not
-- written; its current state is returned so callguard re-reads it, decides
-- that caller's calls again and commits again. Never reads the Redis clock.
--
-- Layout, per caller (keys hash-tagged by the caller):
--   <prefix>{<caller>}:s  string: 8 bytes of version (a random token, new
--                at every write), one byte of form (0: records inline,
--                1: records in :r), the window state's length (LEB128
--                varint) and CallerState::pack's binary form, then, when
--                inline, each record as (varint length, call id, varint
--                length, record). Records are in the window script's
--                reply form (src/engine/record.rs REPLY_FIELDS) and leave
--                past the idempotency horizon. A new caller is created
--                with its TTL, only if absent (`SET ... NX PX`); when it
--                needs nothing else (no log or records apart, no block
--                key) callguard sends that SET itself, with GET, outside
--                this script.
--   <prefix>{<caller>}:r  hash call id -> record, while the caller holds
--                more records than fit inline (a busy caller's: each
--                write then adds its new records instead of rewriting all)
--   <prefix>{<caller>}:l  the sliding log, when kept apart from the state
--                (a flooding caller's): its times as 8-byte little-endian
--                integers, appended to; the first ones may be trimmed
--                already (the state says how many)
--   <prefix>block:{<caller>}  the block key, as with the window script
--
-- KEYS, per caller i: the state string, the block key, the log, the
--   records hash (same hash tag).
-- ARGV, per caller i, in KEYS order:
--   expected version (8 bytes; '' when callguard believes the key absent),
--   TTL to set (ms; '' to keep the keys' TTLs, which callguard sends only
--   while the TTL it set last still covers the needed span: the
--   idempotency horizon, or the retention when records are not kept, plus
--   the slack; never '' with an empty expected version), the new string,
--   log operation ('' log in the state, no string; K keep the string;
--   A append the bytes; S set the string to the bytes; D delete the
--   string), bytes,
--   records operation ('' records inline, no hash; H the hash: set and
--   delete the records below; S records moved out: the hash replaced by
--   the records set below; D records moved inline: delete the hash),
--   s = number of records to set, d = number of records to delete, block
--   reason ('' for none), block TTL (ms), then s pairs (call id, record),
--   then d call ids.
-- Returns: a flat array, per caller that was not written: its index
--   (0-based, in KEYS order), its state string (nil when none), its
--   records hash as HGETALL returns it and its log string (nil when none).
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
for i = 1, #KEYS / 4 do
  local key, bkey, lkey, rkey = KEYS[4 * i - 3], KEYS[4 * i - 2], KEYS[4 * i - 1], KEYS[4 * i]
  local expected, ttl, value = ARGV[a], ARGV[a + 1], ARGV[a + 2]
  local lop, lbytes, rop = ARGV[a + 3], ARGV[a + 4], ARGV[a + 5]
  local s, d = tonumber(ARGV[a + 6]), tonumber(ARGV[a + 7])
  local reason, bttl = ARGV[a + 8], ARGV[a + 9]
  local sets = a + 10
  local dels = sets + 2 * s
  a = dels + d
  local written
  if expected == '' then
    written = call('SET', key, value, 'NX', 'PX', ttl)
  elseif call('GETRANGE', key, 0, 7) == expected then
    if ttl ~= '' then
      written = call('SET', key, value, 'PX', ttl)
    else
      written = call('SET', key, value, 'KEEPTTL')
    end
  end
  if not written then
    out[#out + 1] = i - 1
    out[#out + 1] = call('GET', key)
    out[#out + 1] = call('HGETALL', rkey)
    out[#out + 1] = call('GET', lkey)
  else
    if rop == 'S' then call('DEL', rkey) end
    if rop == 'H' or rop == 'S' then
      if s > 0 then chunked('HSET', rkey, sets, dels - 1) end
      if d > 0 then chunked('HDEL', rkey, dels, a - 1) end
      if ttl ~= '' then call('PEXPIRE', rkey, ttl) end
    elseif rop == 'D' then
      call('DEL', rkey)
    end
    if lop == 'A' then
      call('APPEND', lkey, lbytes)
    elseif lop == 'S' then
      call('SET', lkey, lbytes)
    elseif lop == 'D' then
      call('DEL', lkey)
    end
    if ttl ~= '' and (lop == 'K' or lop == 'A' or lop == 'S') then
      call('PEXPIRE', lkey, ttl)
    end
    if reason ~= '' then call('SET', bkey, reason, 'PX', bttl) end
  end
end
return out
