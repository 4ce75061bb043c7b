-- Pools: concurrent and sum rules keyed by account, callee or global
-- (src/engine/pool.rs; `Pools` there is this script's reference, step for
-- step; a sum pool's window is src/engine/window/sums.rs's `Sums`, its
-- arithmetic lua/sums.lua's, loaded in front of this script). One call
-- per batch, after the caller's rules decided it: every
-- pool is under one hash tag, so a batch's pools and the calls they hold
-- change together, in processing order, whatever instance sends it.
--
-- Keys (<b> = <prefix>P{pools}, all in one slot):
--   <b>:m   hash: latest (the newest attempt any pool has seen: the
--          horizon of ends kept and of what calls got)
--   <b>:h   hash: call -> the pools holding it, "\n"-joined
--   <b>:d   hash: call -> 1 once its end was seen
--   <b>:e   hash: call -> end time, ends of calls not seen yet; <b>:ez by end
--   <b>:r   hash: call -> "<time>#<what it got>"; <b>:rz by its time
--   <b>:l:<pool>   the newest attempt the pool has seen (its own L')
--   <b>:s:<pool>, <b>:c:<pool>   zsets: the pool's calls by start, by close
--   <b>:sw:<pool>  hash: call -> "start|max|costed|per|inc|kind|w", the
--          calls a sum pool waits on; <b>:wz:<pool> zset by start + max
--   <b>:sb:<pool>  hash: bucket -> sum added in it (fixed, sliding-approx)
--   <b>:se:<pool>  zset: "<amount>|<seq>" by the time it was added (sliding)
-- KEYS[1]: <b>:m (the slot the call goes to).
-- ARGV: base (<b>), grace, dedup, max pending ends, ttl (ms, set on every
--   key written), then ops in order:
--   E call ts talk                                an end
--   A call ts opening n  (rule pool limit shadow max sum kind w per inc) * n
--                                                 an attempt
--   sum: 0 a concurrent pool, 1 a talk sum, 2 a cost sum; kind F, S or A
--   (fixed, sliding, sliding-approx); per and inc the callee's price (''
--   unpriced).
--   opening: 0 opens nowhere, 1 opens whatever, 2 unless an enforcing
--   pool is over its limit.
-- Reply, per attempt in order: "rule:count:upto_s;..." (upto_s empty when
--   none; before the rule's time profile is applied).

local call, tonumber, tostring = redis.call, tonumber, tostring
local base, grace, dedup = ARGV[1], tonumber(ARGV[2]), tonumber(ARGV[3])
local max_pending, ttl = tonumber(ARGV[4]), ARGV[5]
local M, H, D = base .. ':m', base .. ':h', base .. ':d'
local E, EZ, R, RZ = base .. ':e', base .. ':ez', base .. ':r', base .. ':rz'
local RESULTS_TRIM = 1024
local floor = math.floor
local PER = 10
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

-- The '|'-separated fields of a record, empty ones kept.
local function fields(s)
  local out = {}
  for part in string.gmatch(s .. '|', '([^|]*)|') do out[#out + 1] = part end
  return out
end

-- Call `c` no longer held in `pool`.
local function unhold(c, pool)
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

-- Forgets call `c`'s slot in `pool`.
local function drop_slot(c, pool)
  call('ZREM', base .. ':s:' .. pool, c)
  call('ZREM', base .. ':c:' .. pool, c)
  unhold(c, pool)
end

-- Sum pool `pool` (window `w` of `kind`) adds `amt` at `at`.
local function sum_add(pool, kind, w, at, amt)
  if kind == 'S' then
    local seq = call('HINCRBY', M, 'seq', 1)
    local key = base .. ':se:' .. pool
    call('ZADD', key, int(at), int(amt) .. '|' .. int(seq))
    touch(key)
  else
    local key = base .. ':sb:' .. pool
    call('HINCRBY', key, int(divmod(at, w)), amt)
    touch(key)
  end
end

-- Drops what no call at or after L' - grace can see (Sums::trim).
local function sum_trim(pool, kind, w, lp)
  local let_go = lp - grace
  if kind == 'S' then
    call('ZREMRANGEBYSCORE', base .. ':se:' .. pool, '-inf', int(let_go - w))
    return
  end
  local key = base .. ':sb:' .. pool
  local lb = divmod(let_go, w)
  for _, f in ipairs(call('HKEYS', key)) do
    local b = tonumber(f)
    local gone
    if kind == 'F' then gone = (b + 1) * w + grace <= lp else gone = b < lb - 1 end
    if gone then call('HDEL', key, f) end
  end
end

-- The sum added in [lo, hi] (a sliding sum pool's).
local function sum_between(pool, lo, hi)
  local sum = 0
  for _, m in ipairs(call('ZRANGEBYSCORE', base .. ':se:' .. pool, int(lo), int(hi))) do
    sum = sum + tonumber(string.match(m, '^(%d+)|'))
  end
  return sum
end

-- A sum pool's count at t and the last time s > t a call would still be
-- over `lim` (Sums::count, Sums::rejects_until).
local function sum_count(pool, kind, w, t, lim, want, lp)
  if kind == 'S' then
    local cnt = sum_between(pool, t - w + 1, t)
    if not want then return cnt, nil end
    local flat = call('ZRANGE', base .. ':se:' .. pool, 0, -1, 'WITHSCORES')
    local ats, amts = {}, {}
    for j = 1, #flat, 2 do
      ats[#ats + 1] = tonumber(flat[j + 1])
      amts[#amts + 1] = tonumber(string.match(flat[j], '^(%d+)|'))
    end
    -- The sum in (s - w, s] for s = an end's time + w - 1, latest first:
    -- prefix sums, the window's upper end moving down with s.
    local pre, first = {[0] = 0}, {}
    for j = 1, #ats do
      pre[j] = pre[j - 1] + amts[j]
      first[j] = (j > 1 and ats[j - 1] == ats[j]) and first[j - 1] or j
    end
    local hi = #ats
    for j = #ats, 1, -1 do
      local s = ats[j] + w - 1
      if s <= t then return cnt, nil end
      while hi > 0 and ats[hi] > s do hi = hi - 1 end
      if pre[hi] - pre[first[j] - 1] > lim then return cnt, s end
    end
    return cnt, nil
  end
  local bsum, blist = {}, {}
  local flat = call('HGETALL', base .. ':sb:' .. pool)
  for j = 1, #flat, 2 do
    local b, v = tonumber(flat[j]), tonumber(flat[j + 1])
    bsum[b] = v
    if v > 0 then blist[#blist + 1] = b end
  end
  local b = divmod(t, w)
  local cnt
  if kind == 'F' then
    if (b + 1) * w + grace <= lp then cnt = 0 else cnt = bsum[b] or 0 end
  else
    cnt = mul_div(bsum[b - 1] or 0, w - (t - b * w) - 1, w) + (bsum[b] or 0)
  end
  if #blist == 0 or not want then return cnt, nil end
  table.sort(blist)
  if kind == 'F' then
    for j = #blist, 1, -1 do
      local x = blist[j]
      if x < b then return cnt, nil end
      if bsum[x] > lim then
        local s = (x + 1) * w - 1
        if s > t then return cnt, s end
        return cnt, nil
      end
    end
    return cnt, nil
  end
  local cands, seen = {}, {}
  for j = #blist, 1, -1 do
    for _, x in ipairs({blist[j] + 1, blist[j]}) do
      if not seen[x] then
        seen[x] = true
        cands[#cands + 1] = x
      end
    end
  end
  table.sort(cands, function(x, y) return x > y end)
  for _, x in ipairs(cands) do
    if x < b then return cnt, nil end
    local r = sum_last_over(bsum[x - 1] or 0, bsum[x] or 0, w, lim)
    if r and x * w + r > t then return cnt, x * w + r end
  end
  return cnt, nil
end

-- The pools' L' to t if later, and what falls behind its idempotency
-- horizon forgotten: ends kept (at most max_pending: all of them), and what
-- calls got (at most RESULTS_TRIM a call, oldest first, so a gap in the
-- calls' times never makes one script call long; one past the horizon but
-- not yet dropped is not read, see `result`) with where they are held: an
-- end no longer finds them.
local function advance(t)
  if latest == nil or t > latest then latest = t end
  local horizon = latest - dedup
  for _, t in ipairs({{E, EZ, nil}, {R, RZ, RESULTS_TRIM}}) do
    local old
    if t[3] then
      old = call('ZRANGEBYSCORE', t[2], '-inf', int(horizon), 'LIMIT', 0, t[3])
    else
      old = call('ZRANGEBYSCORE', t[2], '-inf', int(horizon))
    end
    -- (In chunks: Lua's unpack has a stack limit.)
    for s0 = 1, #old, 1000 do
      local part = {unpack(old, s0, math.min(s0 + 999, #old))}
      call('HDEL', t[1], unpack(part))
      if t[1] == R then
        call('HDEL', H, unpack(part))
        call('HDEL', D, unpack(part))
      end
    end
    if #old > 0 then call('ZREMRANGEBYRANK', t[2], 0, #old - 1) end
  end
end

-- Pool `pool`'s own L' to t if later, and what it no longer needs dropped:
-- calls closed at or before L' - grace, a sum pool's calls whose start +
-- max_duration is there, and its ended calls no call at or after it can
-- see (Pools::touch: a pool's own time, as the partitions of a stream run
-- apart in event time). Its L'.
local function touch_pool(pool, sum, kind, w, t)
  local LK = base .. ':l:' .. pool
  local lp = tonumber(call('GET', LK) or '')
  if lp == nil or t > lp then lp = t end
  call('SET', LK, int(lp), 'PX', ttl)
  local let_go = int(lp - grace)
  -- The calls of `index` (a sorted set) scored at or before let_go leave
  -- it and `also` (their other place: start set, or waiting hash).
  local function let_go_of(index, cmd, also)
    local gone = call('ZRANGEBYSCORE', index, '-inf', let_go)
    for _, c in ipairs(gone) do
      call(cmd, also, c)
      unhold(c, pool)
    end
    if #gone > 0 then call('ZREMRANGEBYSCORE', index, '-inf', let_go) end
  end
  if sum == '0' then
    let_go_of(base .. ':c:' .. pool, 'ZREM', base .. ':s:' .. pool)
  else
    let_go_of(base .. ':wz:' .. pool, 'HDEL', base .. ':sw:' .. pool)
    sum_trim(pool, kind, w, lp)
  end
  return lp
end

-- What call `c` got, if it is remembered: newer than L' - dedup.
local function result(c)
  local v = call('HGET', R, c)
  if not v then return nil end
  local at = string.find(v, '#', 1, true)
  if latest ~= nil and tonumber(string.sub(v, 1, at - 1)) <= latest - dedup then return nil end
  return string.sub(v, at + 1)
end

-- Calls open in `pool` at t, and the last time s > t a call would still
-- be over `limit` (Pools::count and rejects_until).
local function count(pool, t, limit, want)
  local S, C = base .. ':s:' .. pool, base .. ':c:' .. pool
  local open = call('ZCOUNT', S, '-inf', int(t)) - call('ZCOUNT', C, '-inf', int(t))
  local upto_s
  if not want then
    return open + 1, nil
  elseif call('ZCOUNT', S, '(' .. int(t), '+inf') == 0 then
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
  local held = call('HGET', H, c)
  call('HSET', H, c, held and (held .. '\n' .. pool) or pool)
  touch(H)
end

local function on_end(c, ts, talk)
  local held = call('HGET', H, c)
  if held then
    if call('HSETNX', D, c, 1) == 1 then
      touch(D)
      for _, pool in ipairs(split(held, '\n')) do
        local SW = base .. ':sw:' .. pool
        local waiting = call('HGET', SW, c)
        if waiting then
          -- A sum pool: the call stops waiting, and adds if in time.
          local f = fields(waiting)
          local start, max, costed = tonumber(f[1]), tonumber(f[2]), f[3] == '1'
          local per, inc, kind, w = tonumber(f[4]), tonumber(f[5]), f[6], tonumber(f[7])
          call('HDEL', SW, c)
          call('ZREM', base .. ':wz:' .. pool, c)
          unhold(c, pool)
          if ts < start + max then
            sum_add(pool, kind, w, math.max(ts, start), sum_amount_of(costed, per, inc, talk))
          end
        end
        local C = base .. ':c:' .. pool
        local start = tonumber(call('ZSCORE', base .. ':s:' .. pool, c))
        local old = tonumber(call('ZSCORE', C, c))
        if start and old then
          local new = math.min(old, math.max(ts, start))
          if new ~= old then call('ZADD', C, int(new), c) end
        end
      end
    end
    return
  end
  if result(c) or call('HEXISTS', E, c) == 1 then return end
  call('HSET', E, c, int(ts) .. ',' .. int(talk))
  call('ZADD', EZ, int(ts), c)
  touch(E)
  touch(EZ)
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
    on_end(c, ts, tonumber(ARGV[i + 3]))
    i = i + 4
  else
    local opening, n = tonumber(ARGV[i + 3]), tonumber(ARGV[i + 4])
    local j = i + 5
    i = j + n * PER
    local known = result(c)
    if known then
      out[#out + 1] = known
    else
      advance(ts)
      local lps = {}
      for k = 0, n - 1 do
        local a = j + k * PER
        lps[k + 1] = touch_pool(ARGV[a + 1], ARGV[a + 5], ARGV[a + 6], tonumber(ARGV[a + 7]), ts)
      end
      local found, over = {}, false
      for k = 0, n - 1 do
        local a = j + k * PER
        local rule, pool, limit = ARGV[a], ARGV[a + 1], tonumber(ARGV[a + 2])
        local shadow = ARGV[a + 3] == '1'
        local cnt
        if ARGV[a + 5] == '0' then
          cnt = count(pool, ts, limit, false)
        else
          cnt = sum_count(pool, ARGV[a + 6], tonumber(ARGV[a + 7]), ts, limit, false, lps[k + 1])
        end
        if not shadow and cnt > limit then over = true end
        found[#found + 1] = {rule, cnt, nil}
      end
      -- The last times the pools would still turn a call away matter only
      -- to the Retry-After of a call they turn away (Pools::apply_one).
      if opening == 2 and over then
        for k = 0, n - 1 do
          local a = j + k * PER
          if ARGV[a + 3] ~= '1' then
            local pool, limit = ARGV[a + 1], tonumber(ARGV[a + 2])
            local _, u
            if ARGV[a + 5] == '0' then
              _, u = count(pool, ts, limit, true)
            else
              _, u = sum_count(pool, ARGV[a + 6], tonumber(ARGV[a + 7]), ts, limit, true, lps[k + 1])
            end
            found[k + 1][3] = u
          end
        end
      end
      for k, f in ipairs(found) do
        found[k] = f[1] .. ':' .. int(f[2]) .. ':' .. (f[3] and int(f[3]) or '')
      end
      if opening == 1 or (opening == 2 and not over) then
        local e = call('HGET', E, c)
        local ended = e ~= false and e ~= nil
        local e_ts, e_talk
        if ended then
          call('HDEL', E, c)
          call('ZREM', EZ, c)
          local f = split(e, ',')
          e_ts, e_talk = tonumber(f[1]), tonumber(f[2])
        end
        for k = 0, n - 1 do
          local a = j + k * PER
          local pool, max, sum = ARGV[a + 1], tonumber(ARGV[a + 4]), ARGV[a + 5]
          if sum == '0' then
            local close = ts + max
            if ended then close = math.min(math.max(e_ts, ts), close) end
            open_slot(c, pool, ts, close)
          else
            local kind, w = ARGV[a + 6], tonumber(ARGV[a + 7])
            local per, inc = ARGV[a + 8], ARGV[a + 9]
            if ended then
              if e_ts < ts + max then
                local amt = sum_amount_of(sum == '2', tonumber(per), tonumber(inc), e_talk)
                sum_add(pool, kind, w, math.max(e_ts, ts), amt)
              end
            elseif call('HEXISTS', base .. ':sw:' .. pool, c) == 0 then
              local SW = base .. ':sw:' .. pool
              call('HSET', SW, c, table.concat({int(ts), int(max), sum == '2' and '1' or '0', per, inc, kind, int(w)}, '|'))
              touch(SW)
              local WP = base .. ':wz:' .. pool
              call('ZADD', WP, int(ts + max), c)
              touch(WP)
              local held = call('HGET', H, c)
              call('HSET', H, c, held and (held .. '\n' .. pool) or pool)
              touch(H)
            end
          end
        end
        if ended then
          call('HSET', D, c, 1)
          touch(D)
        end
      end
      local got = table.concat(found, ';')
      call('HSET', R, c, int(ts) .. '#' .. got)
      call('ZADD', RZ, int(ts), c)
      touch(R)
      touch(RZ)
      out[#out + 1] = got
    end
  end
end
if latest ~= nil then
  call('HSET', M, 'latest', int(latest))
  touch(M)
end
-- (A TTL is set on the keys this call wrote, and only on them: each
-- hash lives its span past its last write.)
for k in pairs(touched) do call('PEXPIRE', k, ttl) end
return out
