-- Remove an instance (mode 'remove') or reap it if its lease expired (mode 'reap').
-- KEYS: instance hash. ARGV: base, name, now, mode.
-- Returns {retired id or '', state}, or false (unknown / not expired).
local meta = KEYS[1]
local st = state(meta)
if not st[1] then
  redis.call('ZREM', B .. 'lease', ARGV[2])
  return false
end
if ARGV[4] == 'reap' and tonumber(st[8]) > tonumber(ARGV[3]) then
  return false
end
-- Whatever it counted leaves its owner's quota (KEYS.md, "Quotas").
local q = redis.call('HMGET', meta, 'o', 'qn', 'q')
q_leave(q[1], q[2], q[3], st[1])
local dead = retire(st[1])
redis.call('DEL', meta)
redis.call('ZREM', B .. 'lease', ARGV[2])
bump_gen()
local wl = watch_on()
if wl then
  watch_pub(wl, 'x', ARGV[2], ARGV[3], 'y', ARGV[4])
end
return {dead, st}
