-- One instance as a watching replica copies it (KEYS.md, "Watching").
-- KEYS: none (cluster: a control key). ARGV: base, name, now. Returns {'wn'} when
-- the instance is not registered, else {'wn', state (lib.lua FIELDS), {engine hash, ns id .. key, tier mask, ...},
-- copies ('cp:' as HGETALL), {ns id, model \0 lora, ...}, its route-time
-- predictions unexpired, soonest to expire first {ns id .. key, expiry,
-- pending deadline ('': none, an older writer's), ...}},
-- read at once: the stream's entries up to 'wn' are in it, none after.
local n = redis.call('GET', B .. 'wn') or ''
local meta = B .. 'i:' .. ARGV[2]
local st = state(meta)
if not st[1] then
  return {n}
end
local id = st[1]
local out, seen, names = {}, {}, {}
local sub = string.sub
-- The name of the namespace of block suffix suf, once.
local function name_ns(suf)
  local ns = sub(suf, 1, 8)
  if not seen[ns] then
    seen[ns] = true
    names[#names + 1] = ns
    names[#names + 1] = redis.call('HGET', B .. 'ns', ns) or ''
  end
end
local e = redis.call('HGETALL', B .. 'e:' .. id)
for i = 1, #e, 2 do
  local suf = e[i + 1]
  local m
  if CLUSTER then
    -- The authoritative mask is the control node's ('k:<id>': mask digit .. location).
    m = redis.call('HGET', B .. 'k:' .. id, suf)
    m = m and sub(m, 1, 1)
  else
    m = redis.call('HGET', B .. 'b:' .. suf, id)
  end
  if m then
    out[#out + 1] = e[i]
    out[#out + 1] = suf
    out[#out + 1] = m
    name_ns(suf)
  end
end
local scored = redis.call('ZRANGEBYSCORE', B .. 'po:' .. id, '(' .. ARGV[3], '+inf', 'WITHSCORES')
local pred, untils = {}, {}
if #scored > 0 then
  local q = redis.call('ZRANGE', B .. 'pq:' .. id, 0, -1, 'WITHSCORES')
  for i = 1, #q, 2 do
    untils[q[i]] = q[i + 1]
  end
end
for i = 1, #scored, 2 do
  name_ns(scored[i])
  pred[#pred + 1] = scored[i]
  pred[#pred + 1] = scored[i + 1]
  pred[#pred + 1] = untils[scored[i]] or ''
end
return {n, st, out, redis.call('HGETALL', B .. 'cp:' .. id), names, pred}
