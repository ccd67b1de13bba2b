-- Cluster mode: write block entries on one data node (all names local to it).
-- KEYS: this node's counter hash. ARGV: base, then quadruples
--   (block name, id, mask, counter field); mask '0' deletes the entry.
-- Counter fields count this node's block hashes with at least one holder:
-- 'd' .. ns id for deep blocks, 's' .. ns id for this node's shallow copies.
local ck = KEYS[1]
for i = 2, #ARGV, 4 do
  local bk, id, m, cf = ARGV[i], ARGV[i + 1], ARGV[i + 2], ARGV[i + 3]
  if m == '0' then
    if redis.call('HDEL', bk, id) == 1 and redis.call('EXISTS', bk) == 0 then
      if redis.call('HINCRBY', ck, cf, -1) <= 0 then
        redis.call('HDEL', ck, cf)
      end
    end
  elseif redis.call('HSET', bk, id, m) == 1 and redis.call('HLEN', bk) == 1 then
    redis.call('HINCRBY', ck, cf, 1)
  end
end
return 0
