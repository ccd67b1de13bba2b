-- Renew a lease. KEYS: instance hash. ARGV: base, name, now.
-- Returns the state, or false for an unknown instance. Bumps the generation
-- when the lease was revived or now ends earlier than before (the caller's
-- clock is behind the last writer's): other replicas must see both (KEYS.md).
local meta = KEYS[1]
local now = tonumber(ARGV[3])
local cur = redis.call('HMGET', meta, 'ttl', 'exp')
if not cur[1] then
  return false
end
local exp = string.format('%.17g', now + tonumber(cur[1]))
redis.call('HSET', meta, 'exp', exp)
redis.call('ZADD', B .. 'lease', exp, ARGV[2])
if tonumber(cur[2]) <= now or tonumber(exp) < tonumber(cur[2]) then
  bump_gen()
end
local wl = watch_on()
if wl then
  watch_pub(wl, 'h', ARGV[2], ARGV[3])
end
return state(meta)
