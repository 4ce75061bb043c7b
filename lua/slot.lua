-- Reserve slots (src/store/redis/aggregate/slot.rs; what they fence is in
-- src/engine/aggregate/reserve.rs): takes or keeps slot k for an instance
-- and raises the slot's horizon, the end (event time, ms) of the spans its
-- holders spend their reserves in. All keys carry one hash tag.
--
-- KEYS[1]: <prefix>slot:{slots}:n    the number of slots, as the first
--          instance recorded it (every instance follows it).
-- KEYS[2]: <prefix>slot:{slots}:<k>  slot k's holder (its token), with the
--          lease's TTL.
-- KEYS[3]: <prefix>slot:{slots}:<k>:h  slot k's horizon.
-- ARGV: token, slots (the instance's own count, recorded if none is), k,
--   lease ms, horizon wanted (ms; '' to leave it), keep ms (TTL of the
--   count and of the horizon, from each call).
-- Reply: {slots recorded, held (1 or 0), taken now (1; 0: the token held
--   it already), the horizon before ('' if none), the horizon now ('' if
--   none)}. Held 0: k is not a slot, or another instance holds it; nothing
--   was changed but the count's TTL.
-- The horizon only rises, and only for the slot's holder: a holder that
-- lost its slot can no longer raise it, so the next holder's span starts
-- where every span of the slot's earlier holders ended.

local token, k, lease, want, keep = ARGV[1], tonumber(ARGV[3]), ARGV[4], ARGV[5], ARGV[6]
local n = tonumber(redis.call('GET', KEYS[1])) or tonumber(ARGV[2])
redis.call('SET', KEYS[1], n, 'PX', keep)
if k >= n then return {n, 0, 0, '', ''} end
local holder = redis.call('GET', KEYS[2])
local taken = 0
if not holder then
  redis.call('SET', KEYS[2], token, 'PX', lease)
  taken = 1
elseif holder ~= token then
  return {n, 0, 0, '', ''}
else
  redis.call('PEXPIRE', KEYS[2], lease)
end
local before = redis.call('GET', KEYS[3])
local now = before
if want ~= '' and (not before or tonumber(want) > tonumber(before)) then
  now = want
  redis.call('SET', KEYS[3], want, 'PX', keep)
elseif before then
  redis.call('PEXPIRE', KEYS[3], keep)
end
return {n, 1, taken, before or '', now or ''}
