-- Start or go on watching (KEYS.md, "Watching"). KEYS: none (cluster: a
-- control key). ARGV: base, stream length
-- bound, lease (ms), now. Sets 'wl' for the lease: while it is there, every
-- script that changes the index appends the change to the stream; and 'wp'
-- with it (a watcher that takes route-time predictions, this version's: a
-- replica that predates 'p' entries never sets it), while which predict.lua
-- appends them too. The first
-- start appends a start entry (so a user without the stream's ACL rights is
-- refused here, before any write depends on them).
-- Returns {number of the last entry ('wn'), id of the last entry or '0-0'}.
if not watch_on() then
  watch_pub(ARGV[2], 's', '', ARGV[4])
end
redis.call('SET', B .. 'wl', ARGV[2], 'PX', ARGV[3])
redis.call('SET', B .. 'wp', '1', 'PX', ARGV[3])
local top = redis.call('XREVRANGE', B .. 'w', '+', '-', 'COUNT', 1)
local id = '0-0'
if top[1] then
  id = top[1][1]
end
return {redis.call('GET', B .. 'wn'), id}
