-- Create, renew or reset an instance.
-- KEYS: instance hash. ARGV: base, name, worker id, dp rank, model, address,
-- lease ttl, incarnation, now. Returns {reset 0|1, retired id or '', state}.
-- Bumps the generation on every change other replicas must see (KEYS.md):
-- a new instance, a reset, a new address, a revived lease, a new lease ttl
-- and a lease that ends earlier than the stored one. A plain renewal (same
-- ttl, later expiry) does not.
local meta = KEYS[1]
local now = tonumber(ARGV[9])
local exp = string.format('%.17g', now + tonumber(ARGV[7]))
local old = redis.call('HMGET', meta, 'id', 'm', 'inc', 'exp', 'a', 'ttl')
local reset, dead, gen = 0, '', false
if not old[1] then
  redis.call('HSET', meta, 'id', new_id(), 'w', ARGV[3], 'r', ARGV[4], 'n', 0, 'st', 0)
  reset, gen = 1, true
elseif old[2] ~= ARGV[5] or old[3] ~= ARGV[8] then
  dead = retire(old[1])
  redis.call('HSET', meta, 'id', new_id(), 'n', 0, 'st', 0)
  redis.call('HDEL', meta, 'seq')
  reset, gen = 1, true
elseif old[5] ~= ARGV[6] or old[6] ~= ARGV[7] or tonumber(old[4]) <= now
    or tonumber(exp) < tonumber(old[4]) then
  gen = true
end
redis.call('HSET', meta, 'm', ARGV[5], 'a', ARGV[6], 'ttl', ARGV[7], 'inc', ARGV[8], 'exp', exp)
redis.call('ZADD', B .. 'lease', exp, ARGV[2])
if gen then
  bump_gen()
end
return {reset, dead, state(meta)}
