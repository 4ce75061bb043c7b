#!lua
-- callguard commit script: writes back window state that callguard decided
-- in process, for several callers, each only if nobody else wrote it since
-- it was read (optimistic concurrency on a version).
--
-- Used by the cached Redis store (src/store/cached/mod.rs, `--redis-mode
-- cached`): callguard keeps its callers' window state in memory, decides a
-- batch there with the reference engine (src/engine/window/mod.rs), and sends
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
-- KEYS, per caller i, in order: the state string; the log, when the log
--   operation is not '-'; the records hash, when the records operation is
--   not '-'; the block key, when blocking (all under one hash tag). A
--   write declares only the keys it touches: most touch one.
-- ARGV, per caller i, in KEYS order of callers:
--   head: 4 bytes of flags, then the expected version (8 bytes) unless
--     callguard believes the caller absent (the head is then 4 bytes and
--     the string is created only if absent, with its TTL):
--     1. log operation: '-' log in the state, no string; K keep the
--        string; A append the bytes below; S set the string to them;
--        D delete the string; C (with the other flags '-', an empty new
--        string and an expected version) only check the version: write
--        nothing, and refuse as usual if it changed (a batch of calls
--        already decided);
--     2. records operation: '-' records inline, no hash; H the hash: set
--        and delete the records below; S records moved out: the hash
--        replaced by the records set below; D records moved inline:
--        delete the hash (UNLINK: a flood's hash is freed off the main
--        thread);
--     3. 'B' to set the block key, else '-';
--     4. 'T' to set the TTL below, else '-' to keep the keys' TTLs (which
--        callguard does only while the TTL it set last still covers the
--        needed span: the idempotency horizon, or the retention when
--        records are not kept, plus the slack; always 'T' for a caller
--        believed absent);
--   the new state string;
--   then, only when its flag asks for it, in this order: the TTL (ms);
--   the log's bytes (A, S); the block reason and the block TTL (ms);
--   s = records to set, d = records to delete, s pairs (call id, record),
--   d call ids (H, S).
-- Returns: a flat array, per caller that was not written: its index
--   (0-based, in call order) and its state string (nil when none).
--   callguard reads a log or records kept apart back itself when that
--   string says there are any.
-- Needs Redis >= 7.0 (#!lua: refused up front when out of memory, so a
-- call applies all of its writes or none).

local call, tonumber, byte, sub = redis.call, tonumber, string.byte, string.sub
local CHUNK = 1000
local DASH, K, A, S, D, H, B, T, C = byte('-KASDHBTC', 1, 9)

-- HSET/HDEL of ARGV[first..last] in chunks: Lua's unpack has a stack
-- limit. CHUNK is even, so field/value pairs stay together.
local function chunked(cmd, key, first, last)
  for i = first, last, CHUNK do
    call(cmd, key, unpack(ARGV, i, math.min(i + CHUNK - 1, last)))
  end
end

local a, k, i = 1, 1, 0
local out = {}
while k <= #KEYS do
  local head, value = ARGV[a], ARGV[a + 1]
  a = a + 2
  local lop, rop, blk, ttlf = byte(head, 1, 4)
  local key = KEYS[k]
  k = k + 1
  local lkey, rkey, bkey, ttl, lbytes, reason, bttl
  if lop ~= DASH and lop ~= C then lkey = KEYS[k]; k = k + 1 end
  if rop ~= DASH then rkey = KEYS[k]; k = k + 1 end
  if blk == B then bkey = KEYS[k]; k = k + 1 end
  if ttlf == T then ttl = ARGV[a]; a = a + 1 end
  if lop == A or lop == S then lbytes = ARGV[a]; a = a + 1 end
  if blk == B then reason, bttl = ARGV[a], ARGV[a + 1]; a = a + 2 end
  local sets, dels, last = a, a, a - 1
  if rop == H or rop == S then
    local s, d = tonumber(ARGV[a]), tonumber(ARGV[a + 1])
    sets = a + 2
    dels = sets + 2 * s
    last = dels + d - 1
    a = last + 1
  end
  local written, found
  if lop == C then
    written = call('GETRANGE', key, 0, 7) == sub(head, 5, 12)
  elseif #head == 4 then
    written = call('SET', key, value, 'NX', 'PX', ttl)
  elseif ttl then
    if call('GETRANGE', key, 0, 7) == sub(head, 5, 12) then
      written = call('SET', key, value, 'PX', ttl)
    end
  else
    -- The common write: one call that writes and returns what it
    -- replaced (each call from a script costs Redis about as much as
    -- a command from a client). Another writer's state is put back as
    -- it was, TTL and all (KEEPTTL kept it); a key that was absent is
    -- removed again.
    found = call('SET', key, value, 'KEEPTTL', 'GET')
    written = found and sub(found, 1, 8) == sub(head, 5, 12)
    if not written then
      if found then call('SET', key, found, 'KEEPTTL') else call('DEL', key) end
    end
  end
  if not written then
    out[#out + 1] = i
    if found == nil then found = call('GET', key) end
    out[#out + 1] = found
  elseif lop ~= C then
    if rop == S then call('UNLINK', rkey) end
    if rop == H or rop == S then
      if dels > sets then chunked('HSET', rkey, sets, dels - 1) end
      if last >= dels then chunked('HDEL', rkey, dels, last) end
      if ttl then call('PEXPIRE', rkey, ttl) end
    elseif rop == D then
      call('UNLINK', rkey)
    end
    if lop == A then
      call('APPEND', lkey, lbytes)
    elseif lop == S then
      call('SET', lkey, lbytes)
    elseif lop == D then
      call('UNLINK', lkey)
    end
    if ttl and (lop == K or lop == A or lop == S) then
      call('PEXPIRE', lkey, ttl)
    end
    if blk == B then call('SET', bkey, reason, 'PX', bttl) end
  end
  i = i + 1
end
return out
