-- PredictPlacement (KEYS.md, "Predictions"): record that the instance is
-- about to hold the blocks.
-- KEYS: instance hash. Cluster: every name it touches is in the control slot
-- (the instance hash, 'k:<id>' for what it holds, 'pr:', 'po:').
-- ARGV: base, now, model, ns id, expiry (%.17g), ttl in ms, cap on the
--   instance's predicted blocks, keys packed as 8-byte big-endian words,
--   LoRA name, instance name (both for the change stream), pending deadline
--   (%.17g; '' or absent: the expiry, pending while predicted).
-- Returns {'nf'} (not registered or lease expired) | {'model', its model} |
--   {'ok', recorded, dropped past the cap}.
local now = tonumber(ARGV[2])
local h = redis.call('HMGET', KEYS[1], 'id', 'exp', 'm')
if not h[1] or tonumber(h[2]) <= now then
  return {'nf'}
end
if h[3] ~= ARGV[3] then
  return {'model', h[3]}
end
local id, nid, expiry, ttl, cap = h[1], ARGV[4], ARGV[5], tonumber(ARGV[6]), tonumber(ARGV[7])
local blob = ARGV[8]
local bpre, ppre = B .. 'b:' .. nid, B .. 'pr:' .. nid
local order = B .. 'po:' .. id
-- The same members scored by when they stop counting as pending prefill
-- (pmatch.lua's pending count; never after the expiry).
local pend = B .. 'pq:' .. id
local until_ = ARGV[11]
if not until_ or until_ == '' then
  until_ = expiry
end
local sub = string.sub
-- Whether the id holds block k: its block hash standalone, its authoritative
-- entries ('k:<id>') in cluster mode.
local kk = B .. 'k:' .. id
local function held(k)
  if CLUSTER then
    return redis.call('HGET', kk, nid .. k)
  end
  return redis.call('HGET', bpre .. k, id)
end
-- A name lives as long as its longest prediction: nothing outlives its ttl.
local function keep(name)
  if redis.call('PTTL', name) < ttl then
    redis.call('PEXPIRE', name, ttl)
  end
end
-- The TTL commands run before any write: a user without their ACL rights
-- (an older rule) fails the script whole, never with a prediction half
-- written and no TTL on it.
keep(order)
keep(pend)
local recorded = 0
local told = {}
for i = 1, #blob / 8 do
  local k = sub(blob, 8 * i - 7, 8 * i)
  if not held(k) then
    told[#told + 1] = k
    local name = ppre .. k
    redis.call('HSET', name, id, expiry)
    keep(name)
    -- Scored by its expiry: a key predicted again moves to the newest, and
    -- ZCOUNT from now on counts the unexpired (pending_predicted).
    redis.call('ZADD', order, expiry, nid .. k)
    redis.call('ZADD', pend, until_, nid .. k)
    recorded = recorded + 1
  end
end
local dropped = 0
if recorded > 0 then
  keep(order)
  keep(pend)
  -- Past the cap the soonest to expire go first: every member but the
  -- newest cap (the oldest, when every prediction has the same ttl).
  local over = redis.call('ZRANGE', order, 0, -(cap + 1))
  for _, e in ipairs(over) do
    redis.call('HDEL', B .. 'pr:' .. e, id)
    redis.call('ZREM', order, e)
    redis.call('ZREM', pend, e)
    dropped = dropped + 1
  end
  -- A replica that serves followers predictions ('wp', wstart.lua) copies
  -- them from the stream, as it copies every change ('p': the keys
  -- recorded, in order; the copy drops past the cap as this did).
  local wl = watch_on()
  if wl and redis.call('EXISTS', B .. 'wp') == 1 then
    watch_pub(wl, 'p', ARGV[10], ARGV[2], 'l', ARGV[9], 's', nid, 'e', expiry, 'c', ARGV[7],
      'q', until_, 'x', table.concat(told))
  end
end
return {'ok', recorded, dropped}
