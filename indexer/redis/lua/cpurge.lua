-- Cluster mode: purge a retired int id in chunks (the control-slot half).
-- ARGV: base, id, limit, then the phase of the previous chunk ('k' or 'p')
-- and its fields (ns id .. key), whose data-node entries the caller has
-- deleted since.
-- Deletes those from 'k:<id>' (phase 'k') or from the pending record 'p:<id>'
-- (phase 'p'), then returns the next chunk: {'k', tags version, left, field,
-- value, ...} with up to ~limit entries of 'k:' still to delete on the data
-- nodes (value: mask .. location); once 'k:' is empty, {'p', tags version,
-- field, locations, ...}: blocks of the pending record, whose entries may be
-- where 'k:' no longer says (locations packed as in capply.lua). When neither
-- is left, drops the engine-hash map and the record, the id leaves 'dead' and
-- 'pend', and it returns {''}. Before that, the id's predictions go from
-- 'pr:' and 'po:<id>' (chunks of limit; {'p', tags version} while some are left).
local id = ARGV[2]
local limit = tonumber(ARGV[3])
local kk, pk = B .. 'k:' .. id, B .. 'p:' .. id
if ARGV[4] == 'k' then
  for i = 5, #ARGV do
    if redis.call('HDEL', kk, ARGV[i]) == 1 then
      pair_drop(ARGV[i])
    end
  end
  ns_flush()
elseif ARGV[4] == 'p' then
  for i = 5, #ARGV do
    redis.call('HDEL', pk, ARGV[i])
  end
end
local version = redis.call('HGET', B .. 'tags', '#') or ''
local left = redis.call('HLEN', kk)
if left > 0 then
  local out, cur = {'k', version, left}, '0'
  repeat
    local r = redis.call('HSCAN', kk, cur, 'COUNT', limit)
    cur = r[1]
    for _, x in ipairs(r[2]) do
      out[#out + 1] = x
    end
  until #out > 2 * limit or cur == '0'
  return out
end
local out, cur = {'p', version}, '0'
repeat
  local r = redis.call('HSCAN', pk, cur, 'COUNT', limit)
  cur = r[1]
  local kv = r[2]
  for j = 1, #kv, 2 do
    if kv[j] ~= '#' and kv[j] ~= '@' then
      out[#out + 1] = kv[j]
      out[#out + 1] = kv[j + 1]
    end
  end
until #out > 2 * limit or cur == '0'
if #out > 2 then
  return out
end
-- Then its route-time predictions (KEYS.md, "Predictions"), up to limit a
-- call: an empty 'p' chunk asks for the next call.
local po = B .. 'po:' .. id
if redis.call('EXISTS', po) == 1 then
  for _, e in ipairs(redis.call('ZRANGE', po, 0, limit - 1)) do
    redis.call('HDEL', B .. 'pr:' .. e, id)
    redis.call('ZREM', po, e)
    redis.call('ZREM', B .. 'pq:' .. id, e)
  end
  if redis.call('EXISTS', po) == 1 then
    return out
  end
end
redis.call('UNLINK', B .. 'e:' .. id, pk, B .. 'cp:' .. id)
redis.call('SREM', B .. 'dead', id)
redis.call('SREM', B .. 'pend', id)
return {''}
