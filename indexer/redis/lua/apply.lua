-- Apply one event batch atomically.
-- KEYS: instance hash.
-- ARGV: base, now, seq (decimal, any uint64; or 'seq start stop' for one part
--   of a long batch, see below), model, name, incarnation
--   fence ('' = none), address fence ('' = none), the quota (lib.lua q_begin:
--   5 values), nb, then nb pairs (parent engine hash, value the caller assumed; '' = absent),
--   nn, then nn pairs (ns id, model \0 lora) to register,
--   then ops:  'S' ns tierbit parent hashes keys | 'R' mask hashes | 'C'
--   (hashes and keys packed as 8-byte big-endian words; parent '' = no check)
--   | 'W' batch: the batch as applied (an EventBatch message) for the watch
--   stream (lib.lua watch_pub; without it a watched apply tells readers to
--   read the instance again).
-- A long batch is applied in parts (KEYS.md, "Apply in parts"): ARGV[3] is then
--   'seq start stop', the part's first and next positions in the batch as
--   'event:block' ('end' after the last part). A part applies only where the
--   instance's progress on the batch (field 'pp': id, seq, position reached)
--   says the batch stands; else {'part', position} says where it stands (also
--   to a whole batch of which parts are in). Only the last part records the
--   sequence and the stale flag.
-- Returns {'noreg'} | {'model'} | {'inc'} | {'addr'} | {'retry'} | {'watch'} |
--   {'dup', seq, stale, exp, n} | {'part', position, exp} |
--   {'ok', gap, stale, exp, n, stored, removed, orphaned, id, over quota (a part:
--    the batch's so far, its parts before included),
--    watched (1: a replica watches, P:wl), retired ids...}
local meta = KEYS[1]
local now = tonumber(ARGV[2])
local h = redis.call('HMGET', meta, 'id', 'm', 'ttl', 'seq', 'st', 'exp', 'n', 'inc', 'a', 'pp')
if not h[1] then
  return {'noreg'}
end
if h[2] ~= ARGV[4] then
  return {'model'}
end
if ARGV[6] ~= '' and h[8] ~= ARGV[6] then
  return {'inc'}
end
if ARGV[7] ~= '' and h[9] ~= ARGV[7] then
  return {'addr'}
end
-- A replica watches (P:wl) and the caller did not pass the batch (the 'W' op,
-- always the last two arguments): nothing is written, the caller passes it.
if ARGV[#ARGV - 1] ~= 'W' and watch_on() then
  return {'watch'}
end
local exp = string.format('%.17g', now + tonumber(h[3]))
redis.call('HSET', meta, 'exp', exp)
redis.call('ZADD', B .. 'lease', exp, ARGV[5])
local revived = tonumber(h[6]) <= now
local stale = h[5] == '1'
-- Sequences stay decimal strings: compared exactly (lib.lua seq_le).
local last = h[4] or nil -- HMGET gives false for a missing field
-- A part of a long batch, or the whole (lib.lua part_begin).
local P = part_begin(ARGV[3], h[10], h[1])
local seq, pstart, pstop = P.seq, P.start, P.stop
if last and seq_le(seq, last) then
  if revived then
    bump_gen()
  end
  return {'dup', h[4], stale and 1 or 0, exp, h[7]}
end
local id = h[1]
-- Parts: each applies once, in order, whichever replica sends it; the whole
-- batch, where parts of it are in, goes on in parts from there.
local partial = pstart ~= nil and pstop ~= 'end'
local carry, base = P.carry, P.base
local lastorph = false -- the last stored op was an orphan
if part_elsewhere(P) then
  if revived then
    bump_gen()
  end
  return {'part', P.at or '0:0', exp}
end
-- The gap and the stale flag are the whole batch's: decided by its last part.
local gap = not partial and last ~= nil and last ~= seq_dec(seq)
local ek = B .. 'e:' .. id
local p = parents_hold(ek, q_begin(meta, 8, id, tonumber(h[7])))
if not p then
  -- The lease above was renewed: a revival moves the generation even though
  -- the batch is retried (the retry finds the lease running, not revived).
  if revived then
    bump_gen()
  end
  return {'retry'}
end
p = register_namespaces(p)
local n = tonumber(h[7])
local stored, removed, orphaned = 0, 0, 0
local cleared = false
local retired = {}
local wblob = nil
local bpre = B .. 'b:'
local sub = string.sub
while p <= #ARGV do
  local op = ARGV[p]
  if op == 'S' or op == 'T' then
    local ns, tb, parent, hb, kb = ARGV[p + 1], tonumber(ARGV[p + 2]), ARGV[p + 3], ARGV[p + 4], ARGV[p + 5]
    p = p + 6
    hb, kb = q_admit(ns, hb, kb, id)
    local ok = true
    if carry then
      ok = false
      orphaned = orphaned + #hb / 8
    elseif parent ~= '' then
      local v = redis.call('HGET', ek, parent)
      if not v or sub(v, 1, 8) ~= ns then
        ok = false
        orphaned = orphaned + #hb / 8
      end
    end
    carry = false
    lastorph = not ok
    if ok then
      local cnt = math.min(#hb, #kb) / 8
      for i = 1, cnt do
        local eh = sub(hb, 8 * i - 7, 8 * i)
        local suf = ns .. sub(kb, 8 * i - 7, 8 * i)
        if redis.call('HSETNX', ek, eh, suf) == 0 then
          local old = redis.call('HGET', ek, eh)
          if old ~= suf then
            local d = drop_entry(old, id)
            removed = removed + d
            n = n - d
            copies_drop(id, eh, 7)
            redis.call('HSET', ek, eh, suf)
          end
        end
        local bk = bpre .. suf
        if redis.call('HSETNX', bk, id, tb) == 1 then
          stored = stored + 1
          n = n + 1
          confirm(id, suf)
          if redis.call('HLEN', bk) == 1 then
            ns_add(ns, 1, 1)
          else
            ns_add(ns, 0, 1)
          end
        else
          local m = tonumber(redis.call('HGET', bk, id))
          if bit.band(m, tb) == 0 then
            redis.call('HSET', bk, id, m + tb)
            stored = stored + 1
            n = n + 1
          elseif op == 'T' then
            copy_add(id, eh, tb)
          end
        end
      end
    end
  elseif op == 'R' or op == 'Q' then
    local rmask, hb = tonumber(ARGV[p + 1]), ARGV[p + 2]
    p = p + 3
    carry, lastorph = false, false

    for i = 1, #hb / 8 do
      local eh = sub(hb, 8 * i - 7, 8 * i)
      local suf = redis.call('HGET', ek, eh)
      local mask = rmask
      if suf and op == 'Q' then
        mask = uncopied(id, eh, rmask)
      end
      if suf and mask ~= 0 then
        copies_drop(id, eh, mask)
        local bk = bpre .. suf
        local m = redis.call('HGET', bk, id)
        local old = m and tonumber(m) or 0
        local new = old - bit.band(old, mask)
        local d = POP[old] - POP[new]
        removed = removed + d
        n = n - d
        if new ~= 0 then
          if d ~= 0 then
            redis.call('HSET', bk, id, new)
          end
        else
          if old ~= 0 then
            redis.call('HDEL', bk, id)
            -- A prediction of the block the engine dropped goes with it.
            redis.call('HDEL', B .. 'pr:' .. suf, id)
            if redis.call('EXISTS', bk) == 0 then
              ns_add(sub(suf, 1, 8), -1, -1)
            else
              ns_add(sub(suf, 1, 8), 0, -1)
            end
          end
          redis.call('HDEL', ek, eh)
        end
      end
    end
  elseif op == 'W' then
    wblob = ARGV[p + 1]
    p = p + 2
  elseif op == 'C' then
    p = p + 1
    -- Rotate to a fresh int id: O(1) here, the old entries are purged in chunks.
    local dead = retire(id)
    if dead ~= '' then
      retired[#retired + 1] = dead
    end
    q_clear(id)
    removed = removed + n
    n = 0
    id = new_id()
    ek = B .. 'e:' .. id
    redis.call('HSET', meta, 'id', id)
    cleared = true
  else
    return redis.error_reply('kvmesh apply: bad op ' .. tostring(op))
  end
end
ns_flush()
local nstale = (stale or gap) and not cleared
batch_end(meta, P, id, n, nstale, lastorph, stored, removed, orphaned, Q.over)
q_end(meta, id, n)
if revived or cleared or nstale ~= stale then
  bump_gen()
end
local wl = watch_on()
local watched = 0
if wl then
  watched = 1
  watch_batch(wl, P, Q.over, wblob)
end
local out = {'ok', gap and 1 or 0, nstale and 1 or 0, exp, n, base[1] + stored, base[2] + removed,
  base[3] + orphaned, id, base[4] + Q.over,
  watched}
for _, r in ipairs(retired) do
  out[#out + 1] = r
end
return out
