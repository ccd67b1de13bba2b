-- Cluster mode: purge a retired int id in chunks (the control-slot half).
-- ARGV: base, id, limit, then the block fields (ns id .. key) of the previous
-- chunk, whose data-node entries the caller has deleted since.
-- Deletes those from 'k:<id>', then returns {left, field, value, ...}: up to
-- ~limit entries still to delete on the data nodes (value: mask .. location).
-- When none is left, drops the engine-hash map and the id leaves 'dead'.
local id = ARGV[2]
local limit = tonumber(ARGV[3])
local kk = B .. 'k:' .. id
for i = 4, #ARGV do
  if redis.call('HDEL', kk, ARGV[i]) == 1 then
    ns_add(string.sub(ARGV[i], 1, 8), 0, -1)
  end
end
ns_flush()
local left = redis.call('HLEN', kk)
if left == 0 then
  redis.call('UNLINK', B .. 'e:' .. id)
  redis.call('SREM', B .. 'dead', id)
  return {0}
end
local out, cur = {left}, '0'
repeat
  local r = redis.call('HSCAN', kk, cur, 'COUNT', limit)
  cur = r[1]
  for _, x in ipairs(r[2]) do
    out[#out + 1] = x
  end
until #out > 2 * limit or cur == '0'
return out
