-- Cluster mode: write block entries on one data node (KEYS.md, "Redis Cluster").
-- KEYS: one of the names written (routing only; every name must be local).
-- ARGV: base, epoch, n, the n copy tags (the registry's order), then quadruples
--   (block name, id, mask, counter field); mask '0' deletes the entry.
--   epoch: the write epoch of the batch (capply.lua); '' writes unconditionally
--   (purging a retired id); 'm' merges, never overwriting a field (seeding a
--   copy tag from another one). An empty block name forgets the id's version.
-- Versions: 'v:{home}' (home: the first of the copy tags this node serves)
-- holds per id the highest epoch written here. Writes of an id under an older
-- epoch are dropped: they belong to a batch whose pending writes a newer call
-- has already re-driven (a write that arrived late, after its caller gave up).
-- Per copy tag: 'c:{tag}' field 'U' .. ns id marks that unplaced copies exist
-- (match.lua reads it), and 'x:{tag}' lists the copies (field: the name after
-- the tag), which is how a new copy tag is seeded. Block counts for stats are
-- the control slot's (P:nsb, from the holders count 'kh' that capply.lua keeps).
-- Returns the ids whose writes were dropped.
local pb = string.sub(B, 2, -3) .. ':' -- block and node keys use the plain prefix
local epoch = ARGV[2]
local nt = tonumber(ARGV[3])
local home
for i = 4, 3 + nt do
  if type(redis.pcall('EXISTS', pb .. 'c:{' .. ARGV[i] .. '}')) ~= 'table' then
    home = ARGV[i] -- not an error: this node serves the tag
    break
  end
end
local vk = home and (pb .. 'v:{' .. home .. '}')
local merge = epoch == 'm'
local versioned = vk and epoch ~= '' and not merge
local byte, sub, match = string.byte, string.sub, string.match
local ok, dropped = {}, {}
for i = 4 + nt, #ARGV, 4 do
  local bk, id, m, cf = ARGV[i], ARGV[i + 1], ARGV[i + 2], ARGV[i + 3]
  if bk == '' then
    if vk then
      redis.call('HDEL', vk, id)
    end
  else
    if versioned and ok[id] == nil then
      local v = redis.call('HGET', vk, id)
      if v and not seq_le(v, epoch) then
        ok[id] = false
        dropped[#dropped + 1] = id
      else
        ok[id] = true
        if v ~= epoch then
          redis.call('HSET', vk, id, epoch)
        end
      end
    end
    if ok[id] ~= false then
      local kind = byte(cf, 1) -- 100 'd', 115 's', 117 'u'
      local ck, xk, entry = nil, nil, nil
      if kind ~= 100 then
        local tag, rest = match(bk, '{([^}]*)}(.*)$')
        ck = pb .. 'c:{' .. tag .. '}'
        xk = pb .. 'x:{' .. tag .. '}'
        entry = rest
      end
      if m == '0' then
        if redis.call('HDEL', bk, id) == 1 and xk and redis.call('EXISTS', bk) == 0 then
          redis.call('HDEL', xk, entry)
        end
      else
        local new
        if merge then
          new = redis.call('HSETNX', bk, id, m)
        else
          new = redis.call('HSET', bk, id, m)
        end
        if new == 1 then
          if xk and redis.call('HLEN', bk) == 1 then
            redis.call('HSET', xk, entry, 1)
          end
          if kind == 117 then
            redis.call('HSET', ck, 'U' .. sub(cf, 2), 1)
          end
        end
      end
    end
  end
end
return dropped
