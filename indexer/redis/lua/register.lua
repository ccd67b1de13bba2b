-- Create, renew or reset an instance.
-- KEYS: instance hash. ARGV: base, name, worker id, dp rank, model, address,
-- lease ttl, incarnation, now, identity ('' = none), its caps on instances and
-- on namespaces (0 = none), the model's ns id.
-- Returns {reset 0|1, retired id or '', state}, or {'quota', 'i' | 'n', held}
-- when a quota refuses it (KEYS.md, "Quotas"; nothing changed then).
-- Bumps the generation on every change other replicas must see (KEYS.md):
-- a new instance, a reset, a new address, a revived lease, a new lease ttl
-- and a lease that ends earlier than the stored one. A plain renewal (same
-- ttl, later expiry) does not.
local meta = KEYS[1]
local now = tonumber(ARGV[9])
local exp = string.format('%.17g', now + tonumber(ARGV[7]))
local old = redis.call('HMGET', meta, 'id', 'm', 'inc', 'exp', 'a', 'ttl', 'o', 'qn', 'q')
local ci, cn, qn = tonumber(ARGV[11]), tonumber(ARGV[12]), ARGV[13]
local reset, dead, gen = 0, '', false
if not old[1] then
  local o = ARGV[10]
  if o ~= '' then
    -- A new instance counts under the identity registering it, until it goes.
    local qk = q_key(o)
    local i, nn = q_counts(qk)
    if ci > 0 and i >= ci then
      return {'quota', 'i', i}
    end
    if cn > 0 and nn >= cn and not redis.call('HGET', qk, 's' .. qn) then
      return {'quota', 'n', nn}
    end
    redis.call('HINCRBY', qk, 'i', 1)
    q_hold(qk, qn)
    redis.call('HSET', meta, 'o', o, 'qn', qn, 'q', 0)
  end
  redis.call('HSET', meta, 'id', new_id(), 'w', ARGV[3], 'r', ARGV[4], 'n', 0, 'st', 0)
  reset, gen = 1, true
elseif old[2] ~= ARGV[5] or old[3] ~= ARGV[8] then
  if old[7] then
    local qk = q_key(old[7])
    if old[2] ~= ARGV[5] and cn > 0 and not redis.call('HGET', qk, 's' .. qn) then
      -- Room for the new model once the namespaces only this instance holds go?
      local _, nn = q_counts(qk)
      local mine = redis.call('SMEMBERS', B .. 'l:' .. old[1])
      mine[#mine + 1] = old[8]
      for _, ns in ipairs(mine) do
        if redis.call('HGET', qk, 's' .. ns) == '1' then
          nn = nn - 1
        end
      end
      if nn >= cn then
        return {'quota', 'n', nn}
      end
    end
    -- The reset drops the instance's blocks and LoRA namespaces from its owner's count.
    q_release(qk, old[1])
    if old[2] ~= ARGV[5] then
      q_drop(qk, old[8])
      q_hold(qk, qn)
      redis.call('HSET', meta, 'qn', qn)
    end
    q_blocks(qk, 0 - tonumber(old[9] or '0'))
    redis.call('HSET', meta, 'q', 0)
  end
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
local wl = watch_on()
if wl then
  watch_pub(wl, 'g', ARGV[2], ARGV[9], 'w', ARGV[3], 'r', ARGV[4], 'm', ARGV[5], 'a', ARGV[6],
    'l', ARGV[7], 'c', ARGV[8])
end
return {reset, dead, state(meta)}
