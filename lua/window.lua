-- callguard window script: decides a batch of calls atomically, in order.
-- (Loaded as `#!lua`, then lua/sums.lua, then this file: see WINDOW_LUA.)
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
--   :o:<rule>:<W>  a concurrent rule's calls held open: hash, field
--          "<start>|<call_id>", value "<close>,<ended 0/1>[,<callee>]" (the
--          callee for a rule keyed by caller and callee; dropped once the
--          close is at or before L' - grace; all dropped when the caller
--          starts afresh; src/engine/window/open.rs)
--   :pe    ends of calls not seen yet: sorted set, member call_id, score
--          the end time (trimmed at the idempotency horizon; at most 1024:
--          past that ZPOPMIN drops the lowest (time, call_id))
--   :pt    with sum rules, the talk time of each end in :pe: hash, field
--          call_id (dropped with it)
--   :sw:<rule>:<W>:<M>  a sum rule's calls waiting for their ends (M its
--          max_duration): hash, field call_id, value its waiting calls
--          (usually one) "<start>,<k>,<price per minute>,<increment>"
--          joined by ';' (k calls alike; the price empty for a talk sum or
--          an unpriced callee); field '' a lower bound of start + M over
--          them, so the hash is scanned only when a call may be let go
--          (once start + M is at or below L' - grace)
--   :se:<rule>:<W>:<M>  what a sliding sum rule's ended calls added:
--          sorted set, member "<amount>|<start>|<call_id>|<end>|<k>",
--          score the time it was added at (src/engine/window/sums.rs)
--   :sb:<rule>:<W>:<M>  a fixed or sliding-approx sum rule's: hash, field
--          bucket, value the sum added in it (the count needs no more);
--          either trimmed once no call at or after L' - grace can see it
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
--   5 keyed by callee or global: decided before, nothing kept here,
--   6 concurrent), window (ms; a token bucket's span, a concurrent rule's
--   max_duration), limit (a token bucket's burst),
--   name, flags (1 shadow + 2 own log: a sliding rule that sees only some
--   calls + 4 keyed by caller and callee, its pairs' state kept + 8 a
--   concurrent rule keyed by caller and callee + 16 a sum rule + 32 a cost
--   sum), warn level ('' none), rate "<n>/<period ms>" (a token bucket's;
--   a sum rule's max_duration (ms); '' otherwise)
-- then per event j, 6 values: t (event time, ms), call_id,
--   listed (0 no, 1 allow, 2 deny, 3 an unusable caller allowed, 4 one
--   rejected: reason `bad_caller`; E: the event is the call's end, applied
--   and not decided, its record "E"), callee ('' for none), mask: '' when
--   every rule sees every call, else one character per rule: 1 the rule
--   sees the call, 2 it does not now (time profile) but sees its callee
--   (it counts for the retry-after), 0 neither (RuleSet::mask), and when
--   a rule has a time profile, `|` and per rule (';' between them) the
--   ranges "a-b,..." of instants from t on that its profile holds at
--   (empty for a rule without one): a rule rejects only calls it sees, so
--   its part of the retry-after ends at the last of them; outside:
--   per kind-5 rule in order, "<count>:<until>" joined by ',' (until, the
--   rule's last rejecting time, '' for none; src/engine/aggregate/mod.rs),
--   then, when the rule set has a cost sum, '#' and per rule (';' between
--   them) the price of a call to this callee, "<per minute>/<increment>"
--   ('' none). For a call's end (listed E) this value is its talk time (ms).
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

-- Rule kinds, as ARGV sends them (src/store/redis/script.rs).
local FIXED, SLIDING, APPROX, TOKEN, DISTINCT, OUTSIDE, CONCURRENT = 0, 1, 2, 3, 4, 5, 6
-- An event's `listed` (src/store/redis/script.rs): none, allowlist,
-- denylist, an unusable caller allowed, one rejected (reason bad_caller).
local LISTED_NONE, LISTED_ALLOW, LISTED_DENY, LISTED_BAD_ALLOWED, LISTED_BAD_REJECTED = '0', '1', '2', '3', '4'
-- Not a list code: the event is a call's end.
local CALL_END = 'E'

-- The rule set, parsed once.
local kinds, wins, lims, names, ffield, afield = {}, {}, {}, {}, {}, {}
local rshadow, warns, rcalls, rper, tfield, suffix, ownlog, paired = {}, {}, {}, {}, {}, {}, {}, {}
-- A concurrent rule keyed by caller and callee: its calls counted per callee.
local bycallee = {}
-- Sum rules: whether a rule is one, a cost one, its max_duration, and
-- its keys' suffix (name, window, max_duration).
local summed, costed, smax, ssuffix = {}, {}, {}, {}
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
  paired[i] = flags % 8 >= 4
  bycallee[i] = flags % 16 >= 8
  summed[i] = flags % 32 >= 16
  costed[i] = flags >= 32
  warns[i] = tonumber(ARGV[base + 6])
  suffix[i] = names[i] .. ':' .. fmt('%d', wins[i])
  local rc, rp = string.match(ARGV[base + 7], '^(%d+)/(%d+)$')
  rcalls[i], rper[i] = tonumber(rc), tonumber(rp)
  if summed[i] then
    smax[i] = tonumber(ARGV[base + 7])
    ssuffix[i] = suffix[i] .. ':' .. fmt('%d', smax[i])
  elseif paired[i] then
    -- Kept per pair, not in meta.
  elseif kinds[i] == FIXED then
    ffield[i] = #mfields + 1
    mfields[#mfields + 1] = 'f:' .. names[i] .. ':' .. fmt('%d', wins[i])
  elseif kinds[i] == TOKEN then
    tfield[i] = #mfields + 1
    mfields[#mfields + 1] = 't:' .. suffix[i]
  elseif kinds[i] == APPROX then
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
  if kinds[i] == OUTSIDE then outside_names[names[i]] = true end
end
-- Whether some rule keeps sorted sets of its own (distinct callees, pairs;
-- own logs come with a mask).
local has_own_sets = false
for i = 1, n do
  if kinds[i] == DISTINCT or paired[i] then has_own_sets = true end
end
-- The concurrent rules, in order, and the most ends of calls not seen
-- yet a caller keeps (src/engine/window/open.rs MAX_PENDING_ENDS).
local concurrent = {}
for i = 1, n do
  if kinds[i] == CONCURRENT then concurrent[#concurrent + 1] = i end
end
local MAX_PENDING_ENDS = 1024
local has_concurrent = #concurrent > 0
local sums = {}
for i = 1, n do
  if summed[i] then sums[#sums + 1] = i end
end
local has_sums = #sums > 0
local has_ends = has_concurrent or has_sums
-- c_open of a rule set without concurrent rules (no table per event).
local NO_OPEN = {}
-- Each rule's own sorted set, as a suffix of the caller's stem (false:
-- none): pairs' latest times, distinct callees, an own log.
local own_suffix = {}
for i = 1, n do
  own_suffix[i] = false
  if paired[i] then
    own_suffix[i] = ':pz:' .. suffix[i]
  elseif kinds[i] == DISTINCT then
    own_suffix[i] = ':d:' .. suffix[i]
  elseif ownlog[i] then
    own_suffix[i] = ':l:' .. suffix[i]
  end
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
  if kind == SLIDING then
    local times = {}
    for x in string.gmatch(v or '', '-?%d+') do
      local e = tonumber(x)
      if e > horizon then times[#times + 1] = e end
    end
    return times
  elseif kind == FIXED then
    return parse_buckets(v or false)
  elseif kind == APPROX then
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
  if kind == SLIDING then
    local parts = {}
    for j = 1, #st do parts[j] = fmt('%d', st[j]) end
    return table.concat(parts, ',')
  elseif kind == FIXED then
    return format_buckets(st, wins[i], lnew)
  elseif kind == APPROX then
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
-- One call's decision, in phases over what the call has read and
-- decided so far (one function per phase keeps each under Lua's limit of
-- 60 upvalues): read the call's arguments and the caller's meta
-- (a redelivery ends there), trim the sets, count per rule, judge, record
-- the call, then its retry-after and block key, and write meta back.

-- The call being decided, one at a time: set by `decide` and the phases
-- that read it, read by the phases after them (script-level locals, not a
-- table: a table's fields cost Redis about 6% more time per call).
local c_stem, c_t, c_id, c_listed, c_callee, c_mask
local c_meta, c_log, c_ids, c_callees, c_rfield, c_mv
local c_lnew, c_horizon, c_dedup_horizon, c_prev, c_late
local c_b_log, c_b_ids, c_b_callees, c_n_callees, c_okeys, c_distinct
local c_counts, c_approx, c_fixed, c_fchanged, c_tats, c_pst
-- Per concurrent rule, the calls it holds (see open_calls).
local c_open
-- Per cost sum rule, the price of a call to this callee {per minute,
-- increment} (see read_prices).
local c_prices

-- A token bucket's TAT as kept, unless the caller starts afresh.
local function read_tat(i)
  if not c_prev then return nil end
  local ms, rem = string.match(c_mv[tfield[i]] or '', '^(-?%d+),(%d+)$')
  if not ms then return nil end
  return {tonumber(ms), tonumber(rem)}
end

-- The kind-5 rules' counts and last rejecting times, in rule order.
local NONE_OUTSIDE = {}
local function read_outside(outside)
  if outside == '' then
    outside_count, outside_until = NONE_OUTSIDE, NONE_OUTSIDE
    return
  end
  outside_count, outside_until = {}, {}
  local i = 0
  for c, u in string.gmatch(outside, '(%d+):(%-?%d*)') do
    repeat i = i + 1 until i > n or kinds[i] == OUTSIDE
    outside_count[i], outside_until[i] = tonumber(c), tonumber(u)
  end
end

-- A concurrent rule's calls held open, from its hash: per call
-- {start, close, ended, call_id, field, callee ('' for none)}.
local function open_calls(key)
  local flat = call('HGETALL', key)
  local calls = {}
  for j = 1, #flat, 2 do
    local start, id = string.match(flat[j], '^(-?%d+)|(.*)$')
    local close, ended, callee = string.match(flat[j + 1], '^(-?%d+),(%d),?(.*)$')
    calls[#calls + 1] = {tonumber(start), tonumber(close), ended == '1', id, flat[j], callee}
  end
  return calls
end

-- A concurrent rule's count of a call at t: the calls open at t (to
-- callee alone, unless nil), plus one.
local function open_count(calls, t, callee)
  local c = 1
  for _, x in ipairs(calls) do
    if x[1] <= t and t < x[2] and (not callee or x[6] == callee) then c = c + 1 end
  end
  return c
end

-- The value a held call's hash field keeps.
local function open_value(close, ended, callee)
  local v = fmt('%d', close) .. ',' .. (ended and '1' or '0')
  if callee ~= '' then v = v .. ',' .. callee end
  return v
end

-- What a call ending with `talk` ms adds to sum rule i (lua/sums.lua,
-- loaded in front of this script, has the arithmetic).
local function sum_amount(i, talk, per, inc)
  return sum_amount_of(costed[i], per, inc, talk)
end

-- How long a sum rule's keys must outlive their latest write.
local function sum_ttl(i)
  return math.max(smax[i], 2 * wins[i]) + grace + slack
end

-- Whether sum rule i keeps bucket sums (fixed, sliding-approx) rather
-- than each ended call (sliding).
local function bucketed(i)
  return kinds[i] ~= SLIDING
end

-- A waiting field's calls: {start, k, per minute, increment} each.
local function waiting_of(v)
  local calls = {}
  if not v then return calls end
  for start, k, per, inc in string.gmatch(v, '(-?%d+),(%d+),(%d*),(%d*)') do
    calls[#calls + 1] = {tonumber(start), tonumber(k), tonumber(per), tonumber(inc)}
  end
  return calls
end

-- A waiting field's value from its calls.
local function waiting_value(calls)
  local parts = {}
  for j, c in ipairs(calls) do
    parts[j] = fmt('%d', c[1]) .. ',' .. fmt('%d', c[2]) .. ',' .. (c[3] and fmt('%d', c[3]) or '')
      .. ',' .. (c[4] and fmt('%d', c[4]) or '')
  end
  return table.concat(parts, ';')
end

-- What an ended call adds to sum rule i, at `at`.
local function sum_add(stem, i, at, amount, start, id, tag)
  if bucketed(i) then
    local key = stem .. ':sb:' .. ssuffix[i]
    call('HINCRBY', key, fmt('%d', floor(at / wins[i])), amount)
    call('PEXPIRE', key, sum_ttl(i))
    return
  end
  local key = stem .. ':se:' .. ssuffix[i]
  call('ZADD', key, at, fmt('%d', amount) .. '|' .. fmt('%d', start) .. '|' .. id .. '|' .. tag)
  call('PEXPIRE', key, sum_ttl(i))
end

-- The sum of what was added in [lo, hi] (a sliding sum rule's).
local function sum_between(key, lo, hi)
  local s = 0
  for _, m in ipairs(call('ZRANGEBYSCORE', key, fmt('%d', lo), fmt('%d', hi))) do
    s = s + tonumber(string.match(m, '^(%d+)|'))
  end
  return s
end

-- Phase 2, sum rules: waiting calls whose start + max_duration is at or
-- below L' - grace let go (the hash scanned only when its bound says one
-- may be); what no call at or after L' - grace can see dropped (fixed:
-- dead buckets; sliding-approx: before the bucket before; sliding: out
-- of the window).
local function trim_sums()
  local let_go = c_lnew - grace
  for _, i in ipairs(sums) do
    local wkey = c_stem .. ':sw:' .. ssuffix[i]
    local bound = tonumber(call('HGET', wkey, ''))
    if bound and bound <= let_go then
      local flat = call('HGETALL', wkey)
      local low = nil
      for j = 1, #flat, 2 do
        if flat[j] ~= '' then
          local kept = {}
          for _, c in ipairs(waiting_of(flat[j + 1])) do
            local go = c[1] + smax[i]
            if go > let_go then
              kept[#kept + 1] = c
              if not low or go < low then low = go end
            end
          end
          if #kept == 0 then
            call('HDEL', wkey, flat[j])
          else
            call('HSET', wkey, flat[j], waiting_value(kept))
          end
        end
      end
      if low then call('HSET', wkey, '', fmt('%d', low)) else call('HDEL', wkey, '') end
    end
    local w = wins[i]
    if bucketed(i) then
      -- Buckets below B (fixed: dead) or B - 1 (sliding-approx).
      local first = floor(let_go / w)
      if kinds[i] == APPROX then first = first - 1 end
      local bkey = c_stem .. ':sb:' .. ssuffix[i]
      for _, b in ipairs(call('HKEYS', bkey)) do
        if tonumber(b) < first then call('HDEL', bkey, b) end
      end
    else
      call('ZREMRANGEBYSCORE', c_stem .. ':se:' .. ssuffix[i], '-inf', fmt('%d', let_go - w))
    end
  end
end

-- A call's end (not decided): closes the call in every concurrent rule
-- that holds it (its latest by start); an end for a call not held is kept
-- for the idempotency horizon, unless the call was decided within it (its
-- record newer than L - D). Ends move no horizon.
local function end_call(stem, t, id, talk)
  if not has_ends then return end
  local held = false
  for _, i in ipairs(concurrent) do
    local key = stem .. ':o:' .. suffix[i]
    local best = nil
    for _, c in ipairs(open_calls(key)) do
      if c[4] == id and (not best or c[1] > best[1]) then best = c end
    end
    if best then
      held = true
      if not best[3] then
        local close = math.min(best[2], math.max(t, best[1]))
        call('HSET', key, best[5], open_value(close, true, best[6]))
      end
    end
  end
  -- Each sum rule's latest waiting call of that id stops waiting; its
  -- end adds if it came within max_duration.
  for _, i in ipairs(sums) do
    local key = stem .. ':sw:' .. ssuffix[i]
    local calls = waiting_of(call('HGET', key, id))
    local best = nil
    for j, c in ipairs(calls) do
      if not best or c[1] > calls[best][1] then best = j end
    end
    if best then
      held = true
      local c = calls[best]
      local k = c[2]
      if k > 1 then
        c[2] = k - 1
      else
        table.remove(calls, best)
      end
      if #calls == 0 then call('HDEL', key, id) else call('HSET', key, id, waiting_value(calls)) end
      if t < c[1] + smax[i] then
        sum_add(stem, i, math.max(t, c[1]), sum_amount(i, talk, c[3], c[4]), c[1], id, fmt('%d,%d', t, k))
      end
    end
  end
  if held then return end
  if idem then
    local mv = call('HMGET', stem .. ':m', 'L', 'r:' .. id)
    local latest, stored = tonumber(mv[1]), mv[2]
    if latest and stored then
      local sts = tonumber(string.match(stored, '^(-?%d+)|'))
      if sts > latest - dedup then return end
    end
  end
  local pe, pt = stem .. ':pe', stem .. ':pt'
  local added = call('ZADD', pe, 'NX', t, id)
  if has_sums and added == 1 then call('HSET', pt, id, fmt('%d', talk)) end
  local extra = call('ZCARD', pe) - MAX_PENDING_ENDS
  if extra > 0 then
    local popped = call('ZPOPMIN', pe, extra)
    if has_sums then
      for j = 1, #popped, 2 do call('HDEL', pt, popped[j]) end
    end
  end
  call('PEXPIRE', pe, dedup + slack)
  if has_sums then call('PEXPIRE', pt, dedup + slack) end
end

-- The prices of a call to this callee, per rule ("<per>/<inc>" or '',
-- ';' between rules).
local NO_PRICES = {}
local function read_prices(s)
  c_prices = {}
  local r = 0
  for part in string.gmatch(s .. ';', '([^;]*);') do
    r = r + 1
    local per, inc = string.match(part, '^(%d+)/(%d+)$')
    if per then c_prices[r] = {tonumber(per), tonumber(inc)} end
  end
end

-- Phase 4, sum rules: what the kept ends add up to in the window of the
-- call at t (the call itself adds nothing).
local function sum_count(i)
  local t, w = c_t, wins[i]
  local b = floor(t / w)
  local kind = kinds[i]
  if kind == SLIDING then
    return sum_between(c_stem .. ':se:' .. ssuffix[i], t - w + 1, t)
  end
  local bkey = c_stem .. ':sb:' .. ssuffix[i]
  if kind == FIXED then
    if (b + 1) * w + grace <= c_lnew then return 0 end
    return tonumber(call('HGET', bkey, fmt('%d', b))) or 0
  end
  local v = call('HMGET', bkey, fmt('%d', b - 1), fmt('%d', b))
  local prev, cur = tonumber(v[1]) or 0, tonumber(v[2]) or 0
  return mul_div(prev, w - (t - b * w) - 1, w) + cur
end

-- Phase 7, sum rules: the last time s > t at which a call would be over
-- the limit, given what is kept (see Sums::rejects_until), or nil.
local function sum_until(i)
  local t, w, lim = c_t, wins[i], lims[i]
  local kind = kinds[i]
  if kind == SLIDING then
    local flat = call('ZRANGE', c_stem .. ':se:' .. ssuffix[i], 0, -1, 'WITHSCORES')
    local ats, amts = {}, {}
    for j = 1, #flat, 2 do
      ats[#ats + 1] = tonumber(flat[j + 1])
      amts[#amts + 1] = tonumber(string.match(flat[j], '^(%d+)|'))
    end
    -- The sum changes only as an end enters or leaves the window.
    for j = #ats, 1, -1 do
      local s = ats[j] + w - 1
      if s <= t then return nil end
      local sum = 0
      for q = 1, #ats do
        if ats[q] > s - w and ats[q] <= s then sum = sum + amts[q] end
      end
      if sum > lim then return s end
    end
    return nil
  end
  local bsum, blist = {}, {}
  local flat = call('HGETALL', c_stem .. ':sb:' .. ssuffix[i])
  for j = 1, #flat, 2 do
    local b, v = tonumber(flat[j]), tonumber(flat[j + 1])
    if v > 0 then
      bsum[b] = v
      blist[#blist + 1] = b
    end
  end
  if #blist == 0 then return nil end
  table.sort(blist)
  local from = floor(t / w)
  if kind == FIXED then
    for j = #blist, 1, -1 do
      local b = blist[j]
      if b < from then return nil end
      if bsum[b] > lim then
        local s = (b + 1) * w - 1
        if s > t then return s end
        return nil
      end
    end
    return nil
  end
  local cands, seen = {}, {}
  for j = #blist, 1, -1 do
    for _, b in ipairs({blist[j] + 1, blist[j]}) do
      if not seen[b] then
        seen[b] = true
        cands[#cands + 1] = b
      end
    end
  end
  table.sort(cands, function(x, y) return x > y end)
  for _, b in ipairs(cands) do
    if b < from then return nil end
    local r = sum_last_over(bsum[b - 1] or 0, bsum[b] or 0, w, lim)
    if r and b * w + r > t then return b * w + r end
  end
  return nil
end

-- Phase 1: the caller's meta, its times and horizons; the stored record
-- of a redelivered call (returned: nothing else is done).
local function read_meta()
  local stem = c_stem
  c_meta, c_log, c_ids, c_callees = stem .. ':m', stem .. ':l', stem .. ':i', stem .. ':c'
  c_rfield = 'r:' .. c_id
  mfields[NM + 1] = c_rfield
  local mv = call('HMGET', c_meta, unpack(mfields, 1, NM + (idem and 1 or 0)))
  c_mv = mv
  local t, latest = c_t, tonumber(mv[1])
  c_lnew = t
  if latest and latest > t then c_lnew = latest end
  c_horizon = c_lnew - retention
  c_dedup_horizon = c_lnew - dedup
  if idem then
    local stored = mv[NM + 1]
    if stored then
      local sts = tonumber(string.match(stored, '^(-?%d+)|'))
      if sts > c_dedup_horizon then return stored end
    end
  end
  if latest and latest > c_horizon then c_prev = latest end
  c_late = c_prev ~= nil and t < c_prev - grace
  c_b_log, c_b_ids, c_b_callees = bound(mv[2], latest), bound(mv[3], latest), bound(mv[4], latest)
  c_n_callees = latest and tonumber(mv[5])
  if not mv[1] then
    -- No meta: the log and the callees expire with it or before, so they are
    -- empty; the index may outlive it.
    c_b_log, c_b_callees = EMPTY, EMPTY
  end
  if index_apart and c_b_ids == nil then c_b_ids = lowest(c_ids) end
  return nil
end

-- Phase 2: trim what is at or below the horizons (see due): the log, the
-- index, and the sets of rules with sets of their own.
local function trim()
  local horizon, late = c_horizon, c_late
  if has_sliding and due(c_b_log, horizon, retention, late) then
    if log_is_index then
      c_b_log = trim_index(c_meta, c_log, horizon, late)
    else
      call('ZREMRANGEBYSCORE', c_log, '-inf', horizon)
      c_b_log = lowest(c_log)
    end
  end
  if index_apart and due(c_b_ids, c_dedup_horizon, dedup, late) then
    c_b_ids = trim_index(c_meta, c_ids, c_dedup_horizon, late)
  end
  local okeys = {}
  c_okeys = okeys
  local stem, mask = c_stem, c_mask
  if mask ~= '' or has_own_sets then
    for i = 1, n do
      local os = own_suffix[i]
      if os then okeys[i] = stem .. os end
      if os and (mask == '' or string.byte(mask, i) ~= 48) then
        if paired[i] then
          -- Pairs whose latest call is at or below the horizon go, state and all.
          local old = call('ZRANGEBYSCORE', okeys[i], '-inf', horizon)
          for s0 = 1, #old, 1000 do
            call('HDEL', c_stem .. ':p:' .. suffix[i], unpack(old, s0, math.min(s0 + 999, #old)))
          end
        end
        call('ZREMRANGEBYSCORE', okeys[i], '-inf', horizon)
      end
    end
  end
end

-- Phase 2, concurrent rules: the calls held open, all dropped when the
-- caller starts afresh, else those closed at or before L' - grace, read
-- into c_open; the ends kept, trimmed at the idempotency horizon.
local function trim_open()
  c_open = NO_OPEN
  if has_concurrent then c_open = {} end
  for _, i in ipairs(concurrent) do
    local key = c_stem .. ':o:' .. suffix[i]
    local kept = {}
    if not c_prev then
      call('DEL', key)
    else
      -- Closed more than the grace ago: matters only to a late call (see
      -- the engine's trim), dropped.
      local closed = c_lnew - grace
      for _, c in ipairs(open_calls(key)) do
        if c[2] <= closed then call('HDEL', key, c[5]) else kept[#kept + 1] = c end
      end
    end
    c_open[i] = kept
  end
  if not has_ends then return end
  local pe, hz = c_stem .. ':pe', fmt('%d', c_dedup_horizon)
  if has_sums then
    local gone = call('ZRANGEBYSCORE', pe, '-inf', hz)
    for s0 = 1, #gone, 1000 do
      call('HDEL', c_stem .. ':pt', unpack(gone, s0, math.min(s0 + 999, #gone)))
    end
  end
  call('ZREMRANGEBYSCORE', pe, '-inf', hz)
end

-- Phase 3: distinct callees: raise this callee's latest call time, count
-- those after t - Wmax.
local function track()
  c_distinct = ''
  if not track_callees then return end
  local t, callee, callees, horizon = c_t, c_callee, c_callees, c_horizon
  if due(c_b_callees, horizon, retention, c_late) then
    call('ZREMRANGEBYSCORE', callees, '-inf', horizon)
    c_b_callees = lowest(callees)
    c_n_callees = nil
  end
  local none_kept = c_b_callees == EMPTY
  if none_kept then c_n_callees = 0 end
  if callee ~= '' then
    -- A new callee only while fewer than the cap are kept (above the
    -- horizon); known ones are raised. N bounds the set's size from
    -- above (old entries included), so those are counted only near the
    -- cap.
    if not c_n_callees then c_n_callees = call('ZCARD', callees) end
    if c_n_callees < max_callees
      or call('ZCOUNT', callees, '(' .. fmt('%d', horizon), '+inf') < max_callees then
      c_n_callees = c_n_callees + call('ZADD', callees, 'GT', t, callee)
    else
      -- At the cap: only a kept callee is raised; one left over from
      -- before the horizon (trimmed lazily) is gone for the contract.
      local cur = tonumber(call('ZSCORE', callees, callee))
      if cur and cur > horizon then call('ZADD', callees, 'XX', 'GT', t, callee) end
    end
    c_b_callees = lower(c_b_callees, t)
    call('PEXPIRE', callees, retention + slack)
  end
  if none_kept then
    -- Nothing was kept before this call: it is the only callee, if any.
    c_distinct = (callee ~= '' and max_callees > 0) and '1' or '0'
  else
    c_distinct = fmt('%d', call('ZCOUNT', callees, '(' .. fmt('%d', c_t - wmax), '+inf'))
  end
end

-- Phase 4, for a rule keyed by caller and callee: its pair's count, the
-- pair's state kept in c_pst for recording.
local function count_pair(i)
  local t, w, kind, callee = c_t, wins[i], kinds[i], c_callee
  if callee == '' then return 0 end
  if t <= c_horizon then return 1 end
  local st = pair_parse(i, call('HGET', c_stem .. ':p:' .. suffix[i], callee), c_horizon)
  call('ZADD', c_okeys[i], 'GT', t, callee)
  c_pst[i] = st
  if kind == SLIDING then
    local c = 1
    for j = 1, #st do
      if st[j] > t - w and st[j] <= t then c = c + 1 end
    end
    return c
  elseif kind == FIXED then
    local b = floor(t / w)
    if (b + 1) * w + grace <= c_lnew then return 1 end
    return (st[b] or 0) + 1
  elseif kind == APPROX then
    local c
    st[2], st[3], st[4], c = approx_count(st[2], st[3], st[4], t, w, c_horizon)
    return c
  end
  c_pst[i] = {tat = tat_next(st, t, i), old = st}
  return tat_level(c_pst[i].tat, t, i)
end

-- Phase 4: each rule's count at the call, in c_counts (0 for a rule
-- that does not see it). One loop over the rules, on locals: this runs
-- for every rule of every call.
local function count_all()
  local t, lnew, horizon, mask, callee = c_t, c_lnew, c_horizon, c_mask, c_callee
  local mv, okeys, counts, fixed = c_mv, c_okeys, c_counts, c_fixed
  local every = mask == ''
  for i = 1, n do
    local w, kind, okey = wins[i], kinds[i], okeys[i]
    local c
    if kind == OUTSIDE then
      c = outside_count[i] or 0
    elseif not (every or string.byte(mask, i) == 49) then
      c = 0
    elseif summed[i] then
      c = sum_count(i)
    elseif paired[i] then
      c = count_pair(i)
    elseif kind == CONCURRENT then
      -- At or below the horizon: counts 1, and the call opens nothing;
      -- keyed by caller and callee, none without a callee.
      if bycallee[i] and callee == '' then
        c = 0
      elseif t <= horizon then
        c = 1
      else
        c = open_count(c_open[i], t, bycallee[i] and callee or nil)
      end
    elseif kind == DISTINCT then
      if callee == '' then
        c = 0
      else
        local live = call('ZCOUNT', okey, '(' .. fmt('%d', t - w), '+inf')
        local own = tonumber(call('ZSCORE', okey, callee))
        if not (own and own > t - w) then live = live + 1 end
        c = math.min(live, max_callees)
      end
    elseif kind == TOKEN then
      if t <= horizon then
        -- Past the retention: counts 1, not recorded.
        c = 1
      else
        c_tats[i] = tat_next(read_tat(i), t, i)
        c = tat_level(c_tats[i], t, i)
      end
    elseif kind == SLIDING and okey then
      c = 1 + call('ZCOUNT', okey, '(' .. fmt('%d', t - w), fmt('%d', t))
    elseif kind == SLIDING then
      if c_b_log == EMPTY then
        c = 1
      else
        c = 1 + call('ZCOUNT', c_log, '(' .. fmt('%d', t - w), fmt('%d', t))
      end
    elseif kind == FIXED then
      local b = floor(t / w)
      local fb = parse_buckets(mv[ffield[i]])
      fixed[i] = fb
      if (b + 1) * w + grace <= lnew then
        c = 1
      else
        c = (fb[b] or 0) + 1
        if not admitted then
          -- Under attempts every call in a live bucket counts: count it now.
          fb[b] = c
          c_fchanged = true
        end
      end
    elseif t <= horizon then
      -- sliding-approx past the retention: counts 1, moves nothing.
      c = 1
    else
      local k = afield[i]
      local cb, cur, pv = nil, 0, 0
      if c_prev then
        cb, cur, pv = tonumber(mv[k]), tonumber(mv[k + 1]) or 0, tonumber(mv[k + 2]) or 0
      end
      cb, cur, pv, c = approx_count(cb, cur, pv, t, w, horizon)
      c_approx[i] = {k, cb, cur, pv, floor(t / w)}
    end
    counts[i] = c
  end
end

-- Phase 5: would the call be rejected, by what, and by a shadow rule?
local function judge()
  local listed, counts = c_listed, c_counts
  if listed == LISTED_DENY then return 1, 'denylist', false end
  if listed == LISTED_BAD_REJECTED then return 1, 'bad_caller', false end
  if listed == LISTED_ALLOW then return 0, 'allowlist', false end
  if listed == LISTED_BAD_ALLOWED then return 0, 'bad_caller', false end
  -- The first enforcing rule over its limit, else the first shadow one.
  local would, reason, by_shadow = 0, 'ok', false
  for i = 1, n do
    if counts[i] > lims[i] then
      if not rshadow[i] then return 1, names[i], false end
      if would == 0 then would, reason, by_shadow = 1, names[i], true end
    end
  end
  return would, reason, by_shadow
end

-- Phase 6, for a rule keyed by caller and callee: the call in its
-- pair's state (written back by write_pairs).
local function record_pair(i)
  local st, t = c_pst[i], c_t
  if not st then return end
  local kind, b = kinds[i], floor(t / wins[i])
  if kind == SLIDING then
    local j = #st
    while j >= 1 and st[j] > t do j = j - 1 end
    table.insert(st, j + 1, t)
  elseif kind == FIXED then
    if (b + 1) * wins[i] + grace > c_lnew then st[b] = (st[b] or 0) + 1 end
  elseif kind == APPROX then
    if b == st[2] then st[3] = st[3] + 1 elseif b == st[2] - 1 then st[4] = st[4] + 1 end
  else
    st.old = st.tat
  end
end

-- Phase 6: a call that counts (every attempt, or an admitted one) goes
-- into the log and each seeing rule's state.
local function record()
  local t, id = c_t, c_id
  if has_sliding then
    call('ZADD', c_log, t, id)
    c_b_log = lower(c_b_log, t)
    call('PEXPIRE', c_log, retention + slack)
  end
  local mask = c_mask
  local every = mask == ''
  for i = 1, n do
    local kind, okey = kinds[i], c_okeys[i]
    if not (every or string.byte(mask, i) == 49) then
      -- Not seen: nothing of the rule's changes.
    elseif summed[i] then
      -- A sum rule's call adds at its end (open_call, end_call).
    elseif paired[i] then
      record_pair(i)
    elseif kind == FIXED then
      local b = floor(t / wins[i])
      if admitted and (b + 1) * wins[i] + grace > c_lnew then
        c_fixed[i][b] = c_counts[i]
        c_fchanged = true
      end
    elseif kind == SLIDING and okey then
      call('ZADD', okey, t, id)
      call('PEXPIRE', okey, retention + slack)
    elseif kind == TOKEN and c_tats[i] then
      c_mv[tfield[i]] = fmt('%d,%d', c_tats[i][1], c_tats[i][2])
      c_tats[i].changed = true
    elseif kind == DISTINCT and c_callee ~= '' then
      call('ZADD', okey, 'GT', t, c_callee)
      local extra = call('ZCARD', okey) - max_callees
      if extra > 0 then call('ZPOPMIN', okey, extra) end
      call('PEXPIRE', okey, retention + slack)
    elseif kind == APPROX and c_approx[i] then
      local a = c_approx[i]
      if a[5] == a[2] then
        a[3] = a[3] + 1
      elseif a[5] == a[2] - 1 and t > c_horizon then
        a[4] = a[4] + 1
      end
    end
  end
end

-- Phase 6, concurrent and sum rules: an allowed call (a shadow reject
-- too) held open by every concurrent rule that saw it, closed at its end
-- if that came first (taken from the ends kept); in every sum rule that
-- sees it, waiting for its end, or adding at once if its end came first.
local function open_call()
  local t, id = c_t, c_id
  if t <= c_horizon or not has_ends then return end
  local taken, ended_at, talk = false, nil, 0
  local every = c_mask == ''
  for i = 1, n do
    local holds = false
    if summed[i] then
      holds = every or string.byte(c_mask, i) == 49
    elseif kinds[i] == CONCURRENT then
      holds = c_counts[i] > 0
    end
    if holds and not taken then
      local pe = c_stem .. ':pe'
      local e = call('ZSCORE', pe, id)
      if e then
        ended_at = tonumber(e)
        call('ZREM', pe, id)
        if has_sums then
          talk = tonumber(call('HGET', c_stem .. ':pt', id)) or 0
          call('HDEL', c_stem .. ':pt', id)
        end
      end
      taken = true
    end
    if holds and summed[i] then
      local price = c_prices[i]
      local per, inc = price and price[1], price and price[2]
      if ended_at then
        if ended_at < t + smax[i] then
          sum_add(c_stem, i, math.max(ended_at, t), sum_amount(i, talk, per, inc), t, id, 'p')
        end
      else
        local key = c_stem .. ':sw:' .. ssuffix[i]
        local mv = call('HMGET', key, id, '')
        local calls, found = waiting_of(mv[1]), false
        for _, c in ipairs(calls) do
          if c[1] == t then
            c[2] = c[2] + 1
            found = true
          end
        end
        if not found then calls[#calls + 1] = {t, 1, per, inc} end
        local bound, go = tonumber(mv[2]), t + smax[i]
        if bound and bound < go then go = bound end
        call('HSET', key, id, waiting_value(calls), '', fmt('%d', go))
        call('PEXPIRE', key, sum_ttl(i))
      end
    elseif holds then
      local close, ended = t + wins[i], false
      if ended_at then
        close = math.min(math.max(ended_at, t), close)
        ended = true
      end
      local callee = bycallee[i] and c_callee or ''
      local key = c_stem .. ':o:' .. suffix[i]
      local field = fmt('%d', t) .. '|' .. id
      call('HSET', key, field, open_value(close, ended, callee))
      call('PEXPIRE', key, retention + slack)
      local list = c_open[i]
      list[#list + 1] = {t, close, ended, id, field, callee}
    end
  end
end

-- Pairs touched by this call: written back, then the cap.
local function write_pairs()
  for i = 1, n do
    local st = c_pst[i]
    if st then
      local hk, okey = c_stem .. ':p:' .. suffix[i], c_okeys[i]
      local v
      if kinds[i] == TOKEN then v = pair_format(i, st.old, c_lnew) else v = pair_format(i, st, c_lnew) end
      call('HSET', hk, c_callee, v)
      local extra = call('ZCARD', okey) - max_callees
      if extra > 0 then
        local popped = call('ZPOPMIN', okey, extra)
        for j = 1, #popped, 2 do call('HDEL', hk, popped[j]) end
      end
      call('PEXPIRE', okey, retention + slack)
      call('PEXPIRE', hk, retention + slack)
    end
  end
end

-- The rules' time-profile ranges, from the mask's tail ('|' then per rule,
-- ';' between them, "a-b,..."); nil when no rule has a profile.
local function profiles_of(mask)
  local bar = string.find(mask, '|', 1, true)
  if not bar then return nil end
  local profiles, r = {}, 0
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
  return profiles
end

-- Phase 7, for a rule keyed by caller and callee: the last time its pair
-- would reject, or nil.
local function until_pair(i)
  local t, w, lim, kind, callee = c_t, wins[i], lims[i], kinds[i], c_callee
  local pl = callee ~= '' and tonumber(call('ZSCORE', c_okeys[i], callee))
  if not pl then return nil end
  local st = pair_parse(i, call('HGET', c_stem .. ':p:' .. suffix[i], callee), c_horizon)
  local pexp = pl + retention
  local u
  if kind == SLIDING then
    u = list_until(st, t, w, lim)
  elseif kind == FIXED then
    u = fixed_until(st, t, c_lnew, w, lim)
  elseif kind == APPROX then
    if st[2] then u = approx_until(st, pexp, w, lim) end
  elseif st then
    u = tat_until(st, t, i, lim)
    if u then u = math.min(u, pexp - 1) end
  end
  if u and u <= t then return nil end
  return u
end

-- Phase 7: rule i's last time that would reject a call like this one
-- (the contract's retry-after is one past the latest of them), or nil.
local function until_of(i)
  local t, w, lim, kind, okey = c_t, wins[i], lims[i], kinds[i], c_okeys[i]
  -- Not near (mask '0'): the rule neither sees the call (mask '1') nor
  -- counts it for the retry-after only ('2').
  if rshadow[i] or (c_mask ~= '' and string.byte(c_mask, i) == 48) then
    return nil
  elseif kind == OUTSIDE then
    return outside_until[i]
  elseif paired[i] then
    return until_pair(i)
  elseif summed[i] then
    return sum_until(i)
  elseif kind == SLIDING and okey then
    return sliding_until(okey, t, w, lim)
  elseif kind == TOKEN then
    local tat = c_tats[i]
    -- Not recorded (not seen, or admitted): the bucket as it was.
    if not (tat and tat.changed) then tat = read_tat(i) end
    local u = tat and tat_until(tat, t, i, lim)
    return u and math.min(u, c_lnew + retention - 1)
  elseif kind == CONCURRENT then
    -- The open count drops only at a close: the last close minus one at
    -- which the calls open still fill the limit.
    -- Keyed by caller and callee: the calls to this callee.
    if bycallee[i] and c_callee == '' then return nil end
    local callee = bycallee[i] and c_callee or nil
    local calls, last = c_open[i], nil
    for _, x in ipairs(calls) do
      local s = x[2] - 1
      if s > t and (not callee or x[6] == callee) and (not last or s > last)
        and open_count(calls, s, callee) > lim then
        last = s
      end
    end
    return last
  elseif kind == DISTINCT then
    local u = c_callee ~= '' and distinct_until(okey, c_callee, t, w, lim)
    return u and math.min(u, c_lnew + retention - 1) or nil
  elseif kind == SLIDING then
    return sliding_until(c_log, t, w, lim)
  elseif kind == FIXED then
    -- A rule that did not see the call: its buckets as kept.
    return fixed_until(c_fixed[i] or parse_buckets(c_mv[ffield[i]]), t, c_lnew, w, lim)
  end
  local a = c_approx[i]
  if not a and c_prev then
    -- A rule that did not see the call: its counters as kept.
    local k = afield[i]
    local cb = tonumber(c_mv[k])
    if cb then a = {k, cb, tonumber(c_mv[k + 1]) or 0, tonumber(c_mv[k + 2]) or 0} end
  end
  return a and approx_until(a, c_lnew + retention, w, lim)
end

-- Phase 7: the retry-after of a rejected call (ms), and its block key.
local function retry_after(reason)
  local t = c_t
  local profiles = profiles_of(c_mask)
  local last = t
  for i = 1, n do
    local u = until_of(i)
    if u and profiles and profiles[i] and u <= t + grace + retention then
      -- The last instant up to u the rule's profile holds at (past the
      -- ranges' span, only a late call's, u stands: see the engine).
      local x = nil
      for _, ab in ipairs(profiles[i]) do
        if ab[1] <= u then x = math.min(u, ab[2] - 1) end
      end
      u = x
    end
    if u and u > last then last = u end
  end
  local ra = last + 1 - t
  if block and not outside_names[reason] then
    call('SET', prefix .. 'block:' .. string.sub(c_stem, #prefix + 1), reason, 'PX', ra)
  end
  return fmt('%d', ra)
end

-- Phase 8: the index, and one write of the meta hash: latest time,
-- bounds, the record, fixed buckets, token buckets, approx counters.
local function write_meta(encoded)
  local lnew, mv = c_lnew, c_mv
  if index_apart then
    call('ZADD', c_ids, c_t, c_id)
    c_b_ids = lower(c_b_ids, c_t)
    call('PEXPIRE', c_ids, dedup + slack)
  end
  local mset = {'L', fmt('%d', lnew)}
  if idem then mset[#mset + 1] = c_rfield; mset[#mset + 1] = encoded end
  if has_sliding then mset[#mset + 1] = 'O'; mset[#mset + 1] = bound_str(c_b_log, lnew) end
  if index_apart then mset[#mset + 1] = 'I'; mset[#mset + 1] = bound_str(c_b_ids, lnew) end
  if track_callees then
    mset[#mset + 1] = 'C'; mset[#mset + 1] = bound_str(c_b_callees, lnew)
    if c_n_callees then mset[#mset + 1] = 'N'; mset[#mset + 1] = fmt('%d', c_n_callees) end
  end
  if c_fchanged then
    for i = 1, n do
      if kinds[i] == FIXED and c_fixed[i] then
        mset[#mset + 1] = mfields[ffield[i]]
        mset[#mset + 1] = format_buckets(c_fixed[i], wins[i], lnew)
      end
    end
  end
  for i = 1, n do
    local tat, a = c_tats[i], c_approx[i]
    if tat and tat.changed then
      mset[#mset + 1] = mfields[tfield[i]]; mset[#mset + 1] = mv[tfield[i]]
    elseif kinds[i] == TOKEN and not c_prev and mv[tfield[i]] then
      -- The caller starts afresh: so does its bucket.
      mset[#mset + 1] = mfields[tfield[i]]; mset[#mset + 1] = ''
    end
    if not a and kinds[i] == APPROX and not c_prev and mv[afield[i]] then
      -- The caller starts afresh: so do counters this call left alone.
      mset[#mset + 1] = mfields[afield[i]]; mset[#mset + 1] = ''
    end
    if a then
      local k = a[1]
      mset[#mset + 1] = mfields[k]; mset[#mset + 1] = fmt('%d', a[2])
      mset[#mset + 1] = mfields[k + 1]; mset[#mset + 1] = fmt('%d', a[3])
      mset[#mset + 1] = mfields[k + 2]; mset[#mset + 1] = fmt('%d', a[4])
    end
  end
  call('HSET', c_meta, unpack(mset))
  call('PEXPIRE', c_meta, meta_ttl)
end

-- The record as the reply carries it (see the header).
local function encode(decision, reason, shadow, retry)
  local parts = {}
  for i = 1, n do parts[i] = fmt('%d', c_counts[i]) end
  local warn = ''
  if decision == 0 and c_listed == LISTED_NONE then
    for i = 1, n do
      if warns[i] and c_counts[i] > warns[i] then
        warn = names[i]
        break
      end
    end
  end
  return fmt('%d', c_t) .. '|' .. decision .. '|' .. reason .. '|' .. shadow .. '|' .. (c_late and 1 or 0)
    .. '|' .. version .. '|' .. (c_prev and fmt('%d', c_prev) or '') .. '|' .. c_distinct
    .. '|' .. table.concat(parts, ',') .. '|' .. retry .. '|' .. warn
end

-- One call, phase by phase: duplicate (0/1) and its record.
local function decide(stem, t, id, listed, callee, mask, outside)
  if listed == CALL_END then
    -- An end's last value is its talk time.
    end_call(stem, t, id, tonumber(outside) or 0)
    return 0, CALL_END
  end
  local hash = string.find(outside, '#', 1, true)
  if hash then
    read_prices(string.sub(outside, hash + 1))
    outside = string.sub(outside, 1, hash - 1)
  else
    c_prices = NO_PRICES
  end
  read_outside(outside)
  c_stem, c_t, c_id, c_listed, c_callee, c_mask = stem, t, id, listed, callee, mask
  c_counts, c_approx, c_fixed, c_fchanged, c_tats, c_pst = {}, {}, {}, false, {}, {}
  c_prev, c_late, c_b_log, c_b_ids, c_b_callees, c_n_callees = nil, false, nil, nil, nil, nil
  c_distinct = ''
  local stored = read_meta()
  if stored then return 1, stored end
  trim()
  trim_open()
  if has_sums then trim_sums() end
  track()
  count_all()
  local would, reason, by_shadow = judge()
  if (not admitted) or would == 0 then record() end
  local shadow = 0
  if (shadow_mode or by_shadow) and would == 1 then shadow = 1 end
  if would == 0 or shadow == 1 then open_call() end
  write_pairs()
  local decision = would
  if shadow == 1 then decision = 0 end
  local retry = ''
  -- A list's reject is for good: no time after which it would pass.
  if decision == 1 and listed ~= LISTED_DENY and listed ~= LISTED_BAD_REJECTED then
    retry = retry_after(reason)
  end
  local encoded = encode(decision, reason, shadow, retry)
  write_meta(encoded)
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
