-- sluice: all-or-nothing decisions, each over every (limit, key) layer of one request. One
-- EVALSHA carries one request or several (the store sends together the requests that wait at
-- the same moment): they are decided in order, each as if alone, at one reading of Redis TIME,
-- and each key is read at most once and written at most once per EVALSHA.
-- The contract (KEYS, ARGV, reply) is documented in script.rs; the math mirrors
-- crates/limiter/src/algo/*.rs in microseconds. Every value stays an integer below 2^53
-- (RemoteLimit::new refuses limits that could exceed it), so doubles are exact.
--
-- Redis runs this whole chunk on every EVALSHA, on its only thread, so it is written for what
-- things cost there (measured with crates/store-redis/examples/evalsha_cost.rs and callgrind):
-- a redis.call costs thousands of instructions (a write about three times a read), a table a
-- thousand and more with each named field, a closure or a decimal number read or written
-- (strtod, printf) hundreds. Hence one read and one write per key per EVALSHA, whatever the
-- number of requests sharing it, a single reading of the clock, two functions that branch on
-- the algorithm rather than tables of closures per algorithm, integer division inline, one
-- table per layer built at once with only the fields it uses, each layer's parameters and each
-- state in binary (one struct.unpack, one struct.pack), and expiries moved only when they fall
-- short.

local call, pcall_, tonumber, byte, pack, unpack, spread = redis.call, redis.pcall, tonumber,
  string.byte, struct.pack, struct.unpack, unpack
local KEYS, ARGV = KEYS, ARGV
local lease_ttl = tonumber(ARGV[1])
local clock -- Redis TIME in us, read when a request first needs it
local batched -- whether this EVALSHA carries several requests

-- Integer division, written inline (a call costs more than the arithmetic): floor(a / b) is
-- (a - a % b) / b and ceil(a / b) is (a + -a % b) / b, Lua's a % b being a - floor(a / b) * b.
-- Exact for the non-negative integers here: when a + b <= 2^53 the division cannot round to
-- the next integer, and every dividend and divisor below stays within 2^52 (RemoteLimit::new
-- checks the limits' products; `now` reaches 2^52 us in the year 2112).

-- A layer's state is stored as a byte 0 then its fields (below) as little-endian doubles,
-- written by one struct.pack and read by one struct.unpack: turning numbers into decimal and
-- back (printf, strtod) costs Redis several times as much. Earlier versions stored the fields
-- in decimal, separated by spaces, trailing ones possibly left out (read as 0); such a state,
-- which starts with a digit, is still read.
--   g  token bucket (GCRA): a = TAT in whole us, b = its fraction in 1/scale us, blk, exp
--   f  fixed window:        a = window index, b = count, blk, exp
--   s  sliding window:      a = window index, b = previous count, c = current count, blk, exp
-- blk is the end of the layer's block (0: none); exp the time until which the key's expiry is
-- known to keep it (0: unknown). Windows are aligned to multiples of the window since the
-- epoch.
-- Each layer also keeps its usage at `now`, from which every figure follows: u is the GCRA
-- debt (units of 1/scale us), the fixed window's count, the sliding window's current count
-- (p its previous one, el the time elapsed in its window) or the concurrency leases held.
-- Its `quota` is the headers' quota and the most one request may cost: a bucket's burst.

-- A layer's report at its usage: what is left, in requests of cost 1, and the wait until n more
-- fit: 0 if they fit now, nil if they never will. Without n, the figures after a charge: the
-- wait for one more than is left, 0 when all is left. (One function for both: a call costs.)
local function figures(L, n)
  local algo, u, q, left = L[2], L[5], L[4], 0
  local later = L[18]
  if later then
    -- A state of a later window (charged ahead for a held request), `later` us from now:
    -- nothing is left now, and `n` fits from that window's start as figured there, from its
    -- counts L[19] (previous) and L[20] (current).
    local _, wait = figures({ L[1], algo, L[3], q, L[20], 0, 0, 0, 0, L[19], L[11], 0 }, n or 1)
    if wait == nil then return 0, nil end
    return 0, later + wait
  end
  if algo == 'g' then
    local interval = L[12]
    local tol = q * interval
    local room = tol - u
    if room > 0 then left = (room - room % interval) / interval end
    if not n then
      if left >= q then return left, 0 end
      n = left + 1
    end
    local need = u + n * interval - tol
    if need <= 0 then return left, 0 end
    local scale = L[11]
    return left, (need + -need % scale) / scale
  elseif algo == 's' then
    -- The estimate is previous * (w - elapsed) + current * w against quota * w.
    local p, w, el = L[10], L[11], L[12]
    local room = q * w - (p * (w - el) + u * w)
    if room > 0 then left = (room - room % w) / w end
    if not n then
      if left >= q then return left, 0 end
      n = left + 1
    end
    if room >= n * w then return left, 0 end
    -- First fit: the earliest elapsed time at which `weight` counts leave `room`.
    room = q - u - n
    if room >= 0 then
      local at = 0
      if p > 0 then at = w - math.min((room * w - room * w % p) / p, w) end
      if at < w then return left, at - el end
    end
    if q - n < 0 then return left, nil end
    local at = 0
    if u > 0 then
      local x = (q - n) * w
      at = w - math.min((x - x % u) / u, w)
    end
    return left, w - el + at
  end
  -- A count against the quota: fixed window and concurrency.
  if u < q then left = q - u end
  if not n then
    if left >= q then return left, 0 end
    n = left + 1
  end
  if algo == 'f' then
    if u + n <= q then return left, 0 end
    return left, L[11] - L[12]
  end
  -- Concurrency: one slot per request, whatever its cost.
  if u < q then return left, 0 end
  return left, nil
end

-- A window's counts in window `index` (previous, current) from its state (a, b, c): those of
-- that window if the state is of it; for a sliding window, the state's current count as the
-- previous one if the state is of the window before; else none.
local function counts_in(algo, a, b, c, index)
  if a == index then
    if algo == 'f' then return 0, b end
    return b, c
  elseif algo == 's' and a + 1 == index then
    return c, 0
  end
  return 0, 0
end

-- A layer is one array, built at once: a table's named fields cost Redis several times as
-- much to make. Its fields, by position (the code indexes them with these literals: a local
-- per name would cost every closure made on each call an upvalue):
--   1 key, 2 algo, 3 dry-run, 4 quota, 5 u, 6 blk, 7 a, 8 b, 9 c, 10 p,
--   11 the GCRA scale or the window, 12 the GCRA interval or el,
--   13 own (its own wait when it refuses; false until then),
--   14 exp, 15 the clock of its last change, 16 whether it changed (to be written by flush).
-- A concurrency layer has only the first six.
-- When the call carries several requests, `entries` holds, per key, the last layer that read
-- it: the next request with the same key starts from that layer's state (changes included)
-- instead of reading Redis, and `flush` writes each changed key once at the end. A lone
-- request's changed layers are flushed from its own list.
local entries = {}

-- Writes a window or bucket state that lives at least until the later of its return to fresh
-- and its block's end; a state that is already fresh is deleted. Setting an expiry costs
-- Redis as much again as the write, so a key that already lives long enough keeps its expiry
-- (SET KEEPTTL): within a window its need does not move, and a bucket's expiry, when it has
-- to move, is set past the need by the bucket's refill time, at most a second, so that the
-- next writes of a busy key keep it. A key thus outlives its state by at most that second.
local function flush(L)
  local a, b, c, blk, exp, now = L[7], L[8], L[9], L[6], L[14], L[15]
  local algo, fresh = L[2], 0
  if algo == 'g' then
    fresh = a
    if b > 0 then fresh = a + 1 end
  elseif algo == 's' and c > 0 then
    fresh = (a + 2) * L[11]
  elseif b > 0 then
    fresh = (a + 1) * L[11]
  end
  -- A window's state for a later window (charged ahead) also says that the windows before
  -- it are spent: it lives until that window starts, even with nothing counted in it (its
  -- one held request withdrawn), or a spent window would read as fresh.
  if algo ~= 'g' and a * L[11] > fresh then fresh = a * L[11] end
  local until_ = fresh
  if blk > until_ then until_ = blk end
  if until_ <= now then call('DEL', L[1]); return end
  if until_ <= exp then
    if algo == 's' then call('SET', L[1], pack('<Bddddd', 0, a, b, c, blk, exp), 'KEEPTTL')
    else call('SET', L[1], pack('<Bdddd', 0, a, b, blk, exp), 'KEEPTTL') end
    return
  end
  if algo == 'g' then
    local tol, scale = L[4] * L[12], L[11]
    local slack = (tol - tol % scale) / scale -- the refill time, in whole us
    if slack > 1000000 then slack = 1000000 end
    if fresh + slack > until_ then until_ = fresh + slack end
  end
  -- The key lives ms after Redis's clock, which is at least `now` (TIME; a clock pinned by tests
  -- runs ahead of it): through now + ms * 1000.
  local us = until_ - now
  local ms = (us + -us % 1000) / 1000
  exp = now + ms * 1000
  local v
  if algo == 's' then v = pack('<Bddddd', 0, a, b, c, blk, exp)
  else v = pack('<Bdddd', 0, a, b, blk, exp) end
  call('SET', L[1], v, 'PX', ms)
end

-- Decides the request whose arguments start at ARGV[p] and whose keys follow KEYS[k]:
-- ARGV[p .. p + 5] = mode, cost, lease id, pinned clock (or empty), deadline (or empty),
-- layers n; then each
-- layer's parameters; in refund mode, then each layer's refund tag, then three figures per
-- layer: the state a window charged ahead replaced (-1 -1 -1: none). Returns its reply (the
-- figures packed as doubles), n, the position of the next request's arguments, and its layers.
-- A key Redis cannot read as its algorithm's type (an error from GET or ZCOUNT: something else
-- wrote it) fails this request alone, before it has written anything: reply [4, layer]. Reads
-- go through redis.pcall for that reason; an error from redis.call would end the whole call,
-- after earlier requests' concurrency leases were written and without their replies.
local function decide(k, p)
  local mode, cost, lease, pinned, deadline, n = ARGV[p], tonumber(ARGV[p + 1]), ARGV[p + 2],
    ARGV[p + 3], ARGV[p + 4], tonumber(ARGV[p + 5])
  local specs = p + 5 -- ARGV[specs + i]: layer i's parameters
  local tags = specs + n -- ARGV[tags + i]: in refund mode, layer i's refund tag
  local befores = tags + n -- ARGV[befores + 3 * i - 2 ..]: in refund mode, its earlier state
  local now
  if pinned ~= '' then
    now = tonumber(pinned) -- tests only: a pinned clock
  else
    if not clock then
      local t = call('TIME')
      clock = t[1] * 1000000 + t[2]
    end
    now = clock
  end
  -- Reached after its sender stopped waiting (Redis stalled): the request was answered
  -- without this decision, so it charges nothing. Reply [5, 0, now], `now` for the sender's
  -- estimate of Redis's clock.
  if deadline ~= '' and now > tonumber(deadline) then
    -- (A refund carries no deadline; its tags would follow if it did.)
    local next = (mode == 'r' or mode == 'w') and befores + 3 * n + 1 or specs + n + 1
    return pack('<ddd', 5, 0, now), n, next, {}
  end
  local write = mode == 'd'
  -- 'b': check-only at a full instance, but a refusal starts blocks as a charging decision's
  -- would (the caller was refused by its quota, room or not).
  local blocks = write or mode == 'b'
  local refund = mode == 'r' or mode == 'w' -- 'w': withdraw, a refund that spares queues

  local layers, has_dry = { false, false, false, false }, false -- room for four, as `out` below
  local cap_e, cap_d, fit_e, fit_d = nil, nil, true, true
  for i = 1, n do
    local algo, dry, quota, w, scale, interval, block = unpack('<c1c1ddddd', ARGV[specs + i])
    -- fits: whether `cost` fits now, as figures(L, cost) would say with a zero wait (written
    -- out here, per algorithm, as it is needed for every layer).
    local key, L, fits = KEYS[k + i], nil, false
    dry = dry == '1'
    has_dry = has_dry or dry
    if algo == 'c' then
      local u = 0
      if not refund then
        u = pcall_('ZCOUNT', key, string.format('(%.0f', now), '+inf')
        if type(u) == 'table' then return pack('<dd', 4, i), n, tags + 1, {} end
      end
      L = { key, algo, dry, quota, u, 0 }
      fits = u < quota -- one slot per request, whatever its cost
    else
      local prev, a, b, c, blk, exp, at, changed = entries[key], 0, 0, 0, 0, 0, 0, false
      if prev then
        a, b, c, blk, exp, at, changed = prev[7], prev[8], prev[9], prev[6], prev[14], prev[15],
          prev[16]
      elseif not refund or ARGV[tags + i] ~= '-1' then
        -- From Redis: a state of another length, or that does not parse, is another
        -- algorithm's (the limit was changed) or none: it starts fresh.
        local v = pcall_('GET', key)
        if type(v) == 'table' then
          if refund then return pack('<dd', 4, i), n, befores + 3 * n + 1, {} end
          return pack('<dd', 4, i), n, tags + 1, {}
        end
        if v and byte(v) == 0 then
          if algo == 's' then
            if #v == 41 then a, b, c, blk, exp = unpack('<xddddd', v) end
          elseif #v == 33 then
            a, b, blk, exp = unpack('<xdddd', v)
          end
        elseif v then
          -- Written by an earlier version: decimal, a lone number or up to four fields.
          local x = tonumber(v)
          if x then
            a = x
          else
            local y, z
            a, x, y, z = string.match(v, '^(%S+) ?(%S*) ?(%S*) ?(%S*)$')
            a, b, y, z = tonumber(a) or 0, tonumber(x) or 0, tonumber(y) or 0, tonumber(z) or 0
            if algo == 's' then c, blk = y, z else blk = y end
          end
        end
        prev = true
      end
      -- A block set under another block_for: none once block_for is removed; else at most
      -- block_for and the longest wait of the counters from now (a block covers the counters'
      -- wait too, so one may end past block_for). Kept cut (written: cut again at each request,
      -- it would slide on with a caller who keeps trying). Review: removing block_for left
      -- callers refused for the old hour.
      if blk > now then
        local most = 0
        if block > 0 then
          local longest = w -- fixed window: the window's end
          if algo == 's' then longest = 2 * w
          elseif algo == 'g' then longest = quota * interval / scale end
          most = now + block + longest
        end
        if blk > most then
          blk = most
          if blocks then at, changed = now, true end
        end
      end
      if algo == 'g' then
        local u = 0
        if a >= now then u = (a - now) * scale + b end
        -- A debt past a full bucket and the longest hold is no charge's: Redis's clock stepped
        -- back (a failover to a replica whose clock lags, a VM restored). It is taken as a full
        -- bucket and the longest hold, not kept as quota spent for as long as the step (review:
        -- an hour's step, an hour's refusals). Read only past a full bucket: rare.
        if u > quota * interval then
          local most = quota * interval
            + select(8, unpack('<c1c1dddddd', ARGV[specs + i])) * scale
          if u > most then u = most end
        end
        L = { key, algo, dry, quota, u, blk, a, b, 0, 0, scale, interval, false, exp, at, changed }
        fits = u + cost * interval <= quota * interval
        if not fits and not refund and not dry then
          -- A bucket with a max_delay admits what passes within it: charged now (the TAT moves
          -- by the cost, as for any charge), held by the gateway for L[17] us, so that whoever
          -- comes later queues behind it. Read only here: few requests get this far.
          local ahead = select(8, unpack('<c1c1dddddd', ARGV[specs + i]))
          local need = u + cost * interval - quota * interval
          local hold = (need + -need % scale) / scale
          if hold <= ahead then fits, L[17] = true, hold end
        end
      else
        local index = (now - now % w) / w
        local p, u = 0, 0
        if a > index then
          -- A later window than any this limit charges ahead (its max_delay reaches) is no
          -- charge's: Redis's clock stepped back, as above. Its counts are taken as the
          -- current window's, not as windows spent for as long as the step.
          local t = now + select(8, unpack('<c1c1dddddd', ARGV[specs + i]))
          if a > (t - t % w) / w then a = index end
        end
        if a == index then
          if algo == 'f' then u = b else p, u = b, c end
        elseif algo == 's' and a + 1 == index then
          p = c
        elseif a > index then
          u = quota -- a later window's state (charged ahead): this window is spent
        end
        local el = now - index * w
        L = { key, algo, dry, quota, u, blk, a, b, c, p, w, el, false, exp, at, changed }
        if a > index then
          if algo == 'f' then L[18], L[19], L[20] = a * w - now, 0, b
          else L[18], L[19], L[20] = a * w - now, b, c end
        end
        if algo == 'f' then fits = u + cost <= quota
        else fits = p * (w - el) + (u + cost) * w <= quota * w end
        if not fits and not refund and not dry then
          -- A window with a max_delay admits what passes within it, charged now in the window
          -- it passes in (below) and held by the gateway for L[17] us, as a bucket's.
          local ahead = select(8, unpack('<c1c1dddddd', ARGV[specs + i]))
          if ahead > 0 then
            local _, wait = figures(L, cost)
            if wait and wait <= ahead then fits, L[17] = true, wait end
          end
        end
      end
      if prev and batched then entries[key] = L end
    end
    layers[i] = L
    if not refund then
      -- Concurrency has no capacity (one slot per request); a blocked layer refuses.
      fits = fits and L[6] <= now
      if dry then
        if not cap_d and cost > quota and algo ~= 'c' then cap_d = i end
        fit_d = fit_d and fits
      else
        if not cap_e and cost > quota and algo ~= 'c' then cap_e = i end
        fit_e = fit_e and fits
      end
    end
  end

  if refund then
    -- Takes back `cost` from each charged layer, in the window it was charged in. A withdrawal
    -- leaves a bucket with a max_delay alone unless its TAT is still the one the charge left
    -- (its tag, in whole us): a request charged since queued behind it and keeps its moment.
    -- Only a bucket whose charge moves the TAT by 1 us or more can tell; one that moves it by
    -- less keeps the charge. A bucket that holds nobody gets it back whoever came since.
    for i = 1, n do
      local L = layers[i]
      local tag = tonumber(ARGV[tags + i])
      if tag >= 0 and mode == 'w' and L[2] == 'g' and (L[7] ~= tag or L[12] < L[11])
        and select(8, unpack('<c1c1dddddd', ARGV[specs + i])) > 0 then
        tag = -1
      end
      if tag >= 0 then
        local algo, a, b, c = L[2], L[7], L[8], L[9]
        if algo == 'c' then
          pcall_('ZREM', L[1], lease) -- a key of another type holds no lease
        else
          if algo == 'g' then
            -- What is still owed of the charge: its TAT (the tag, whole us) less now. Once the
            -- bucket has refilled past it, later charges started from now, not from it, and
            -- taking it back would take theirs. While the TAT is still in the tag's
            -- microsecond (nobody charged since), its fraction is the charge's too: without it
            -- a refund gave back up to 1 us less than memory does. (A charge of another
            -- request within the same microsecond, at over a million a second per key, is
            -- then given back with it, up to 1 us of it.)
            local scale, give = L[11], cost * L[12]
            local owed = (tag - now) * scale
            if a == tag then owed = owed + b end
            if owed < give then give = math.max(owed, 0) end
            local d = L[5] - give
            if d <= 0 then
              a, b = 0, 0 -- at or before now: a full bucket
            else
              b = d % scale
              a = now + (d - b) / scale
            end
          else
            -- A window charged ahead gets back the state it replaced if nobody was charged
            -- since (its state is still the one the charge left), as in memory; otherwise its
            -- count comes out of the window it was charged in.
            local o = befores + 3 * i
            local ba = tonumber(ARGV[o - 2])
            local back = false
            if ba >= 0 then
              local bb, bc = tonumber(ARGV[o - 1]), tonumber(ARGV[o])
              local p, u = counts_in(algo, ba, bb, bc, tag)
              u = u + cost
              if a == tag and (algo == 'f' and b == u or algo == 's' and b == p and c == u) then
                a, b, c, back = ba, bb, bc, true
              end
            end
            if back then
            elseif algo == 'f' then
              if a == tag then b = math.max(0, b - cost) end
            elseif a == tag then
              c = math.max(0, c - cost)
            elseif tag + 1 == a then
              b = math.max(0, b - cost)
            end
          end
          L[7], L[8], L[9], L[15], L[16] = a, b, c, now, true -- its new state
        end
      end
    end
    return pack('<d', 3), n, befores + 3 * n + 1, layers
  end

  -- The reply: the header, then 5 per layer, sent as little-endian doubles (one struct.pack):
  -- a bulk string costs Redis less to send than integers one by one, and the gateway far
  -- less to parse. Made with room for four layers, as a table grown one element at a time is
  -- reallocated at every power of two.
  local out = { 1, 0, -1, 0, 0, now, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0 }
  local replaced -- per layer, the state a window charged ahead replaced (held requests only)

  -- Decides the enforced layers, all or nothing; then, if they admit and this charges, the
  -- dry-run ones, likewise. Written inline rather than as a function called twice: a function
  -- would be a closure made on every call, with all the locals it uses as upvalues.
  -- A charged layer is reported at once (its group admitted: adm_e, adm_d); a refusing one notes
  -- its own wait (`own`: -1 for never) or its new block (`blk`), and the loop at the end reports
  -- the rest.
  local adm_e, adm_d = false, false
  for pass = 1, 2 do
    local dry, cap, ok = pass == 2, cap_e, fit_e
    if dry then
      if not (has_dry and write and out[1] == 1) then break end
      cap, ok = cap_d, fit_d
    end
    if cap then
      -- The cost can never fit that layer: nothing is charged, nobody refuses.
      if not dry then return pack('<dddddd', 2, cap, -1, 0, 0, now), n, tags + 1, layers end
      out[5] = cap
    elseif ok then
      -- Charges every layer (when writing) and reports the figures after the charge, with the
      -- charge's window index for a refund (-1: nothing written).
      for i = 1, n do
        local L = layers[i]
        if L[3] == dry then
          -- Check-only: nothing is charged, so the figures are the state's as it stands (what
          -- a caller answered 503 at a full instance still has).
          local left, reset
          if not write then left, reset = figures(L) end
          local algo, tag = L[2], 0
          if algo == 'c' then
            L[5] = L[5] + 1
            if write then
              local ttl = lease_ttl
              call('ZREMRANGEBYSCORE', L[1], '-inf', now)
              call('ZADD', L[1], now + ttl, lease)
              call('PEXPIRE', L[1], (ttl + -ttl % 1000) / 1000)
            end
          elseif algo == 'g' then
            local d, scale = L[5] + cost * L[12], L[11]
            L[5] = d
            if write then
              local frac = d % scale
              L[7], L[8], L[15], L[16] = now + (d - frac) / scale, frac, now, true -- new state
              tag = L[7] -- its TAT in whole us, for a withdrawal
            end
          else
            local w, hold = L[11], L[17]
            tag = (now - now % w) / w
            if hold then
              -- Charged in the window it passes in, from the state as it will be seen then.
              local t = now + hold
              local index = (t - t % w) / w
              local p, u = counts_in(algo, L[7], L[8], L[9], index)
              u = u + cost
              if write then
                replaced = replaced or {}
                replaced[i] = { L[7], L[8], L[9] }
              end
              if index > tag then
                L[5], L[10], L[18], L[19], L[20] = L[4], 0, index * w - now, p, u
              else
                L[5], L[10] = u, p
              end
              tag = index
              if write then
                if algo == 'f' then L[7], L[8], L[15], L[16] = tag, u, now, true
                else L[7], L[8], L[9], L[15], L[16] = tag, p, u, now, true end
              end
            elseif L[18] then
              tag = L[7] -- free (cost 0) under a later window's state: left as it is
            else
              L[5] = L[5] + cost
              if write then
                -- The new state: window index and counts.
                if algo == 'f' then L[7], L[8], L[15], L[16] = tag, L[5], now, true
                else L[7], L[8], L[9], L[15], L[16] = tag, L[10], L[5], now, true end
              end
            end
          end
          if write then left, reset = figures(L) else tag = -1 end
          -- The request's wait is its longest hold (its figures are as of now, as in memory).
          local hold = L[17]
          if hold and hold > out[3] then out[3] = hold end
          local o = 1 + 5 * i
          out[o + 1], out[o + 2], out[o + 3], out[o + 4], out[o + 5] = left, reset or -1, tag, -2, 0
        end
      end
      if dry then adm_d = true else adm_e = true end
    else
      -- Refused: the refusing layer with the longest wait (nil: never, the shortest) is named,
      -- with the end of its block when it refused because of an earlier block.
      local worst, wrank, wwait, wreason = 0, -1, nil, 0
      for i = 1, n do
        local L = layers[i]
        -- A layer that would have held the request (L[17], not blocked) did not refuse.
        if L[3] == dry and not (L[17] and L[6] <= now) then
          local blk, w, reason = L[6], nil, 0
          if blk > now then
            w, reason = blk - now, blk
          else
            local _
            _, w = figures(L, cost)
            -- Concurrency limits have no `block_for` (theirs is 0), a dry-run check none.
            local block = 0
            if w ~= 0 and blocks then
              block = select(7, unpack('<c1c1ddddd', ARGV[specs + i]))
            end
            if block > 0 then
              -- The block covers the counters' wait too, so its end is a real retry time.
              local until_ = now + math.max(block, w or 0)
              L[6] = until_ -- later than the old block, which has ended
              L[15], L[16] = now, true
              w = until_ - now
            end
          end
          if w ~= 0 then
            L[13] = w or -1
            local rank = w and w + 1 or 0
            if rank > wrank then worst, wrank, wwait, wreason = i, rank, w, reason end
          end
        end
      end
      if dry then
        out[5] = worst
      else
        out[1], out[2], out[3], out[4] = 0, worst, wwait or -1, wreason
      end
    end
  end

  -- Every layer not charged: what is left and when `cost` fits, or its block, and its own wait
  -- if it refuses.
  for i = 1, n do
    local L = layers[i]
    local dry = L[3]
    if not (dry and adm_d or not dry and adm_e) then
      local o, blk, own = 1 + 5 * i, L[6], L[13] or -2
      if blk > now then
        out[o + 1], out[o + 2], out[o + 3], out[o + 4], out[o + 5] = 0, blk - now, -1, own, blk
      else
        local left, w = figures(L, cost)
        -- A layer that would admit (another refused): when its remaining grows, as if admitted.
        if w == 0 then left, w = figures(L) end
        out[o + 1], out[o + 2], out[o + 3], out[o + 4], out[o + 5] = left, w or -1, -1, own, 0
      end
    end
  end
  -- A held request's reply ends with three figures per layer: the state a window charged
  -- ahead replaced, for a refund or a withdrawal to put back (-1 -1 -1: none); then two per
  -- layer: its figures as the request passes, at the end of its hold, from its state as this
  -- call leaves it: what is left then (of the window the request passes in; of a bucket, what
  -- refilled meanwhile too), and when that grows, counted from now (-1 -1, concurrency: the
  -- decision's figures stand, their times counted from the pass by the gateway). The
  -- decision's say that a window charged ahead leaves nothing now, may be of a window over
  -- by the pass, and leave out what a bucket refills during the hold.
  if out[1] == 1 and out[3] > 0 then
    local o = 6 + 5 * n
    for i = 1, n do
      local r = replaced and replaced[i]
      if r then out[o + 1], out[o + 2], out[o + 3] = r[1], r[2], r[3]
      else out[o + 1], out[o + 2], out[o + 3] = -1, -1, -1 end
      o = o + 3
    end
    local hold = out[3]
    local t = now + hold
    for i = 1, n do
      local L = layers[i]
      local algo = L[2]
      local at -- the layer as it will be read at the pass
      if algo == 'f' or algo == 's' then
        local w = L[11]
        local index = (t - t % w) / w
        local p, u = 0, L[4] -- a later window's state: this one is spent, as decide reads it
        if L[7] <= index then p, u = counts_in(algo, L[7], L[8], L[9], index) end
        at = { L[1], algo, L[3], L[4], u, 0, 0, 0, 0, p, w, t - index * w }
      elseif algo == 'g' then
        at = { L[1], algo, L[3], L[4], math.max(L[5] - hold * L[11], 0), 0, 0, 0, 0, 0, L[11], L[12] }
      end
      out[o + 1], out[o + 2] = -1, -1
      if at then
        local left, reset = figures(at)
        out[o + 1], out[o + 2] = left, reset and hold + reset or -1
      end
      o = o + 2
    end
    return pack('<' .. string.rep('d', o), spread(out, 1, o)), n, tags + 1, layers
  end
  -- The format as a literal (a constant of the chunk, made once) for up to three layers.
  local format
  if n == 3 then format = '<ddddddddddddddddddddd'
  elseif n == 1 then format = '<ddddddddddd'
  elseif n == 2 then format = '<dddddddddddddddd'
  else format = '<' .. string.rep('d', 6 + 5 * n) end
  return pack(format, spread(out, 1, 6 + 5 * n)), n, tags + 1, layers
end

-- Every request in order, one reply each; then every changed key is written once.
local reply, k, p, requests = {}, 0, 3, tonumber(ARGV[2])
batched = requests > 1
if batched then
  for q = 1, requests do
    local n
    reply[q], n, p = decide(k, p)
    k = k + n
  end
  for _, L in pairs(entries) do
    if L[16] then flush(L) end
  end
else
  -- One request: its layers are the only ones, no need to find them by key.
  local out, n, _, layers = decide(k, p)
  reply[1] = out
  for i = 1, n do
    local L = layers[i]
    if L and L[16] then flush(L) end
  end
end
return reply
