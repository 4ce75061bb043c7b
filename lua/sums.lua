-- Exact integer arithmetic of sum rules, shared by lua/window.lua and
-- lua/pool.lua (each is loaded with this file in front of it; see
-- src/engine/window/sums.rs and src/engine/rates.rs for the reference).

-- A quotient and remainder, corrected for the division's rounding
-- (operands below 2^53).
local function divmod(a, b)
  local q = math.floor(a / b)
  local r = a - q * b
  if r < 0 then
    q, r = q - 1, r + b
  elseif r >= b then
    q, r = q + 1, r - b
  end
  return q, r
end

-- floor(p * x / w) exactly, for 0 <= x < w < 2^32 and p < 2^53: p split
-- at w and x at 2^16, so no product reaches 2^49.
local function mul_div(p, x, w)
  local a, b = divmod(p, w)
  local xh, xl = divmod(x, 65536)
  local q1, r1 = divmod(b * xh, w)
  local q2 = divmod(r1 * 65536 + b * xl, w)
  return a * x + q1 * 65536 + q2
end

-- What a call ending with `talk` ms adds: whole seconds of talk, or (a
-- cost sum) its cost at `per` micro-units a minute billed in `inc`-second
-- steps (`per` nil: unpriced, nothing). Sum::amount.
local function sum_amount_of(costed, per, inc, talk)
  if talk <= 0 then return 0 end
  if not costed then return (divmod(talk + 999, 1000)) end
  if not per then return 0 end
  local step = inc * 1000
  local billed = divmod(talk + step - 1, step) * inc
  return (divmod(billed * per + 59, 60))
end

-- The last offset r in a bucket (sums prev before, cur in it) at which
-- the sliding-approx estimate is over lim, or nil; it falls as r grows.
local function sum_last_over(prev, cur, w, lim)
  if cur > lim then return w - 1 end
  if mul_div(prev, w - 1, w) + cur <= lim then return nil end
  local lo, hi = 0, w - 1
  while lo < hi do
    local mid = lo + math.floor((hi - lo + 1) / 2)
    if mul_div(prev, w - mid - 1, w) + cur > lim then lo = mid else hi = mid - 1 end
  end
  return lo
end

