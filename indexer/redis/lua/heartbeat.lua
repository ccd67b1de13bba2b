-- Renew a lease. KEYS: instance hash. ARGV: base, name, now.
-- Returns the state, or false for an unknown instance.
local meta = KEYS[1]
local now = tonumber(ARGV[3])
local cur = redis.call('HMGET', meta, 'ttl', 'exp')
if not cur[1] then
  return false
end
local exp = string.format('%.17g', now + tonumber(cur[1]))
redis.call('HSET', meta, 'exp', exp)
redis.call('ZADD', B .. 'lease', exp, ARGV[2])
if tonumber(cur[2]) <= now then
  bump_gen()
end
return state(meta)
