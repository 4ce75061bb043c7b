-- Credits of the rules keyed by callee or global (src/engine/aggregate.rs;
-- MemoryLedger there is this script's reference). One counter per rule,
-- key and bucket; its value is the credits handed out for the bucket, never
-- more than the limit. Event times never reach this script.
--
-- KEYS, per counter: the counter, the previous bucket's counter (all keys
--   of one call share a hash tag: <prefix>g:{<shard>}:...).
-- ARGV, per counter: want, give_back (credits of the previous bucket
--   returned first), approx (1: reply with the previous bucket's count),
--   limit, ttl (ms; set on every grant).
-- Reply, per counter: granted, the counter after, the previous bucket's
--   count (0 unless approx).

local out = {}
for j = 1, #KEYS / 2 do
  local cur_key, prev_key = KEYS[2 * j - 1], KEYS[2 * j]
  local base = (j - 1) * 5
  local want, give = tonumber(ARGV[base + 1]), tonumber(ARGV[base + 2])
  local approx, limit, ttl = ARGV[base + 3] == '1', tonumber(ARGV[base + 4]), ARGV[base + 5]
  if give > 0 then
    local p = tonumber(redis.call('GET', prev_key))
    if p then
      local left = p - give
      if left < 0 then left = 0 end
      redis.call('SET', prev_key, string.format('%d', left), 'KEEPTTL')
    end
  end
  local cur = tonumber(redis.call('GET', cur_key)) or 0
  local prev = 0
  if approx then prev = tonumber(redis.call('GET', prev_key)) or 0 end
  local granted = limit - cur
  if granted > want then granted = want end
  if granted > 0 then
    redis.call('INCRBY', cur_key, granted)
    redis.call('PEXPIRE', cur_key, ttl)
  else
    granted = 0
  end
  out[#out + 1] = granted
  out[#out + 1] = cur + granted
  out[#out + 1] = prev
end
return out
