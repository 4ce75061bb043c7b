-- Pools: concurrent rules keyed by account, callee or global
-- (src/engine/pool.rs; `Pools` there is this script's reference, step for
-- step). One call per batch, after the caller's rules decided it: every
-- pool is under one hash tag, so a batch's pools and the calls they hold
-- change together, in processing order, whatever instance sends it.
--
-- Keys (<b> = <prefix>P{pools}, all in one slot):
--   <b>:m   hash: latest (L', the newest attempt seen)
--   <b>:z   zset: "<pool>\n<call>" by close, every call held (for dropping)
--   <b>:h   hash: call -> the pools holding it, "\n"-joined
--   <b>:d   hash: call -> 1 once its end was seen
--   <b>:e   hash: call -> end time, ends of calls not seen yet; <b>:ez by end
--   <b>:r   hash: call -> what it got; <b>:rz by its time
--   <b>:s:<pool>, <b>:c:<pool>   zsets: the pool's calls by start, by close
-- KEYS[1]: <b>:m (the slot the call goes to).
-- ARGV: base (<b>), grace, dedup, max pending ends, ttl (ms, set on every
--   key written), then ops in order:
--   E call ts                                      an end
--   A call ts opening n  (rule pool limit shadow max) * n   an attempt
--   opening: 0 opens nowhere, 1 opens whatever, 2 unless an enforcing
--   pool is over its limit.
-- Reply, per attempt in order: "rule:count:upto_s;..." (upto_s empty when
--   none; before the rule's time profile is applied).

local call, tonumber, tostring = redis.call, tonumber, tostring
local base, grace, dedup = ARGV[1], tonumber(ARGV[2]), tonumber(ARGV[3])
local max_pending, ttl = tonumber(ARGV[4]), ARGV[5]
local M, Z, H, D = base .. ':m', base .. ':z', base .. ':h', base .. ':d'
local E, EZ, R, RZ = base .. ':e', base .. ':ez', base .. ':r', base .. ':rz'
local touched = {}
local function touch(k) touched[k] = true end
-- (Times are whole milliseconds: written as integers, never as %.14g.)
local function int(x) return string.format('%d', x) end

local latest = tonumber(call('HGET', M, 'latest') or '')

local function split(s, sep)
  local out = {}
  for part in string.gmatch(s, '([^' .. sep .. ']+)') do out[#out + 1] = part end
  return out
end

-- Forgets call `c`'s slot in `pool`.
local function drop_slot(c, pool)
  call('ZREM', base .. ':s:' .. pool, c)
  call('ZREM', base .. ':c:' .. pool, c)
  local held = call('HGET', H, c)
  if held then
    local left = {}
    for _, p in ipairs(split(held, '\n')) do
      if p ~= pool then left[#left + 1] = p end
    end
    if #left == 0 then
      call('HDEL', H, c)
      call('HDEL', D, c)
    else
      call('HSET', H, c, table.concat(left, '\n'))
    end
  end
end

-- L' to t if later, and what falls behind it dropped.
local function advance(t)
  if latest == nil or t > latest then latest = t end
  local closed = latest - grace
  local gone = call('ZRANGEBYSCORE', Z, '-inf', int(closed))
  for _, m in ipairs(gone) do
    local nl = string.find(m, '\n', 1, true)
    drop_slot(string.sub(m, nl + 1), string.sub(m, 1, nl - 1))
  end
  if #gone > 0 then call('ZREMRANGEBYSCORE', Z, '-inf', int(closed)) end
  local horizon = latest - dedup
  for _, pair in ipairs({{E, EZ}, {R, RZ}}) do
    local old = call('ZRANGEBYSCORE', pair[2], '-inf', int(horizon))
    if #old > 0 then
      call('HDEL', pair[1], unpack(old))
      call('ZREMRANGEBYSCORE', pair[2], '-inf', int(horizon))
    end
  end
end

-- Calls open in `pool` at t, and the last time s > t a call would still
-- be over `limit` (Pools::count and rejects_until).
local function count(pool, t, limit)
  local S, C = base .. ':s:' .. pool, base .. ':c:' .. pool
  local open = call('ZCOUNT', S, '-inf', int(t)) - call('ZCOUNT', C, '-inf', int(t))
  local upto_s
  if call('ZCOUNT', S, '(' .. int(t), '+inf') == 0 then
    -- Every call started by t: over at s > t while `limit` close after s.
    local k = call('ZREVRANGE', C, limit - 1, limit - 1, 'WITHSCORES')
    if #k == 2 and tonumber(k[2]) - 1 > t then upto_s = tonumber(k[2]) - 1 end
  else
    local starts, closes = {}, {}
    local sv = call('ZRANGE', S, 0, -1, 'WITHSCORES')
    for i = 2, #sv, 2 do starts[#starts + 1] = tonumber(sv[i]) end
    local cv = call('ZRANGE', C, 0, -1, 'WITHSCORES')
    for i = 2, #cv, 2 do closes[#closes + 1] = tonumber(cv[i]) end
    local function upto(list, s)
      local n = 0
      for _, x in ipairs(list) do if x <= s then n = n + 1 end end
      return n
    end
    for i = #closes, 1, -1 do
      local s = closes[i] - 1
      if s > t and upto(starts, s) - upto(closes, s) + 1 > limit then
        upto_s = s
        break
      end
    end
  end
  return open + 1, upto_s
end

local function open_slot(c, pool, start, close)
  if call('ZSCORE', base .. ':s:' .. pool, c) then return end
  call('ZADD', base .. ':s:' .. pool, int(start), c)
  call('ZADD', base .. ':c:' .. pool, int(close), c)
  touch(base .. ':s:' .. pool)
  touch(base .. ':c:' .. pool)
  call('ZADD', Z, int(close), pool .. '\n' .. c)
  local held = call('HGET', H, c)
  call('HSET', H, c, held and (held .. '\n' .. pool) or pool)
end

local function on_end(c, ts)
  local held = call('HGET', H, c)
  if held then
    if call('HSETNX', D, c, 1) == 1 then
      for _, pool in ipairs(split(held, '\n')) do
        local C = base .. ':c:' .. pool
        local start = tonumber(call('ZSCORE', base .. ':s:' .. pool, c))
        local old = tonumber(call('ZSCORE', C, c))
        if start and old then
          local new = math.min(old, math.max(ts, start))
          if new ~= old then
            call('ZADD', C, int(new), c)
            call('ZADD', Z, int(new), pool .. '\n' .. c)
          end
        end
      end
    end
    return
  end
  if call('HEXISTS', R, c) == 1 or call('HEXISTS', E, c) == 1 then return end
  call('HSET', E, c, int(ts))
  call('ZADD', EZ, int(ts), c)
  while call('ZCARD', EZ) > max_pending do
    local first = call('ZPOPMIN', EZ)
    call('HDEL', E, first[1])
  end
end

local out = {}
local i = 6
while i <= #ARGV do
  local op, c, ts = ARGV[i], ARGV[i + 1], tonumber(ARGV[i + 2])
  if op == 'E' then
    on_end(c, ts)
    i = i + 3
  else
    local opening, n = tonumber(ARGV[i + 3]), tonumber(ARGV[i + 4])
    local j = i + 5
    i = j + n * 5
    local known = call('HGET', R, c)
    if known then
      out[#out + 1] = known
    else
      advance(ts)
      local found, over = {}, false
      for k = 0, n - 1 do
        local a = j + k * 5
        local rule, pool, limit = ARGV[a], ARGV[a + 1], tonumber(ARGV[a + 2])
        local shadow = ARGV[a + 3] == '1'
        local cnt, upto_s = count(pool, ts, limit)
        if not shadow and cnt > limit then over = true end
        found[#found + 1] = rule .. ':' .. int(cnt) .. ':' .. (upto_s and int(upto_s) or '')
      end
      if opening == 1 or (opening == 2 and not over) then
        local e = call('HGET', E, c)
        local ended = e ~= false and e ~= nil
        if ended then
          call('HDEL', E, c)
          call('ZREM', EZ, c)
        end
        for k = 0, n - 1 do
          local a = j + k * 5
          local pool, max = ARGV[a + 1], tonumber(ARGV[a + 4])
          local close = ts + max
          if ended then close = math.min(math.max(tonumber(e), ts), close) end
          open_slot(c, pool, ts, close)
        end
        if ended then call('HSET', D, c, 1) end
      end
      local got = table.concat(found, ';')
      call('HSET', R, c, got)
      call('ZADD', RZ, int(ts), c)
      out[#out + 1] = got
    end
  end
end
if latest ~= nil then call('HSET', M, 'latest', int(latest)) end
for _, k in ipairs({M, Z, H, D, E, EZ, R, RZ}) do touch(k) end
for k in pairs(touched) do call('PEXPIRE', k, ttl) end
return out
