-- Instance table: {gen, {retired ids...}, {fields of instance 1}, ...}.
-- ARGV: base.
local out = {redis.call('GET', B .. 'gen') or '', redis.call('SMEMBERS', B .. 'dead')}
for _, name in ipairs(redis.call('ZRANGE', B .. 'lease', 0, -1)) do
  out[#out + 1] = state(B .. 'i:' .. name)
end
return out
