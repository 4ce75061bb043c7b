-- Credits of the rules keyed by callee or global (src/engine/aggregate/mod.rs;
-- MemoryLedger there is this script's reference). One counter per rule,
-- key and bucket, kept as a field of a hash per (shard, rule, window,
-- bucket): its value is the credits handed out for the bucket, never more
-- than the limit. Event times never reach this script. Counters an instance
-- holds nothing of are leased without it, by plain HINCRBY
-- (src/store/redis/aggregate/lease.rs): such an increment can pass the limit for a
-- moment before it is taken back, so a value here may be over the limit
-- (no room: nothing granted).
--
-- KEYS: the hashes the call touches (all of one hash tag:
--   <prefix>g:{<shard>}:<rule>:<W>:<bucket>).
-- ARGV: ttl (ms; set on every hash the call writes), then per counter, 6
--   values: its hash (index into KEYS), the previous bucket's hash (index,
--   0 when not needed), the field (callee, '' for a global rule), want,
--   give_back (credits of the previous bucket returned first), limit.
-- Reply, per counter, in order: granted, the counter after, the previous
--   bucket's count (0 when its hash index is 0).
-- Each hash is read once (HMGET of the fields the call names) and written
-- once (HSET of those it changed): a few Redis calls per script call, not
-- one per counter.

local call, tonumber, fmt = redis.call, tonumber, string.format
local ttl = ARGV[1]
local n = (#ARGV - 1) / 6

-- The fields named per hash, then their values (nil: no such field).
local fields, seen = {}, {}
for k = 1, #KEYS do fields[k], seen[k] = {}, {} end
local function name(k, f)
  if not seen[k][f] then
    seen[k][f] = true
    fields[k][#fields[k] + 1] = f
  end
end
for j = 0, n - 1 do
  local base = 1 + j * 6
  local f = ARGV[base + 3]
  name(tonumber(ARGV[base + 1]), f)
  local pi = tonumber(ARGV[base + 2])
  if pi > 0 then name(pi, f) end
end
local value, dirty = {}, {}
for k = 1, #KEYS do
  value[k], dirty[k] = {}, false
  if #fields[k] > 0 then
    local got = call('HMGET', KEYS[k], unpack(fields[k]))
    for i, f in ipairs(fields[k]) do value[k][f] = tonumber(got[i]) end
  end
end

local out = {}
for j = 0, n - 1 do
  local base = 1 + j * 6
  local ci, pi, f = tonumber(ARGV[base + 1]), tonumber(ARGV[base + 2]), ARGV[base + 3]
  local want, give, limit = tonumber(ARGV[base + 4]), tonumber(ARGV[base + 5]), tonumber(ARGV[base + 6])
  if give > 0 and pi > 0 and value[pi][f] then
    -- Never below zero; a counter that had expired is not made again.
    local left = value[pi][f] - give
    if left < 0 then left = 0 end
    value[pi][f] = left
    dirty[pi] = true
  end
  local cur = value[ci][f] or 0
  local room = limit - cur
  if room < 0 then room = 0 end
  local granted = want
  if granted > room then granted = room end
  if granted > 0 then
    cur = cur + granted
    value[ci][f] = cur
    dirty[ci] = true
  end
  out[#out + 1] = granted
  out[#out + 1] = cur
  out[#out + 1] = pi > 0 and (value[pi][f] or 0) or 0
end

for k = 1, #KEYS do
  if dirty[k] then
    local set = {}
    for _, f in ipairs(fields[k]) do
      local v = value[k][f]
      if v then
        set[#set + 1] = f
        set[#set + 1] = fmt('%d', v)
      end
    end
    call('HSET', KEYS[k], unpack(set))
    call('PEXPIRE', KEYS[k], ttl)
  end
end
return out
