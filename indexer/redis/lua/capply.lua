-- Cluster mode: the control-slot half of apply.lua (see KEYS.md, "Redis Cluster").
-- KEYS: instance hash. ARGV: base, now, seq, model, name, A (shallow levels),
--   nb, then nb pairs (parent engine hash, value the caller assumed; '' = absent),
--   nn, then nn pairs (ns id, model \0 lora) to register,
--   then ops:  'S' ns tierbit check hashes keys parent | 'R' mask hashes | 'C'
--   (check: parent engine hash for the orphan test, '' = none; parent: engine
--   hash whose location the chain continues, '' = a root chain).
-- Block entries are not touched here: the authoritative tier mask and location
-- of every (block, id) live in 'k:<id>' (field ns id .. key, value mask digit
-- .. location) and the script returns the entries to write on the data nodes:
-- Returns {'noreg'} | {'model'} | {'retry'} | {'dup', seq, stale, exp, n} |
--   {'ok', gap, stale, exp, n, stored, removed, orphaned, id, {retired ids},
--    {location, ns id .. key, id, mask (0 = delete), ...}}
-- A location is 's' .. depth byte (depth < A: copied on every master) or
-- 'd' .. 4 hex digits (tag of the chain's block at depth A, the anchor).
local meta = KEYS[1]
local now = tonumber(ARGV[2])
local h = redis.call('HMGET', meta, 'id', 'm', 'ttl', 'seq', 'st', 'exp', 'n')
if not h[1] then
  return {'noreg'}
end
if h[2] ~= ARGV[4] then
  return {'model'}
end
local exp = string.format('%.17g', now + tonumber(h[3]))
redis.call('HSET', meta, 'exp', exp)
redis.call('ZADD', B .. 'lease', exp, ARGV[5])
local revived = tonumber(h[6]) <= now
local stale = h[5] == '1'
local last = nil
if h[4] then
  last = tonumber(h[4])
end
local seq = tonumber(ARGV[3])
if last and seq <= last then
  if revived then
    bump_gen()
  end
  return {'dup', h[4], stale and 1 or 0, exp, h[7]}
end
local gap = last ~= nil and seq > last + 1
local na = tonumber(ARGV[6])
local id = h[1]
local ek = B .. 'e:' .. id
local kk = B .. 'k:' .. id
local p = 7
local nb = tonumber(ARGV[p])
for j = 1, nb do
  local v = redis.call('HGET', ek, ARGV[p + 2 * j - 1])
  if (v or '') ~= ARGV[p + 2 * j] then
    return {'retry'}
  end
end
p = p + 2 * nb + 1
local nn = tonumber(ARGV[p])
for j = 1, nn do
  redis.call('HSETNX', B .. 'ns', ARGV[p + 2 * j - 1], ARGV[p + 2 * j])
end
p = p + 2 * nn + 1
local n = tonumber(h[7])
local stored, removed, orphaned = 0, 0, 0
local cleared = false
local retired, ops = {}, {}
local sub, byte, char = string.sub, string.byte, string.char
local function emit(loc, suf, eid, mask)
  ops[#ops + 1] = loc
  ops[#ops + 1] = suf
  ops[#ops + 1] = eid
  ops[#ops + 1] = mask
end
local function tag(key)
  return string.format('%02x%02x', byte(key, 1), byte(key, 2))
end
-- Location of a block at depth d + 1 after a block at location loc ('' = root).
local function child(loc, key)
  local d
  if loc == '' then
    d = 0
  elseif sub(loc, 1, 1) == 'd' then
    return loc
  else
    d = byte(loc, 2) + 1
  end
  if d < na then
    return 's' .. char(d)
  end
  return 'd' .. tag(key)
end
-- Drop the entry of `id` on block `suf`; return the bits dropped.
local function kdrop(suf)
  local v = redis.call('HGET', kk, suf)
  if not v then
    return 0
  end
  redis.call('HDEL', kk, suf)
  ns_add(sub(suf, 1, 8), 0, -1)
  emit(sub(v, 2), suf, id, 0)
  return POP[tonumber(sub(v, 1, 1))]
end
while p <= #ARGV do
  local op = ARGV[p]
  if op == 'S' then
    local ns, tb, check, hb, kb, parent = ARGV[p + 1], tonumber(ARGV[p + 2]), ARGV[p + 3], ARGV[p + 4], ARGV[p + 5], ARGV[p + 6]
    p = p + 7
    local ok = true
    if check ~= '' then
      local v = redis.call('HGET', ek, check)
      if not v or sub(v, 1, 8) ~= ns then
        ok = false
        orphaned = orphaned + #hb / 8
      end
    end
    if ok then
      -- Where the chain continues. A parent this instance does not map can not be
      -- placed: its blocks go under their own first key as anchor. No Match can
      -- reach them through this instance anyway (it does not hold the parent).
      local loc = ''
      if parent ~= '' then
        local pv = redis.call('HGET', ek, parent)
        local pk = pv and redis.call('HGET', kk, pv)
        if pk then
          loc = sub(pk, 2)
        else
          loc = 'd' .. tag(sub(kb, 1, 8))
        end
      end
      local cnt = math.min(#hb, #kb) / 8
      for i = 1, cnt do
        local eh = sub(hb, 8 * i - 7, 8 * i)
        local key = sub(kb, 8 * i - 7, 8 * i)
        local suf = ns .. key
        loc = child(loc, key)
        if redis.call('HSETNX', ek, eh, suf) == 0 then
          local old = redis.call('HGET', ek, eh)
          if old ~= suf then
            local d = kdrop(old)
            removed = removed + d
            n = n - d
            redis.call('HSET', ek, eh, suf)
          end
        end
        local v = redis.call('HGET', kk, suf)
        if not v then
          redis.call('HSET', kk, suf, tb .. loc)
          stored = stored + 1
          n = n + 1
          ns_add(ns, 0, 1)
          emit(loc, suf, id, tb)
        else
          local m = tonumber(sub(v, 1, 1))
          local oloc = sub(v, 2)
          local nm = m
          if bit.band(m, tb) == 0 then
            nm = m + tb
            stored = stored + 1
            n = n + 1
          end
          if oloc ~= loc then
            emit(oloc, suf, id, 0)
          end
          if nm ~= m or oloc ~= loc then
            redis.call('HSET', kk, suf, nm .. loc)
            emit(loc, suf, id, nm)
          end
        end
      end
    end
  elseif op == 'R' then
    local mask, hb = tonumber(ARGV[p + 1]), ARGV[p + 2]
    p = p + 3
    for i = 1, #hb / 8 do
      local eh = sub(hb, 8 * i - 7, 8 * i)
      local suf = redis.call('HGET', ek, eh)
      if suf then
        local v = redis.call('HGET', kk, suf)
        local old = v and tonumber(sub(v, 1, 1)) or 0
        local new = old - bit.band(old, mask)
        local d = POP[old] - POP[new]
        removed = removed + d
        n = n - d
        if new ~= 0 then
          if d ~= 0 then
            redis.call('HSET', kk, suf, new .. sub(v, 2))
            emit(sub(v, 2), suf, id, new)
          end
        else
          if old ~= 0 then
            redis.call('HDEL', kk, suf)
            ns_add(sub(suf, 1, 8), 0, -1)
            emit(sub(v, 2), suf, id, 0)
          end
          redis.call('HDEL', ek, eh)
        end
      end
    end
  elseif op == 'C' then
    p = p + 1
    local dead = retire(id)
    if dead ~= '' then
      retired[#retired + 1] = dead
    end
    removed = removed + n
    n = 0
    id = new_id()
    ek = B .. 'e:' .. id
    kk = B .. 'k:' .. id
    redis.call('HSET', meta, 'id', id)
    cleared = true
  else
    return redis.error_reply('kvmesh capply: bad op ' .. tostring(op))
  end
end
ns_flush()
local nstale = (stale or gap) and not cleared
redis.call('HSET', meta, 'seq', ARGV[3], 'st', nstale and 1 or 0, 'n', n)
if revived or cleared or nstale ~= stale then
  bump_gen()
end
return {'ok', gap and 1 or 0, nstale and 1 or 0, exp, n, stored, removed, orphaned, id, retired, ops}
