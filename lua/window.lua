#!lua
-- callguard window script: decides one call of one caller atomically.
--
-- A line-by-line port of CallerState::apply (src/engine/window.rs), which defines
-- the semantics; the conformance tests demand identical records. Event time
-- comes from ARGV; the Redis clock is never read. Every key written gets a
-- TTL in the same call.
--
-- KEYS (all share the caller's hash tag, so they live in one Cluster slot):
--   KEYS[1]      meta hash: L = latest event time; a:<rule>:<W>:{b,c,p} =
--                sliding-approx bucket, current and previous counters
--   KEYS[2]      sliding log: sorted set, member call_id, score event time
--   KEYS[3]      idempotency index: sorted set, member call_id, score event time
--                (trimmed at the idempotency horizon D, TTL D)
--   KEYS[4]      idempotency records: hash call_id -> encoded record
--   KEYS[5]      callees: sorted set, member callee, score its latest call time
--   KEYS[6]      block key (<prefix>block:{<caller>}): on a reject with a
--                retry-after, set to the reason with that TTL (ARGV[17])
--   KEYS[6+i]    rule i's fixed-window counter for the event's bucket, named
--                <...>:<bucket> (any caller key for other kinds; not touched).
--                A reject reads the counters of the live buckets from the
--                event's to the latest one, named alike (same hash tag, so
--                the same Cluster slot): one for calls in time order, at
--                most min(L' - t, grace) / W + 2 for a late one.
-- ARGV:
--   1 t (event time, ms)        2 call_id           3 listed: 0 no, 1 allow, 2 deny
--   4 policy: 0 attempts, 1 admitted               5 grace (ms)
--   6 retention = longest window + grace (ms)      7 shadow: 0/1
--   8 idempotency: 0/1          9 rules version     10 any sliding rule: 0/1
--   11 idempotency horizon D >= retention (ms)
--   12 TTL slack (ms): added to every TTL so pauses in processing (Redis
--      restarts, rebalances, lag) do not expire state the contract still needs
--   13 distinct callees kept: 0/1                14 callee ('' for none)
--   15 longest window Wmax (ms)
--   16 most distinct callees kept per caller (a new one beyond it is not kept)
--   17 block keys: 0/1
--   18 n (number of rules), then per rule i: kind (0 fixed, 1 sliding,
--   2 sliding-approx), window (ms), limit, name
-- Returns: { duplicate (0/1), record } where record is its fields joined by '|'
--   (src/engine/record.rs REPLY_FIELDS; a test holds the two lists together):
--   record fields: ts_ms decision reason shadow late rules_version prev_ts_ms distinct_callees counts retry_after_ms
--   decision 0 allow, 1 reject; shadow and late 0/1; prev_ts_ms empty when the
--   caller has no state within the retention; distinct_callees empty when
--   callees are not kept; counts comma-separated in rule order;
--   retry_after_ms empty unless a rule rejected (the contract's retry-after).
-- Needs Redis >= 7.0: the #!lua shebang (no flags) makes Redis refuse the
-- whole call up front with an OOM error when maxmemory is reached, instead
-- of failing at its first write with part of it applied; retries are exact.
-- Numbers travel through Lua doubles: exact below 2^53. Event times are
-- checked to lie in 2000-01-01 .. 2100-01-01 before they get here (the
-- decoder's range), and bounds are formatted with %d, never tostring.

local t = tonumber(ARGV[1])
local id = ARGV[2]
local listed = tonumber(ARGV[3])
local admitted = ARGV[4] == '1'
local grace = tonumber(ARGV[5])
local retention = tonumber(ARGV[6])
local shadow_mode = ARGV[7] == '1'
local idem = ARGV[8] == '1'
local version = ARGV[9]
local has_sliding = ARGV[10] == '1'
local dedup = tonumber(ARGV[11])
local slack = tonumber(ARGV[12])
local track_callees = ARGV[13] == '1'
local callee = ARGV[14]
local wmax = tonumber(ARGV[15])
local max_callees = tonumber(ARGV[16])
local block = ARGV[17] == '1'
local n = tonumber(ARGV[18])
local meta, log, ids, rec, callees = KEYS[1], KEYS[2], KEYS[3], KEYS[4], KEYS[5]
local R = 18

local latest = tonumber(redis.call('HGET', meta, 'L'))
local lnew = t
if latest and latest > t then lnew = latest end
local horizon = lnew - retention
local dedup_horizon = lnew - dedup

if idem then
  local stored = redis.call('HGET', rec, id)
  if stored then
    local sts = tonumber(string.match(stored, '^(-?%d+)|'))
    if sts > dedup_horizon then return {1, stored} end
  end
end

local prev = nil
if latest and latest > horizon then prev = latest end

-- Trim everything at or below the horizon.
if has_sliding then redis.call('ZREMRANGEBYSCORE', log, '-inf', horizon) end
if idem then
  local old = redis.call('ZRANGEBYSCORE', ids, '-inf', dedup_horizon)
  for s = 1, #old, 1000 do
    redis.call('HDEL', rec, unpack(old, s, math.min(s + 999, #old)))
  end
  if #old > 0 then redis.call('ZREMRANGEBYSCORE', ids, '-inf', dedup_horizon) end
end

-- Distinct callees: raise this callee's latest call time, count those after t - Wmax.
local distinct = ''
if track_callees then
  redis.call('ZREMRANGEBYSCORE', callees, '-inf', horizon)
  if callee ~= '' then
    -- A new callee only while fewer than the cap are kept; known ones are raised.
    if redis.call('ZCARD', callees) < max_callees then
      redis.call('ZADD', callees, 'GT', t, callee)
    else
      redis.call('ZADD', callees, 'XX', 'GT', t, callee)
    end
    redis.call('PEXPIRE', callees, retention + slack)
  end
  distinct = string.format('%d', redis.call('ZCOUNT', callees, '(' .. string.format('%d', t - wmax), '+inf'))
end

local counts, approx = {}, {}
for i = 1, n do
  local base = R + (i - 1) * 4
  local kind = tonumber(ARGV[base + 1])
  local w = tonumber(ARGV[base + 2])
  local b = math.floor(t / w)
  if kind == 1 then
    counts[i] = 1 + redis.call('ZCOUNT', log, '(' .. string.format('%d', t - w), string.format('%d', t))
  elseif kind == 0 then
    if (b + 1) * w + grace <= lnew then
      counts[i] = 1
    else
      counts[i] = 1 + (tonumber(redis.call('GET', KEYS[6 + i])) or 0)
    end
  else
    local f = 'a:' .. ARGV[base + 4] .. ':' .. w .. ':'
    local cb, cur, pv = nil, 0, 0
    if prev then
      local v = redis.call('HMGET', meta, f .. 'b', f .. 'c', f .. 'p')
      cb, cur, pv = tonumber(v[1]), tonumber(v[2]) or 0, tonumber(v[3]) or 0
    end
    if not cb then
      cb, cur, pv = b, 0, 0
    elseif b > cb then
      if b == cb + 1 then pv = cur else pv = 0 end
      cur, cb = 0, b
    end
    if b == cb then
      local a = pv * math.max(w - (t - b * w) - 1, 0)
      counts[i] = (a - a % w) / w + cur + 1
    elseif b == cb - 1 then
      counts[i] = pv + 1
    else
      counts[i] = 1
    end
    approx[i] = {f, cb, cur, pv, b}
  end
end

local would, reason = 0, 'ok'
if listed == 2 then
  would, reason = 1, 'denylist'
elseif listed == 1 then
  reason = 'allowlist'
else
  for i = 1, n do
    local base = R + (i - 1) * 4
    if counts[i] > tonumber(ARGV[base + 3]) then
      would, reason = 1, ARGV[base + 4]
      break
    end
  end
end

if (not admitted) or would == 0 then
  if has_sliding then
    redis.call('ZADD', log, t, id)
    redis.call('PEXPIRE', log, retention + slack)
  end
  for i = 1, n do
    local base = R + (i - 1) * 4
    local kind = tonumber(ARGV[base + 1])
    local w = tonumber(ARGV[base + 2])
    if kind == 0 then
      local b = math.floor(t / w)
      if (b + 1) * w + grace > lnew then
        if redis.call('INCR', KEYS[6 + i]) == 1 then
          redis.call('PEXPIRE', KEYS[6 + i], w + grace + slack)
        end
      end
    elseif kind == 2 then
      local a = approx[i]
      if a[5] == a[2] then a[3] = a[3] + 1 elseif a[5] == a[2] - 1 then a[4] = a[4] + 1 end
    end
  end
end
for i = 1, n do
  local a = approx[i]
  if a then redis.call('HSET', meta, a[1] .. 'b', a[2], a[1] .. 'c', a[3], a[1] .. 'p', a[4]) end
end
redis.call('HSET', meta, 'L', lnew)
redis.call('PEXPIRE', meta, retention + slack)

local late = 0
if prev and t < prev - grace then late = 1 end
local shadow = 0
if shadow_mode and would == 1 then shadow = 1 end
local decision = would
if shadow == 1 then decision = 0 end
-- Retry-after (window.rs retry_after): the last time s > t at which a call
-- would still exceed a rule, over all rules, plus one, minus t.
local function sliding_until(w, lim)
  local m = 0
  while true do
    local lo = redis.call('ZRANGE', log, -lim - m, -lim - m, 'WITHSCORES')
    if #lo == 0 then return nil end
    local e_end = tonumber(lo[2]) + w - 1
    if e_end <= t then return nil end
    local hi = redis.call('ZRANGE', log, -1 - m, -1 - m, 'WITHSCORES')
    if tonumber(hi[2]) <= e_end then return e_end end
    m = m + 1
  end
end
local function fixed_until(key, w, lim)
  local stem = string.match(key, '^(.*:)%-?%d+$')
  local bb = math.floor(lnew / w)
  while (bb + 1) * w + grace > lnew and (bb + 1) * w - 1 > t do
    local c = tonumber(redis.call('GET', stem .. string.format('%d', bb))) or 0
    if c >= lim then return (bb + 1) * w - 1 end
    bb = bb - 1
  end
  return nil
end
local function ceil_div(a, b)
  local r = a % b
  return (a - r) / b + ((r > 0) and 1 or 0)
end
local function last_offset(x, extra, w, lim)
  if extra > lim then return w - 1 end
  if x == 0 then return nil end
  local r = w - 1 - ceil_div((lim + 1 - extra) * w, x)
  if r < 0 then return nil end
  return r
end
local function approx_until(a, w, lim)
  local cb, cur, pv = a[2], a[3], a[4]
  local expires = lnew + retention
  local segs = {
    {cb + 1, last_offset(cur, 1, w, lim)},
    {cb, last_offset(pv, cur + 1, w, lim)},
    {cb - 1, (pv + 1 > lim) and (w - 1) or nil},
  }
  for j = 1, 3 do
    local r = segs[j][2]
    if r then
      local st = segs[j][1] * w
      local s = math.min(st + r, expires - 1)
      if s >= st then return s end
    end
  end
  return nil
end

local retry = ''
if decision == 1 and reason ~= 'denylist' then
  local last = t
  for i = 1, n do
    local base = R + (i - 1) * 4
    local kind = tonumber(ARGV[base + 1])
    local w = tonumber(ARGV[base + 2])
    local lim = tonumber(ARGV[base + 3])
    local s
    if kind == 1 then
      s = sliding_until(w, lim)
    elseif kind == 0 then
      s = fixed_until(KEYS[6 + i], w, lim)
    else
      s = approx_until(approx[i], w, lim)
    end
    if s and s > last then last = s end
  end
  local ra = last + 1 - t
  retry = string.format('%d', ra)
  if block then redis.call('SET', KEYS[6], reason, 'PX', ra) end
end

local parts = {}
for i = 1, n do parts[i] = string.format('%d', counts[i]) end
local encoded = string.format('%d', t) .. '|' .. decision .. '|' .. reason .. '|' .. shadow .. '|' .. late
  .. '|' .. version .. '|' .. (prev and string.format('%d', prev) or '') .. '|' .. distinct
  .. '|' .. table.concat(parts, ',') .. '|' .. retry
if idem then
  redis.call('HSET', rec, id, encoded)
  redis.call('PEXPIRE', rec, dedup + slack)
  redis.call('ZADD', ids, t, id)
  redis.call('PEXPIRE', ids, dedup + slack)
end
return {0, encoded}
