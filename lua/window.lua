#!lua
-- callguard window script: decides a batch of calls atomically, in order.
--
-- A line-by-line port of CallerState::apply (src/engine/window/mod.rs), which defines
-- the semantics; the conformance tests demand identical records. Event time
-- comes from ARGV; the Redis clock is never read. Every key written gets a
-- TTL in the same call. The events of one call are decided one after the
-- other, exactly as if each had its own call; the rule set is sent and
-- parsed once per call, not once per event.
--
-- KEYS[j] (one per event j): the event's caller stem <prefix>{<caller>}. The
--   caller's keys are the stem plus a suffix, so they share its hash tag and
--   Cluster slot (on a Cluster, one call holds one slot's events):
--   :m     meta hash: L = latest event time; O, I, C = a lower bound of the
--          lowest score in :l, :i, :c, as L minus it ('' when that set is
--          empty; absent when unknown), so a set is trimmed only when
--          something in it is old; N = an upper bound of the callees kept
--          in :c, old entries included (the cap is counted only when N
--          reaches it);
--          f:<rule>:<W> = a fixed rule's live buckets and their counts,
--          "<bucket>=<count>,..." (dead buckets dropped at each write);
--          a:<rule>:<W>:{b,c,p} = sliding-approx bucket, current and
--          previous counters; r:<call_id> = the call's encoded record
--          (idempotency; trimmed at the idempotency horizon D, so the
--          hash's TTL is D rather than the retention when records are kept)
--   :l     sliding log: sorted set, member call_id, score event time
--   :i     idempotency index: sorted set, member call_id, score event time
--          (trimmed at the idempotency horizon D, TTL D); not kept when the
--          sliding log is the index (see log_is_index)
--   :c     callees: sorted set, member callee, score its latest call time
--   :l:<rule>:<W>  a sliding rule's own log, when it sees only some calls
--          (filters): sorted set, member call_id, score event time
--   :d:<rule>:<W>  a distinct-callees rule's recorded callees: sorted set,
--          member callee, score its latest recorded call time (at most
--          ARGV[12] kept: past that ZPOPMIN drops the lowest (time, callee))
--   :p:<rule>:<W>   a rule keyed by caller and callee: hash, field callee,
--          value its pair's state ("t1,t2,..." sliding times; "b=c,..."
--          fixed buckets; "b,cur,prev" sliding-approx; "ms,rem" token bucket)
--   :pz:<rule>:<W>  its pairs: sorted set, member callee, score the latest
--          call to it the rule saw (at most ARGV[12] pairs: past that
--          ZPOPMIN drops the lowest (time, callee) and its state)
--   meta also holds t:<rule>:<W> = a token bucket's theoretical arrival
--          time "<ms>,<rem>" (TAT = ms + rem / n, rate n per period)
--   and <prefix>block:{<caller>}: on a reject with a retry-after (and ARGV[13]),
--   set to the reason with that TTL.
-- ARGV, once per call:
--   1 policy: 0 attempts, 1 admitted               2 grace (ms)
--   3 retention = longest window + grace (ms)      4 shadow: 0/1
--   5 idempotency: 0/1          6 rules version     7 any sliding rule: 0/1
--   8 idempotency horizon D >= retention (ms)
--   9 TTL slack (ms): added to every TTL so pauses in processing (Redis
--     restarts, rebalances, lag) do not expire state the contract still needs
--   10 distinct callees kept: 0/1                 11 longest window Wmax (ms)
--   12 most distinct callees kept per caller (a new one beyond it is not kept)
--   13 block keys: 0/1          14 key prefix
--   15 n (number of rules), then per rule i, 7 values: kind (0 fixed,
--   1 sliding, 2 sliding-approx, 3 token-bucket, 4 distinct-callees,
--   5 keyed by callee or global: decided before, nothing kept here),
--   window (ms; a token bucket's span), limit (a token bucket's burst),
--   name, flags (1 shadow + 2 own log: a sliding rule that sees only some
--   calls + 4 keyed by caller and callee), warn level ('' none), rate "<n>/<period ms>" (a
--   token bucket's; '' otherwise)
-- then per event j, 6 values: t (event time, ms), call_id,
--   listed (0 no, 1 allow, 2 deny, 3 an unusable caller allowed, 4 one
--   rejected: reason `bad_caller`), callee ('' for none), mask: '' when
--   every rule sees every call, else one character per rule: 1 the rule
--   sees the call, 2 it does not now (time profile) but sees its callee
--   (it counts for the retry-after), 0 neither (RuleSet::mask), and when
--   a rule has a time profile, `|` and per rule (';' between them) the
--   ranges "a-b,..." of instants from t on that its profile holds at
--   (empty for a rule without one): a rule rejects only calls it sees, so
--   its part of the retry-after ends at the last of them; outside:
--   per kind-5 rule in order, "<count>:<until>" joined by ',' (until, the
--   rule's last rejecting time, '' for none; src/engine/aggregate.rs).
--   A reject by a kind-5 rule sets no block key (the caller is not the
--   one over the limit).
-- Returns: per event j, in order, duplicate (0/1) then record, where record is
--   its fields joined by '|'
--   (src/engine/record.rs REPLY_FIELDS; a test holds the two lists together):
--   record fields: ts_ms decision reason shadow late rules_version prev_ts_ms distinct_callees counts retry_after_ms warn
--   decision 0 allow, 1 reject; shadow and late 0/1; prev_ts_ms empty when the
--   caller has no state within the retention; distinct_callees empty when
--   callees are not kept; counts comma-separated in rule order;
--   retry_after_ms empty unless a rule rejected (the contract's retry-after);
--   a count is 0 for a rule that does not see the call; warn is the first
--   rule whose count exceeds its warn level on an allowed call ('' none).
-- Needs Redis >= 7.0: the #!lua shebang (no flags) makes Redis refuse the
-- whole call up front with an OOM error when maxmemory is reached, instead
-- of failing at its first write with part of it applied; retries are exact.
-- Numbers travel through Lua doubles: exact below 2^53. Event times are
-- checked to lie in 2000-01-01 .. 2100-01-01 before they get here (the
-- decoder's range), and bounds are formatted with %d, never tostring.

local call, fmt, tonumber, floor = redis.call, string.format, tonumber, math.floor


local admitted = ARGV[1] == '1'
local grace = tonumber(ARGV[2])
local retention = tonumber(ARGV[3])
local shadow_mode = ARGV[4] == '1'
local idem = ARGV[5] == '1'
local version = ARGV[6]
local has_sliding = ARGV[7] == '1'
local dedup = tonumber(ARGV[8])
local slack = tonumber(ARGV[9])
local track_callees = ARGV[10] == '1'
local wmax = tonumber(ARGV[11])
local max_callees = tonumber(ARGV[12])
local block = ARGV[13] == '1'
local prefix = ARGV[14]
local n = tonumber(ARGV[15])
local H = 15

-- The rule set, parsed once.
local kinds, wins, lims, names, ffield, afield = {}, {}, {}, {}, {}, {}
local rshadow, warns, rcalls, rper, tfield, suffix, ownlog, paired = {}, {}, {}, {}, {}, {}, {}, {}
local PER_RULE = 7
-- Meta fields read per event: L, the three lower bounds, approx counters.
local mfields = {'L', 'O', 'I', 'C', 'N'}
for i = 1, n do
  local base = H + (i - 1) * PER_RULE
  kinds[i] = tonumber(ARGV[base + 1])
  wins[i] = tonumber(ARGV[base + 2])
  lims[i] = tonumber(ARGV[base + 3])
  names[i] = ARGV[base + 4]
  local flags = tonumber(ARGV[base + 5])
  rshadow[i] = flags % 2 == 1
  ownlog[i] = flags % 4 >= 2
  paired[i] = flags >= 4
  warns[i] = tonumber(ARGV[base + 6])
  suffix[i] = names[i] .. ':' .. fmt('%d', wins[i])
  local rc, rp = string.match(ARGV[base + 7], '^(%d+)/(%d+)$')
  rcalls[i], rper[i] = tonumber(rc), tonumber(rp)
  if paired[i] then
    -- Kept per pair, not in meta.
  elseif kinds[i] == 0 then
    ffield[i] = #mfields + 1
    mfields[#mfields + 1] = 'f:' .. names[i] .. ':' .. fmt('%d', wins[i])
  elseif kinds[i] == 3 then
    tfield[i] = #mfields + 1
    mfields[#mfields + 1] = 't:' .. suffix[i]
  elseif kinds[i] == 2 then
    local f = 'a:' .. names[i] .. ':' .. fmt('%d', wins[i]) .. ':'
    afield[i] = #mfields + 1
    mfields[#mfields + 1] = f .. 'b'
    mfields[#mfields + 1] = f .. 'c'
    mfields[#mfields + 1] = f .. 'p'
  end
end
local E = H + PER_RULE * n
-- Names of the kind-5 rules (a reject by one sets no block key), and the
-- current event's values of theirs (see decide).
local outside_names, outside_count, outside_until = {}, {}, {}
for i = 1, n do
  if kinds[i] == 5 then outside_names[names[i]] = true end
end
-- Whether some rule keeps sorted sets of its own (distinct callees, pairs;
-- own logs come with a mask).
local has_own_sets = false
for i = 1, n do
  if kinds[i] == 4 or paired[i] then has_own_sets = true end
end
local NM = #mfields
-- Under attempts with a sliding rule and D = retention, the sliding log holds
-- exactly the call ids the index would (the same members, scores and
-- trims): it serves as the index, and :i is not kept.
local log_is_index = idem and has_sliding and (not admitted) and dedup == retention
local index_apart = idem and not log_is_index
-- The meta hash holds the records too, so it lives as long as they must.
local meta_ttl = retention + slack
if idem then meta_ttl = dedup + slack end

-- A set's lower bound as read from meta: a number, EMPTY, or nil (unknown).
-- Kept as its distance below the latest time L (fewer digits).
local EMPTY = false
local function bound(v, latest)
  if v == false or not latest then return nil end
  if v == '' then return EMPTY end
  return latest - tonumber(v)
end
local function bound_str(b, lnew)
  if b == EMPTY then return '' end
  return fmt('%d', lnew - b)
end
local function lower(b, t)
  if b == EMPTY or t < b then return t end
  return b
end
-- Whether to trim a set with lower bound b at h: when it may hold scores <= h
-- (nil: unknown, so yes) and they matter now (a late call reads below h) or
-- have piled up for a sixteenth of the span kept. Calls in time order never
-- read at or below h (their windows start above it, and the callee cap counts
-- above it), so old entries left a little longer change no record and set
-- trims are amortised over many calls.
local function due(b, h, span, late)
  if b == nil then return true end
  if b == EMPTY then return false end
  return b <= h - floor(span / 16) or (late and b <= h)
end
-- The lowest score left in a sorted set, as a bound.
local function lowest(key)
  local lo = call('ZRANGE', key, 0, 0, 'WITHSCORES')
  if #lo == 0 then return EMPTY end
  return tonumber(lo[2])
end

-- Drops from meta the records of the calls in index at or below h, then the
-- calls; returns the index's new lower bound.
-- A call in time order drops at most TRIM_MAX (a late one drops all), so a
-- flooding caller's pile of old records is cleared over several calls
-- rather than in one long stall of Redis.
local TRIM_MAX = 256
local function trim_index(meta, index, h, late)
  local old
  if late then
    old = call('ZRANGEBYSCORE', index, '-inf', h)
  else
    old = call('ZRANGEBYSCORE', index, '-inf', h, 'LIMIT', 0, TRIM_MAX)
  end
  for s = 1, #old, 1000 do
    local fields = {}
    for k = s, math.min(s + 999, #old) do fields[#fields + 1] = 'r:' .. old[k] end
    call('HDEL', meta, unpack(fields))
  end
  -- They are the lowest ranks (ZRANGEBYSCORE from -inf lists in rank order).
  if #old > 0 then call('ZREMRANGEBYRANK', index, 0, #old - 1) end
  return lowest(index)
end

-- A fixed rule's live buckets, kept in one meta field as "b=count,...":
-- parsed into {[b] = count}; written back with the dead ones left out.
local function parse_buckets(v)
  local fb = {}
  if v then
    for bs, cs in string.gmatch(v, '(-?%d+)=(%d+)') do fb[tonumber(bs)] = tonumber(cs) end
  end
  return fb
end
local function format_buckets(fb, w, lnew)
  local parts = {}
  for b, c in pairs(fb) do
    if (b + 1) * w + grace > lnew then parts[#parts + 1] = fmt('%d=%d', b, c) end
  end
  table.sort(parts)
  return table.concat(parts, ',')
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

-- Retry-after (window.rs retry_after): the last time s > t at which a call
-- would still exceed a rule, over all rules, plus one, minus t. Each helper
-- returns that time for one rule, or nil.
local function sliding_until(log, t, w, lim)
  local m = 0
  while true do
    local lo = call('ZRANGE', log, -lim - m, -lim - m, 'WITHSCORES')
    if #lo == 0 then return nil end
    local e_end = tonumber(lo[2]) + w - 1
    if e_end <= t then return nil end
    local hi = call('ZRANGE', log, -1 - m, -1 - m, 'WITHSCORES')
    if tonumber(hi[2]) <= e_end then return e_end end
    m = m + 1
  end
end
local function fixed_until(fb, t, lnew, w, lim)
  local bb = floor(lnew / w)
  while (bb + 1) * w + grace > lnew and (bb + 1) * w - 1 > t do
    local c = fb[bb] or 0
    if c >= lim then return (bb + 1) * w - 1 end
    bb = bb - 1
  end
  return nil
end
local function approx_until(a, expires, w, lim)
  local cb, cur, pv = a[2], a[3], a[4]
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

-- Token bucket (window/bucket.rs): TAT as {ms, rem}, rem in n-ths of a ms.
local function tat_next(tat, t, i)
  local nn, per = rcalls[i], rper[i]
  local ms, rem = t, 0
  if tat and (tat[1] > t or (tat[1] == t and tat[2] > 0)) then ms, rem = tat[1], tat[2] end
  local r = per % nn
  ms, rem = ms + (per - r) / nn, rem + r
  if rem >= nn then ms, rem = ms + 1, rem - nn end
  return {ms, rem}
end
local function tat_level(tat, t, i)
  local ticks = (tat[1] - t) * rcalls[i] + tat[2]
  if ticks < 0 then ticks = 0 end
  return ceil_div(ticks, rper[i])
end
local function tat_until(tat, t, i, lim)
  local nn = rcalls[i]
  local x = (tat[1] - t) * nn + tat[2] - (lim - 1) * rper[i]
  local d = ceil_div(x, nn) - 1
  if d >= 1 then return t + d end
  return nil
end
-- Distinct callees (window/distinct.rs): the last time a call to own would
-- still count above lim, from the lim-th most recent other callee.
local function distinct_until(key, own, t, w, lim)
  local top = call('ZREVRANGE', key, 0, lim, 'WITHSCORES')
  local k = 0
  for j = 1, #top, 2 do
    if top[j] ~= own then
      k = k + 1
      if k == lim then
        local e_end = tonumber(top[j + 1]) + w - 1
        if e_end > t then return e_end end
        return nil
      end
    end
  end
  return nil
end

-- sliding-approx (Approx::advance_and_count): the counters (bucket cb, nil
-- for none) moved to t's bucket if it is newer, and the call's estimate.
local function approx_count(cb, cur, pv, t, w, horizon)
  local b = floor(t / w)
  if not cb then
    cb, cur, pv = b, 0, 0
  elseif b > cb then
    if b == cb + 1 then pv = cur else pv = 0 end
    cur, cb = 0, b
  end
  local c = 1
  if b == cb then
    local a = pv * math.max(w - (t - b * w) - 1, 0)
    c = (a - a % w) / w + cur + 1
  elseif b == cb - 1 and t > horizon then
    c = pv + 1
  end
  return cb, cur, pv, c
end

-- Pairs (window/pairs.rs): a pair's state string read into a table for
-- its rule's kind, and written back.
local function pair_parse(i, v, horizon)
  local kind = kinds[i]
  if kind == 1 then
    local times = {}
    for x in string.gmatch(v or '', '-?%d+') do
      local e = tonumber(x)
      if e > horizon then times[#times + 1] = e end
    end
    return times
  elseif kind == 0 then
    return parse_buckets(v or false)
  elseif kind == 2 then
    local cb, cur, pv = string.match(v or '', '^(-?%d+),(%d+),(%d+)$')
    if not cb then return {nil, nil, 0, 0} end
    return {nil, tonumber(cb), tonumber(cur), tonumber(pv)}
  else
    local ms, rem = string.match(v or '', '^(-?%d+),(%d+)$')
    if not ms then return nil end
    return {tonumber(ms), tonumber(rem)}
  end
end
local function pair_format(i, st, lnew)
  local kind = kinds[i]
  if kind == 1 then
    local parts = {}
    for j = 1, #st do parts[j] = fmt('%d', st[j]) end
    return table.concat(parts, ',')
  elseif kind == 0 then
    return format_buckets(st, wins[i], lnew)
  elseif kind == 2 then
    if not st[2] then return '' end
    return fmt('%d,%d,%d', st[2], st[3], st[4])
  else
    if not st then return '' end
    return fmt('%d,%d', st[1], st[2])
  end
end
-- sliding_until over a sorted table of times.
local function list_until(times, t, w, lim)
  local k = #times
  for j = k - lim + 1, 1, -1 do
    local e_end = times[j] + w - 1
    if e_end <= t then return nil end
    if times[j + lim - 1] <= e_end then return e_end end
  end
  return nil
end

-- Decides one event of the caller whose keys start with stem.
local function decide(stem, t, id, listed, callee, mask, outside)
  -- The kind-5 rules' counts and last rejecting times, in rule order.
  outside_count, outside_until = {}, {}
  if outside ~= '' then
    local i = 0
    for c, u in string.gmatch(outside, '(%d+):(%-?%d*)') do
      repeat i = i + 1 until i > n or kinds[i] == 5
      outside_count[i], outside_until[i] = tonumber(c), tonumber(u)
    end
  end
  local meta, log, ids, callees = stem .. ':m', stem .. ':l', stem .. ':i', stem .. ':c'
  -- Whether rule i sees the call (1), counts it for the retry-after only (2).
  local function sees(i)
    return mask == '' or string.byte(mask, i) == 49
  end
  local function near(i)
    return mask == '' or string.byte(mask, i) ~= 48
  end
  -- A rule's own sorted set (own log or distinct callees), if it has one.
  local function own_key(i)
    if paired[i] then return stem .. ':pz:' .. suffix[i] end
    if kinds[i] == 4 then return stem .. ':d:' .. suffix[i] end
    if ownlog[i] then return stem .. ':l:' .. suffix[i] end
    return nil
  end
  local rfield = 'r:' .. id
  mfields[NM + 1] = rfield
  local mv = call('HMGET', meta, unpack(mfields, 1, NM + (idem and 1 or 0)))
  local latest = tonumber(mv[1])
  local lnew = t
  if latest and latest > t then lnew = latest end
  local horizon = lnew - retention
  local dedup_horizon = lnew - dedup

  if idem then
    local stored = mv[NM + 1]
    if stored then
      local sts = tonumber(string.match(stored, '^(-?%d+)|'))
      if sts > dedup_horizon then return 1, stored end
    end
  end

  local prev = nil
  if latest and latest > horizon then prev = latest end
  local late = prev ~= nil and t < prev - grace
  local b_log, b_ids, b_callees = bound(mv[2], latest), bound(mv[3], latest), bound(mv[4], latest)
  local n_callees = latest and tonumber(mv[5])
  if not mv[1] then
    -- No meta: the log and the callees expire with it or before, so they are
    -- empty; the index may outlive it.
    b_log, b_callees = EMPTY, EMPTY
  end
  if index_apart and b_ids == nil then b_ids = lowest(ids) end

  -- Trim what is at or below the horizons (see due).
  if has_sliding and due(b_log, horizon, retention, late) then
    if log_is_index then
      b_log = trim_index(meta, log, horizon, late)
    else
      call('ZREMRANGEBYSCORE', log, '-inf', horizon)
      b_log = lowest(log)
    end
  end
  if index_apart and due(b_ids, dedup_horizon, dedup, late) then
    b_ids = trim_index(meta, ids, dedup_horizon, late)
  end

  -- Distinct callees: raise this callee's latest call time, count those after t - Wmax.
  local distinct = ''
  if track_callees then
    if due(b_callees, horizon, retention, late) then
      call('ZREMRANGEBYSCORE', callees, '-inf', horizon)
      b_callees = lowest(callees)
      n_callees = nil
    end
    local none_kept = b_callees == EMPTY
    if none_kept then n_callees = 0 end
    if callee ~= '' then
      -- A new callee only while fewer than the cap are kept (above the
      -- horizon); known ones are raised. N bounds the set's size from
      -- above (old entries included), so those are counted only near the
      -- cap.
      if not n_callees then n_callees = call('ZCARD', callees) end
      if n_callees < max_callees
        or call('ZCOUNT', callees, '(' .. fmt('%d', horizon), '+inf') < max_callees then
        n_callees = n_callees + call('ZADD', callees, 'GT', t, callee)
      else
        -- At the cap: only a kept callee is raised; one left over from
        -- before the horizon (trimmed lazily) is gone for the contract.
        local cur = tonumber(call('ZSCORE', callees, callee))
        if cur and cur > horizon then call('ZADD', callees, 'XX', 'GT', t, callee) end
      end
      b_callees = lower(b_callees, t)
      call('PEXPIRE', callees, retention + slack)
    end
    if none_kept then
      -- Nothing was kept before this call: it is the only callee, if any.
      distinct = (callee ~= '' and max_callees > 0) and '1' or '0'
    else
      distinct = fmt('%d', call('ZCOUNT', callees, '(' .. fmt('%d', t - wmax), '+inf'))
    end
  end

  -- A token bucket's TAT as kept, unless the caller starts afresh.
  local function read_tat(i)
    if not prev then return nil end
    local ms, rem = string.match(mv[tfield[i]] or '', '^(-?%d+),(%d+)$')
    if not ms then return nil end
    return {tonumber(ms), tonumber(rem)}
  end

  -- Rules with sets of their own: drop what is at or below the horizon.
  local okeys = {}
  if mask ~= '' or has_own_sets then
    for i = 1, n do
      okeys[i] = own_key(i)
      if okeys[i] and near(i) then
        if paired[i] then
          -- Pairs whose latest call is at or below the horizon go, state and all.
          local old = call('ZRANGEBYSCORE', okeys[i], '-inf', horizon)
          for s0 = 1, #old, 1000 do
            call('HDEL', stem .. ':p:' .. suffix[i], unpack(old, s0, math.min(s0 + 999, #old)))
          end
        end
        call('ZREMRANGEBYSCORE', okeys[i], '-inf', horizon)
      end
    end
  end

  local counts, approx, fixed, fchanged, tats, pst = {}, {}, {}, false, {}, {}
  for i = 1, n do
    local w = wins[i]
    local b = floor(t / w)
    local kind = kinds[i]
    if kind == 5 then
      counts[i] = outside_count[i] or 0
    elseif not sees(i) then
      counts[i] = 0
    elseif paired[i] then
      if callee == '' then
        counts[i] = 0
      elseif t <= horizon then
        counts[i] = 1
      else
        local st = pair_parse(i, call('HGET', stem .. ':p:' .. suffix[i], callee), horizon)
        call('ZADD', okeys[i], 'GT', t, callee)
        pst[i] = st
        if kind == 1 then
          local c = 1
          for j = 1, #st do
            if st[j] > t - w and st[j] <= t then c = c + 1 end
          end
          counts[i] = c
        elseif kind == 0 then
          if (b + 1) * w + grace <= lnew then counts[i] = 1 else counts[i] = (st[b] or 0) + 1 end
        elseif kind == 2 then
          st[2], st[3], st[4], counts[i] = approx_count(st[2], st[3], st[4], t, w, horizon)
        else
          pst[i] = {tat = tat_next(st, t, i), old = st}
          counts[i] = tat_level(pst[i].tat, t, i)
        end
      end
    elseif kind == 4 then
      if callee == '' then
        counts[i] = 0
      else
        local live = call('ZCOUNT', okeys[i], '(' .. fmt('%d', t - w), '+inf')
        local own = tonumber(call('ZSCORE', okeys[i], callee))
        if not (own and own > t - w) then live = live + 1 end
        counts[i] = math.min(live, max_callees)
      end
    elseif kind == 3 then
      if t <= horizon then
        -- Past the retention: counts 1, not recorded.
        counts[i] = 1
      else
        tats[i] = tat_next(read_tat(i), t, i)
        counts[i] = tat_level(tats[i], t, i)
      end
    elseif kind == 1 and okeys[i] then
      counts[i] = 1 + call('ZCOUNT', okeys[i], '(' .. fmt('%d', t - w), fmt('%d', t))
    elseif kind == 1 then
      if b_log == EMPTY then
        counts[i] = 1
      else
        counts[i] = 1 + call('ZCOUNT', log, '(' .. fmt('%d', t - w), fmt('%d', t))
      end
    elseif kind == 0 then
      local fb = parse_buckets(mv[ffield[i]])
      fixed[i] = fb
      if (b + 1) * w + grace <= lnew then
        counts[i] = 1
      else
        counts[i] = (fb[b] or 0) + 1
        if not admitted then
          -- Under attempts every call in a live bucket counts: count it now.
          fb[b] = counts[i]
          fchanged = true
        end
      end
    elseif t <= horizon then
      -- sliding-approx past the retention: counts 1, moves nothing.
      counts[i] = 1
    else
      local k = afield[i]
      local cb, cur, pv = nil, 0, 0
      if prev then
        cb, cur, pv = tonumber(mv[k]), tonumber(mv[k + 1]) or 0, tonumber(mv[k + 2]) or 0
      end
      cb, cur, pv, counts[i] = approx_count(cb, cur, pv, t, w, horizon)
      approx[i] = {k, cb, cur, pv, b}
    end
  end

  local would, reason, by_shadow = 0, 'ok', false
  -- `listed` (src/store/redis/script.rs): '0' none, '1' allowlist,
  -- '2' denylist, '3' an unusable caller allowed, '4' one rejected.
  -- (Literals: `decide` is at Lua's limit of 60 upvalues.)
  if listed == '2' then
    would, reason = 1, 'denylist'
  elseif listed == '4' then
    would, reason = 1, 'bad_caller'
  elseif listed == '1' then
    reason = 'allowlist'
  elseif listed == '3' then
    reason = 'bad_caller'
  else
    -- The first enforcing rule over its limit, else the first shadow one.
    for i = 1, n do
      if counts[i] > lims[i] then
        if not rshadow[i] then
          would, reason, by_shadow = 1, names[i], false
          break
        elseif would == 0 then
          would, reason, by_shadow = 1, names[i], true
        end
      end
    end
  end

  if (not admitted) or would == 0 then
    if has_sliding then
      call('ZADD', log, t, id)
      b_log = lower(b_log, t)
      call('PEXPIRE', log, retention + slack)
    end
    for i = 1, n do
      local kind = kinds[i]
      if not sees(i) then
        -- Not seen: nothing of the rule's changes.
      elseif paired[i] then
        local st = pst[i]
        if st then
          local b = floor(t / wins[i])
          if kind == 1 then
            local j = #st
            while j >= 1 and st[j] > t do j = j - 1 end
            table.insert(st, j + 1, t)
          elseif kind == 0 then
            if (b + 1) * wins[i] + grace > lnew then st[b] = (st[b] or 0) + 1 end
          elseif kind == 2 then
            if b == st[2] then st[3] = st[3] + 1 elseif b == st[2] - 1 then st[4] = st[4] + 1 end
          else
            st.old = st.tat
          end
        end
      elseif kind == 0 then
        local b = floor(t / wins[i])
        if admitted and (b + 1) * wins[i] + grace > lnew then
          fixed[i][b] = counts[i]
          fchanged = true
        end
      elseif kind == 1 and okeys[i] then
        call('ZADD', okeys[i], t, id)
        call('PEXPIRE', okeys[i], retention + slack)
      elseif kind == 3 and tats[i] then
        mv[tfield[i]] = fmt('%d,%d', tats[i][1], tats[i][2])
        tats[i].changed = true
      elseif kind == 4 and callee ~= '' then
        call('ZADD', okeys[i], 'GT', t, callee)
        local extra = call('ZCARD', okeys[i]) - max_callees
        if extra > 0 then call('ZPOPMIN', okeys[i], extra) end
        call('PEXPIRE', okeys[i], retention + slack)
      elseif kind == 2 and approx[i] then
        local a = approx[i]
        if a[5] == a[2] then
          a[3] = a[3] + 1
        elseif a[5] == a[2] - 1 and t > horizon then
          a[4] = a[4] + 1
        end
      end
    end
  end

  -- Pairs touched by this call: written back, then the cap.
  for i = 1, n do
    local st = pst[i]
    if st then
      local hk = stem .. ':p:' .. suffix[i]
      local v
      if kinds[i] == 3 then v = pair_format(i, st.old, lnew) else v = pair_format(i, st, lnew) end
      call('HSET', hk, callee, v)
      local extra = call('ZCARD', okeys[i]) - max_callees
      if extra > 0 then
        local popped = call('ZPOPMIN', okeys[i], extra)
        for j = 1, #popped, 2 do call('HDEL', hk, popped[j]) end
      end
      call('PEXPIRE', okeys[i], retention + slack)
      call('PEXPIRE', hk, retention + slack)
    end
  end

  local shadow = 0
  if (shadow_mode or by_shadow) and would == 1 then shadow = 1 end
  local decision = would
  if shadow == 1 then decision = 0 end
  local retry = ''
  -- A list's reject is for good: no time after which it would pass.
  if decision == 1 and listed ~= '2' and listed ~= '4' then
    -- The rules' time-profile ranges, from the mask's tail (globals and
    -- upvalues already in use only: `decide` is at Lua's limit of 60).
    local profiles = nil
    local bar = string.find(mask, '|', 1, true)
    if bar then
      profiles = {}
      local r = 0
      for part in string.gmatch(string.sub(mask, bar + 1) .. ';', '([^;]*);') do
        r = r + 1
        if part ~= '' then
          local ranges = {}
          for a, b in string.gmatch(part, '(%d+)%-(%d+)') do
            ranges[#ranges + 1] = {tonumber(a), tonumber(b)}
          end
          profiles[r] = ranges
        end
      end
    end
    local last = t
    for i = 1, n do
      local kind, w, lim = kinds[i], wins[i], lims[i]
      local s
      if rshadow[i] or not near(i) then
        s = nil
      elseif kind == 5 then
        s = outside_until[i]
      elseif paired[i] then
        local pl = callee ~= '' and tonumber(call('ZSCORE', okeys[i], callee))
        if pl then
          local st = pair_parse(i, call('HGET', stem .. ':p:' .. suffix[i], callee), horizon)
          local pexp = pl + retention
          if kind == 1 then
            s = list_until(st, t, w, lim)
          elseif kind == 0 then
            s = fixed_until(st, t, lnew, w, lim)
          elseif kind == 2 then
            if st[2] then s = approx_until(st, pexp, w, lim) end
          elseif st then
            s = tat_until(st, t, i, lim)
            if s then s = math.min(s, pexp - 1) end
          end
          if s and s <= t then s = nil end
        end
      elseif kind == 1 and okeys[i] then
        s = sliding_until(okeys[i], t, w, lim)
      elseif kind == 3 then
        local tat = tats[i]
        -- Not recorded (not seen, or admitted): the bucket as it was.
        if not (tat and tat.changed) then tat = read_tat(i) end
        if tat then s = tat_until(tat, t, i, lim) end
        if s then s = math.min(s, lnew + retention - 1) end
      elseif kind == 4 then
        if callee ~= '' then s = distinct_until(okeys[i], callee, t, w, lim) end
        if s then s = math.min(s, lnew + retention - 1) end
      elseif kind == 1 then
        s = sliding_until(log, t, w, lim)
      elseif kind == 0 then
        -- A rule that did not see the call: its buckets as kept.
        s = fixed_until(fixed[i] or parse_buckets(mv[ffield[i]]), t, lnew, w, lim)
      else
        local a = approx[i]
        if not a and prev then
          -- A rule that did not see the call: its counters as kept.
          local k = afield[i]
          local cb = tonumber(mv[k])
          if cb then a = {k, cb, tonumber(mv[k + 1]) or 0, tonumber(mv[k + 2]) or 0} end
        end
        if a then s = approx_until(a, lnew + retention, w, lim) end
      end
      if s and profiles and profiles[i] and s <= t + grace + retention then
        -- The last instant up to s the rule's profile holds at (past the
        -- ranges' span, only a late call's, s stands: see the engine).
        local x = nil
        for _, ab in ipairs(profiles[i]) do
          if ab[1] <= s then x = math.min(s, ab[2] - 1) end
        end
        s = x
      end
      if s and s > last then last = s end
    end
    local ra = last + 1 - t
    retry = fmt('%d', ra)
    if block and not outside_names[reason] then
      call('SET', prefix .. 'block:' .. string.sub(stem, #prefix + 1), reason, 'PX', ra)
    end
  end

  local parts = {}
  for i = 1, n do parts[i] = fmt('%d', counts[i]) end
  local warn = ''
  if decision == 0 and listed == '0' then
    for i = 1, n do
      if warns[i] and counts[i] > warns[i] then
        warn = names[i]
        break
      end
    end
  end
  local encoded = fmt('%d', t) .. '|' .. decision .. '|' .. reason .. '|' .. shadow .. '|' .. (late and 1 or 0)
    .. '|' .. version .. '|' .. (prev and fmt('%d', prev) or '') .. '|' .. distinct
    .. '|' .. table.concat(parts, ',') .. '|' .. retry .. '|' .. warn
  if index_apart then
    call('ZADD', ids, t, id)
    b_ids = lower(b_ids, t)
    call('PEXPIRE', ids, dedup + slack)
  end

  -- One write of the meta hash: latest time, bounds, approx counters.
  local mset = {'L', fmt('%d', lnew)}
  if idem then mset[#mset + 1] = rfield; mset[#mset + 1] = encoded end
  if has_sliding then mset[#mset + 1] = 'O'; mset[#mset + 1] = bound_str(b_log, lnew) end
  if index_apart then mset[#mset + 1] = 'I'; mset[#mset + 1] = bound_str(b_ids, lnew) end
  if track_callees then
    mset[#mset + 1] = 'C'; mset[#mset + 1] = bound_str(b_callees, lnew)
    if n_callees then mset[#mset + 1] = 'N'; mset[#mset + 1] = fmt('%d', n_callees) end
  end
  if fchanged then
    for i = 1, n do
      if kinds[i] == 0 and fixed[i] then
        mset[#mset + 1] = mfields[ffield[i]]
        mset[#mset + 1] = format_buckets(fixed[i], wins[i], lnew)
      end
    end
  end
  for i = 1, n do
    if tats[i] and tats[i].changed then
      mset[#mset + 1] = mfields[tfield[i]]; mset[#mset + 1] = mv[tfield[i]]
    elseif kinds[i] == 3 and not prev and mv[tfield[i]] then
      -- The caller starts afresh: so does its bucket.
      mset[#mset + 1] = mfields[tfield[i]]; mset[#mset + 1] = ''
    end
    local a = approx[i]
    if not a and kinds[i] == 2 and not prev and mv[afield[i]] then
      -- The caller starts afresh: so do counters this call left alone.
      local k = afield[i]
      mset[#mset + 1] = mfields[k]; mset[#mset + 1] = ''
    end
    if a then
      local k = a[1]
      mset[#mset + 1] = mfields[k]; mset[#mset + 1] = fmt('%d', a[2])
      mset[#mset + 1] = mfields[k + 1]; mset[#mset + 1] = fmt('%d', a[3])
      mset[#mset + 1] = mfields[k + 2]; mset[#mset + 1] = fmt('%d', a[4])
    end
  end
  call('HSET', meta, unpack(mset))
  call('PEXPIRE', meta, meta_ttl)
  return 0, encoded
end

local out = {}
for j = 1, #KEYS do
  local base = E + (j - 1) * 6
  local dup, encoded = decide(KEYS[j], tonumber(ARGV[base + 1]), ARGV[base + 2], ARGV[base + 3], ARGV[base + 4],
    ARGV[base + 5], ARGV[base + 6])
  out[#out + 1] = dup
  out[#out + 1] = encoded
end
return out
