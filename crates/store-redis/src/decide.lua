-- sluice: one all-or-nothing decision over every (limit, key) layer of a request.
-- The contract (KEYS, ARGV, reply) is documented in script.rs; the math mirrors
-- crates/limiter/src/algo/*.rs in microseconds. Every value stays an integer below 2^53
-- (RemoteLimit::new refuses limits that could exceed it), so doubles are exact.

local mode, cost, lease = ARGV[1], tonumber(ARGV[2]), ARGV[3]
local lease_ttl = tonumber(ARGV[4])
local now
if ARGV[5] ~= '' then
  now = tonumber(ARGV[5]) -- tests only: a pinned clock
else
  local t = redis.call('TIME')
  now = tonumber(t[1]) * 1000000 + tonumber(t[2])
end
local BASE, FIELDS = 5, 9

-- floor(a / b) for integers below 2^53, corrected for the rounding of the division.
local function idiv(a, b)
  local q = math.floor(a / b)
  if q * b > a then q = q - 1 elseif (q + 1) * b <= a then q = q + 1 end
  return q
end
local function cdiv(a, b) local q = idiv(a, b); if q * b < a then q = q + 1 end; return q end
local function fmt(n) return string.format('%.0f', n) end -- tostring would print 1.7e+15

local A = {}

-- GCRA. The TAT is (w, f): w whole microseconds plus f < scale units of 1/scale us.
A.g = {}
function A.g.debt(L, s)
  if s[1] < now then return 0 end
  return (s[1] - now) * L.scale + s[2]
end
function A.g.eval(L, s)
  local d = A.g.debt(L, s) + cost * L.interval
  if d > L.tol then return nil end
  local whole = idiv(d, L.scale)
  return { now + whole, d - whole * L.scale, s[3] }, 0
end
function A.g.wait(L, s, c)
  local need = A.g.debt(L, s) + c * L.interval - L.tol
  if need <= 0 then return 0 end
  return cdiv(need, L.scale)
end
function A.g.remaining(L, s)
  local room = L.tol - A.g.debt(L, s)
  if room <= 0 then return 0 end
  return idiv(room, L.interval)
end
function A.g.expiry(L, s) if s[2] > 0 then return s[1] + 1 end return s[1] end
function A.g.undo(L, s, c)
  local d = A.g.debt(L, s) - c * L.interval
  if d <= 0 then return { 0, 0, s[3] } end -- at or before now: a full bucket
  local whole = idiv(d, L.scale)
  return { now + whole, d - whole * L.scale, s[3] }
end

-- Fixed window: (index, count), windows aligned to multiples of the window since the epoch.
A.f = {}
function A.f.count(L, s) if s[1] == idiv(now, L.window) then return s[2] end return 0 end
function A.f.eval(L, s)
  local c = A.f.count(L, s) + cost
  if c > L.quota then return nil end
  local index = idiv(now, L.window)
  return { index, c, s[3] }, index
end
function A.f.wait(L, s, c)
  if A.f.count(L, s) + c <= L.quota then return 0 end
  return L.window - (now - idiv(now, L.window) * L.window)
end
function A.f.remaining(L, s) return math.max(0, L.quota - A.f.count(L, s)) end
function A.f.expiry(L, s) if s[2] == 0 then return 0 end return (s[1] + 1) * L.window end
function A.f.undo(L, s, c, tag)
  if s[1] == tag then return { s[1], math.max(0, s[2] - c), s[3] } end
  return s
end

-- Sliding window: (index, previous, current); estimate previous * (w - elapsed) + current * w.
A.s = {}
function A.s.counts(L, s)
  local index = idiv(now, L.window)
  if s[1] == index then return s[2], s[3] end
  if s[1] + 1 == index then return s[3], 0 end
  return 0, 0
end
function A.s.used(L, p, c)
  local w = L.window
  return p * (w - (now - idiv(now, w) * w)) + c * w
end
function A.s.eval(L, s)
  local p, c = A.s.counts(L, s)
  if A.s.used(L, p, c) + cost * L.window > L.quota * L.window then return nil end
  local index = idiv(now, L.window)
  return { index, p, c + cost, s[4] }, index
end
function A.s.first_fit(L, weight, room)
  if weight == 0 then return 0 end
  return L.window - math.min(idiv(room * L.window, weight), L.window)
end
function A.s.wait(L, s, n)
  local p, c = A.s.counts(L, s)
  local q, w = L.quota, L.window
  if A.s.used(L, p, c) + n * w <= q * w then return 0 end
  local elapsed = now - idiv(now, w) * w
  if q - c - n >= 0 then
    local at = A.s.first_fit(L, p, q - c - n)
    if at < w then return at - elapsed end
  end
  if q - n < 0 then return nil end
  return w - elapsed + math.min(A.s.first_fit(L, c, q - n), w)
end
function A.s.remaining(L, s)
  local p, c = A.s.counts(L, s)
  local room = L.quota * L.window - A.s.used(L, p, c)
  if room <= 0 then return 0 end
  return idiv(room, L.window)
end
function A.s.expiry(L, s)
  local left = 0
  if s[3] > 0 then left = 2 elseif s[2] > 0 then left = 1 end
  if left == 0 then return 0 end
  return (s[1] + left) * L.window
end
function A.s.undo(L, s, c, tag)
  if s[1] == tag then return { s[1], s[2], math.max(0, s[3] - c), s[4] } end
  if tag + 1 == s[1] then return { s[1], math.max(0, s[2] - c), s[3], s[4] } end
  return s
end

-- Concurrency: a ZSET of lease ids scored by expiry; the state is the count of live leases.
A.c = {}
function A.c.eval(L, s) if s[1] < L.quota then return { s[1] + 1 }, 0 end return nil end
function A.c.wait(L, s) if s[1] < L.quota then return 0 end return nil end
function A.c.remaining(L, s) return math.max(0, L.quota - s[1]) end

local layers = {}
for i = 1, #KEYS do
  local o = BASE + (i - 1) * FIELDS
  local L = {
    key = KEYS[i], algo = ARGV[o + 1], quota = tonumber(ARGV[o + 2]),
    window = tonumber(ARGV[o + 3]), scale = tonumber(ARGV[o + 4]),
    interval = tonumber(ARGV[o + 5]), burst = tonumber(ARGV[o + 6]),
    block = tonumber(ARGV[o + 7]), dry = ARGV[o + 8] == '1', tag = tonumber(ARGV[o + 9]),
  }
  L.tol = L.burst * L.interval
  L.f = A[L.algo]
  if L.algo == 'c' then
    L.st = { redis.call('ZCOUNT', L.key, '(' .. fmt(now), '+inf') }
  else
    local size = (L.algo == 's') and 4 or 3
    local s, v = {}, redis.call('GET', L.key)
    if v then for x in string.gmatch(v, '%S+') do s[#s + 1] = tonumber(x) end end
    for j = #s + 1, size do s[j] = 0 end
    L.st = s
    if s[size] > now then L.blocked = s[size] end
  end
  layers[i] = L
end

-- Writes a window or bucket state with an expiry at the later of its return to fresh and its
-- block's end; a state that is already fresh is deleted.
local function save(L)
  local s = L.st
  local until_ = math.max(L.f.expiry(L, s), s[#s])
  if until_ <= now then redis.call('DEL', L.key); return end
  local parts = {}
  for j = 1, #s do parts[j] = fmt(s[j]) end
  redis.call('SET', L.key, table.concat(parts, ' '), 'PX', cdiv(until_ - now, 1000))
end

if mode == 'r' then
  for _, L in ipairs(layers) do
    if L.tag >= 0 then
      if L.algo == 'c' then redis.call('ZREM', L.key, lease)
      else L.st = L.f.undo(L, L.st, cost, L.tag); save(L) end
    end
  end
  return { 3 }
end

local function charge(L)
  if L.algo == 'c' then
    redis.call('ZREMRANGEBYSCORE', L.key, '-inf', fmt(now))
    redis.call('ZADD', L.key, fmt(now + lease_ttl), lease)
    redis.call('PEXPIRE', L.key, cdiv(lease_ttl, 1000))
  else
    L.st = L.next; save(L)
  end
end

-- Decides one group of layers, all or nothing. Returns 0 when admitted; 'cap' and the layer
-- when the cost can never fit; else the refusing layer with the longest wait, its wait (or
-- nil) and the end of its block when it refused because of an earlier block.
local function decide(group, write)
  for _, L in ipairs(group) do
    local cap = (L.algo == 'g' and L.burst) or (L.algo ~= 'c' and L.quota) or nil
    if cap and cost > cap then return 'cap', L end
  end
  local ok = true
  for _, L in ipairs(group) do
    if L.blocked then ok = false; break end
    L.next, L.charge_tag = L.f.eval(L, L.st)
    if not L.next then ok = false; break end
  end
  if ok then
    for _, L in ipairs(group) do
      L.admitted = true
      if write then charge(L); L.charged = true end
    end
    return 0
  end
  local worst, wrank, wwait, wreason = nil, -1, nil, 0
  for _, L in ipairs(group) do
    local wait, reason, refuses = nil, 0, true
    if L.blocked then
      wait, reason = L.blocked - now, L.blocked
    elseif L.f.eval(L, L.st) then
      refuses = false
    else
      wait = L.f.wait(L, L.st, cost)
      if L.block > 0 and write then
        -- The block covers the counters' wait too, so its end is a real retry time.
        local until_ = now + math.max(L.block, wait or 0)
        L.st[#L.st] = math.max(L.st[#L.st], until_)
        save(L)
        L.new_block = until_
        wait = until_ - now
      end
    end
    if refuses then
      L.own_wait = wait or -1
      local rank = wait and wait + 1 or 0
      if rank > wrank then worst, wrank, wwait, wreason = L, rank, wait, reason end
    end
  end
  return worst, wwait, wreason
end

local enforced, dry = {}, {}
for i, L in ipairs(layers) do
  L.index = i
  if L.dry then dry[#dry + 1] = L else enforced[#enforced + 1] = L end
end

local write = mode == 'd'
local out = { 1, 0, -1, 0, 0, now }
local r, wait, reason = decide(enforced, write)
if r == 'cap' then
  return { 2, wait.index, -1, 0, 0, now }
elseif r ~= 0 then
  out[1], out[2], out[3], out[4] = 0, r.index, wait or -1, reason
elseif write and #dry > 0 then
  local d, dl = decide(dry, true)
  if d == 'cap' then out[5] = dl.index elseif d ~= 0 then out[5] = d.index end
end

for _, L in ipairs(layers) do
  local remaining, reset, blocked = 0, -1, L.new_block or L.blocked or 0
  if L.admitted then
    remaining = L.f.remaining(L, L.next)
    if remaining >= ((L.algo == 'g') and L.burst or L.quota) then reset = 0
    else reset = L.f.wait(L, L.next, remaining + 1) or -1 end
  elseif blocked > 0 then
    reset = blocked - now
  else
    remaining, reset = L.f.remaining(L, L.st), L.f.wait(L, L.st, cost) or -1
  end
  local tag = L.charged and L.charge_tag or -1
  for _, v in ipairs({ remaining, reset, tag, L.own_wait or -2, blocked }) do
    out[#out + 1] = v
  end
end
return out
