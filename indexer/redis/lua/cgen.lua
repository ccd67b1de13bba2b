-- Cluster mode: raise this node's copy of the instance-table generation.
-- KEYS: the copy. ARGV: base, generation. Never lowers it (racing writers).
local cur = tonumber(redis.call('GET', KEYS[1]) or '0')
if cur < tonumber(ARGV[2]) then
  redis.call('SET', KEYS[1], ARGV[2])
end
return 0
