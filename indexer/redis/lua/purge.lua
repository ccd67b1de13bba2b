-- Drop up to ~ARGV[3] entries (and predictions) of a retired int id ARGV[2];
-- return how many remain.
-- Runs in chunks so that a huge instance never holds Redis for long.
local id = ARGV[2]
local limit = tonumber(ARGV[3])
local ek = B .. 'e:' .. id
local done, cur = 0, '0'
repeat
  local r = redis.call('HSCAN', ek, cur, 'COUNT', limit)
  cur = r[1]
  local kv = r[2]
  for j = 1, #kv, 2 do
    drop_entry(kv[j + 1], id)
    redis.call('HDEL', ek, kv[j])
    done = done + 1
  end
until done >= limit or cur == '0'
ns_flush()
-- Then its route-time predictions, oldest first (KEYS.md, "Predictions").
local po = B .. 'po:' .. id
if redis.call('EXISTS', po) == 1 then
  for _, e in ipairs(redis.call('ZRANGE', po, 0, limit - 1)) do
    redis.call('HDEL', B .. 'pr:' .. e, id)
    redis.call('ZREM', po, e)
    redis.call('ZREM', B .. 'pq:' .. id, e)
  end
end
local left = redis.call('HLEN', ek) + redis.call('EXISTS', po)
if left == 0 then
  redis.call('SREM', B .. 'dead', id)
  redis.call('UNLINK', B .. 'cp:' .. id)
end
return left
