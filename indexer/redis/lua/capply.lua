-- Cluster mode: the control-slot half of every write (KEYS.md, "Redis Cluster").
-- Block entries are not touched here: the authoritative tier mask and location
-- of every (block, id) live in 'k:<id>' (field ns id .. key, value mask digit
-- .. location), and the caller writes the data nodes (cblocks.lua) from the
-- writes this script returns. Each (block, id) whose data-node entries may
-- differ from 'k:<id>' stays in the pending record 'p:<id>' until the caller
-- confirms its writes (KEYS.md, "Apply: two phases").
--
-- Apply. KEYS: instance hash. ARGV: base, now, seq (decimal, any uint64),
--   model, name, incarnation fence ('' = none), address fence ('' = none),
--   A (shallow levels), the quota (lib.lua q_begin: 5 values), nb, then nb pairs (parent engine hash,
--   value the caller assumed; '' = absent), nn, then nn pairs (ns id, model \0
--   lora) to register, then ops: 'S' ns tierbit check hashes keys parent |
--   'R' mask hashes | 'C' (check: parent engine hash for the orphan test, '' =
--   none; parent: the engine hash whose location the chain continues, '' = the
--   chain starts a prompt, '?' = its position is unknown) | 'W' batch (last:
--   the batch as applied, for the watch stream; KEYS.md "Watching").
--   Returns {'noreg'} | {'model'} | {'inc'} | {'addr'} | {'retry'} | {'watch'} |
--   {'dup', seq, stale, exp, n, W} | {'part', position, exp, W} (seq is 'seq start
--   stop' for a part of a long batch: apply.lua) |
--   {'ok', gap, stale, exp, n, stored, removed, orphaned, id, over quota (a part:
--    the batch's so far, its parts before included), {retired ids}, W,
--    watched (1: a replica watches)}.
-- Pending records. KEYS: any control key. ARGV: base, '', '', then
--   'c' epoch id...: confirm: drop each record still stamped with epoch;
--   'r' id...: re-drive: the writes of each record, under a new epoch;
--   'v' (id, ns id .. key, kind, mask)...: check copies of a copy tag being
--   seeded (kind 's' shallow, 'u' unplaced) against 'k:'; W fixes them.
--   Returns {'pend', W}.
-- W = {epoch, {ids whose records it stamped}, copy-tag registry version,
--   {location, ns id .. key, id, mask (0 = delete), ...}}; epoch '' when
--   there is nothing to write. A duplicate batch re-drives the instance's
--   pending writes too: the retry of a batch cut off after this script.
-- A location is 's' .. depth byte (depth < A: copied under every copy tag),
-- 'd' .. 4 hex digits (tag of the chain's block at depth A, the anchor) or
-- 'u' (unplaced: the position is unknown; copied under every copy tag).
local sub, byte, char = string.sub, string.byte, string.char
local PEND = B .. 'pend'
local ops = {}
local function emit(loc, suf, eid, mask)
  ops[#ops + 1] = loc
  ops[#ops + 1] = suf
  ops[#ops + 1] = eid
  ops[#ops + 1] = mask
end
local function new_epoch()
  local k = B .. 'wv'
  if redis.call('EXISTS', k) == 0 then
    -- From the server time in microseconds: above any version a data node
    -- kept from before the control node restarted empty.
    local t = redis.call('TIME')
    redis.call('SET', k, t[1] .. string.format('%06d', tonumber(t[2])))
  end
  return string.format('%d', redis.call('INCR', k))
end
local function tags_version()
  return redis.call('HGET', B .. 'tags', '#') or ''
end
-- A record's value: the locations where (block, id) may have entries, each
-- prefixed with its length (a location may hold any byte).
local function locs_of(packed, into)
  local i = 1
  while i <= #packed do
    local len = byte(packed, i)
    into[sub(packed, i + 1, i + len)] = true
    i = i + len + 1
  end
  return into
end
local function pack(set)
  local out = {}
  for loc in pairs(set) do
    out[#out + 1] = char(#loc) .. loc
  end
  return table.concat(out)
end
-- The pending record of eid: {block -> set of locations}, or nil.
local function record(eid)
  local raw = redis.call('HGETALL', B .. 'p:' .. eid)
  if #raw == 0 then
    return nil, nil
  end
  local rec, name = {}, nil
  for j = 1, #raw, 2 do
    local f = raw[j]
    if f == '@' then
      name = raw[j + 1]
    elseif f ~= '#' then
      rec[f] = locs_of(raw[j + 1], {})
    end
  end
  return rec, name
end
-- Emit the writes that bring the data nodes to 'k:<eid>' for every block of
-- rec: the entry where k: places it, deletes everywhere else it may be. A
-- retired id (live false) only has deletes.
local function drive(eid, rec, live)
  local kk = B .. 'k:' .. eid
  for suf, locs in pairs(rec) do
    local cur = live and redis.call('HGET', kk, suf)
    local at = cur and sub(cur, 2)
    for loc in pairs(locs) do
      if loc ~= at then
        emit(loc, suf, eid, 0)
      end
    end
    if cur then
      emit(at, suf, eid, sub(cur, 1, 1))
    end
  end
end
-- Store rec as the pending record of eid (of instance name), stamped epoch.
local function save(eid, name, rec, epoch)
  local pk = B .. 'p:' .. eid
  local args = {'#', epoch, '@', name}
  for suf, locs in pairs(rec) do
    args[#args + 1] = suf
    args[#args + 1] = pack(locs)
    if #args >= 1000 then -- unpack() is bounded by Lua's C stack
      redis.call('HSET', pk, unpack(args))
      args = {}
    end
  end
  if #args > 0 then
    redis.call('HSET', pk, unpack(args))
  end
  redis.call('SADD', PEND, eid)
end
-- Re-drive the records of ids under one new epoch: W.
local function redrive(ids)
  local stamped, epoch = {}, ''
  for _, eid in ipairs(ids) do
    local rec, name = record(eid)
    if rec then
      if epoch == '' then
        epoch = new_epoch()
      end
      local live = name and redis.call('HGET', B .. 'i:' .. name, 'id') == eid
      drive(eid, rec, live)
      redis.call('HSET', B .. 'p:' .. eid, '#', epoch)
      stamped[#stamped + 1] = eid
    else
      redis.call('SREM', PEND, eid)
    end
  end
  return {epoch, stamped, tags_version(), ops}
end

if ARGV[3] == '' then
  local action = ARGV[4]
  if action == 'c' then
    local epoch = ARGV[5]
    for j = 6, #ARGV do
      local pk = B .. 'p:' .. ARGV[j]
      if redis.call('HGET', pk, '#') == epoch then
        redis.call('DEL', pk)
        redis.call('SREM', PEND, ARGV[j])
      end
    end
    return {'pend', {'', {}, tags_version(), {}}}
  elseif action == 'r' then
    local ids = {}
    for j = 5, #ARGV do
      ids[#ids + 1] = ARGV[j]
    end
    return {'pend', redrive(ids)}
  elseif action == 'v' then
    local dead = {}
    for _, d in ipairs(redis.call('SMEMBERS', B .. 'dead')) do
      dead[d] = true
    end
    for j = 5, #ARGV, 4 do
      local eid, suf, kind, mask = ARGV[j], ARGV[j + 1], ARGV[j + 2], ARGV[j + 3]
      local cur = not dead[eid] and redis.call('HGET', B .. 'k:' .. eid, suf)
      if not cur or sub(cur, 2, 2) ~= kind then
        emit(kind, suf, eid, 0) -- no entry of this kind: the copy is a leftover
      elseif sub(cur, 1, 1) ~= mask then
        emit(sub(cur, 2), suf, eid, sub(cur, 1, 1))
      end
    end
    return {'pend', {#ops > 0 and new_epoch() or '', {}, tags_version(), ops}}
  end
  return redis.error_reply('kvmesh capply: bad action ' .. tostring(action))
end

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
local id = h[1]
if last and seq_le(seq, last) then
  if revived then
    bump_gen()
  end
  return {'dup', h[4], stale and 1 or 0, exp, h[7], redrive({id})}
end
local partial = pstart ~= nil and pstop ~= 'end'
local carry, base = P.carry, P.base
local lastorph = false -- the last stored op was an orphan
if part_elsewhere(P) then
  if revived then
    bump_gen()
  end
  -- With the writes the parts before left pending: written before going on.
  return {'part', P.at or '0:0', exp, redrive({id})}
end
local gap = not partial and last ~= nil and last ~= seq_dec(seq)
local na = tonumber(ARGV[8])
local ek = B .. 'e:' .. id
local kk = B .. 'k:' .. id
local p = parents_hold(ek, q_begin(meta, 9, id, tonumber(h[7])))
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
-- Blocks of the current id whose entries this batch changed: ns id .. key ->
-- set of locations (every place an entry may now be wrong).
local touched = {}
local function touch(suf, loc)
  local set = touched[suf]
  if not set then
    set = {}
    touched[suf] = set
  end
  set[loc] = true
end
-- touched merged into the stored pending record of eid.
local function merged(eid)
  local rec = record(eid) or {}
  for suf, locs in pairs(touched) do
    local set = rec[suf]
    if not set then
      rec[suf] = locs
    else
      for loc in pairs(locs) do
        set[loc] = true
      end
    end
  end
  return rec
end
local function tag(key)
  return string.format('%02x%02x', byte(key, 1), byte(key, 2))
end
-- Location of a block at depth d + 1 after a block at location loc ('' = root).
local function child(loc, key)
  local c = sub(loc, 1, 1)
  if c == 'd' or c == 'u' then
    return loc
  end
  local d = loc == '' and 0 or byte(loc, 2) + 1
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
  pair_drop(suf)
  touch(suf, sub(v, 2))
  return POP[tonumber(sub(v, 1, 1))]
end
while p <= #ARGV do
  local op = ARGV[p]
  if op == 'S' or op == 'T' then
    local ns, tb, check, hb, kb, parent = ARGV[p + 1], tonumber(ARGV[p + 2]), ARGV[p + 3], ARGV[p + 4], ARGV[p + 5], ARGV[p + 6]
    p = p + 7
    hb, kb = q_admit(ns, hb, kb, id)
    local ok = true
    if carry then
      ok = false
      orphaned = orphaned + #hb / 8
    elseif check ~= '' then
      local v = redis.call('HGET', ek, check)
      if not v or sub(v, 1, 8) ~= ns then
        ok = false
        orphaned = orphaned + #hb / 8
      end
    end
    carry = false
    lastorph = not ok
    if ok then
      -- Where the chain continues: after the parent's location, at the root,
      -- or nowhere known ('u': a parent this instance does not map, in this
      -- namespace, or an event that does not say).
      local loc = ''
      if parent == '?' then
        loc = 'u'
      elseif parent ~= '' then
        local pv = redis.call('HGET', ek, parent)
        local pk = pv and sub(pv, 1, 8) == ns and redis.call('HGET', kk, pv)
        loc = pk and sub(pk, 2) or 'u'
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
            copies_drop(id, eh, 7)
            redis.call('HSET', ek, eh, suf)
          end
        end
        local v = redis.call('HGET', kk, suf)
        if not v then
          redis.call('HSET', kk, suf, tb .. loc)
          stored = stored + 1
          n = n + 1
          confirm(id, suf)
          pair_add(suf)
          touch(suf, loc)
        else
          local m = tonumber(sub(v, 1, 1))
          local oloc = sub(v, 2)
          if loc == 'u' then
            loc = oloc -- a known place beats none; the chain continues from it
          end
          local nm = m
          if bit.band(m, tb) == 0 then
            nm = m + tb
            stored = stored + 1
            n = n + 1
          elseif op == 'T' then
            copy_add(id, eh, tb)
          end
          if oloc ~= loc then
            touch(suf, oloc)
          end
          if nm ~= m or oloc ~= loc then
            redis.call('HSET', kk, suf, nm .. loc)
            touch(suf, loc)
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
        local v = redis.call('HGET', kk, suf)
        local old = v and tonumber(sub(v, 1, 1)) or 0
        local new = old - bit.band(old, mask)
        local d = POP[old] - POP[new]
        removed = removed + d
        n = n - d
        if new ~= 0 then
          if d ~= 0 then
            redis.call('HSET', kk, suf, new .. sub(v, 2))
            touch(suf, sub(v, 2))
          end
        else
          if old ~= 0 then
            redis.call('HDEL', kk, suf)
            pair_drop(suf)
            touch(suf, sub(v, 2))
            -- A prediction of the block the engine dropped goes with it.
            redis.call('HDEL', B .. 'pr:' .. suf, id)
          end
          redis.call('HDEL', ek, eh)
        end
      end
    end
  elseif op == 'C' then
    p = p + 1
    -- The old id's changed blocks go to its pending record: purging it (it
    -- is retired) deletes them where k: no longer says they are.
    local rec = merged(id)
    local dead = retire(id)
    q_clear(id)
    if next(rec) then
      save(id, ARGV[5], rec, '')
      if dead == '' then
        redis.call('SADD', B .. 'dead', id)
        dead = id
      end
    end
    if dead ~= '' then
      retired[#retired + 1] = dead
    end
    touched = {}
    removed = removed + n
    n = 0
    id = new_id()
    ek = B .. 'e:' .. id
    kk = B .. 'k:' .. id
    redis.call('HSET', meta, 'id', id)
    cleared = true
  elseif op == 'W' then
    p = p + 2 -- the batch for the watch stream (below)
  else
    return redis.error_reply('kvmesh capply: bad op ' .. tostring(op))
  end
end
ns_flush()
local nstale = (stale or gap) and not cleared
batch_end(meta, P, id, n, nstale, lastorph, stored, removed, orphaned, Q.over)
q_end(meta, id, n)
if revived or cleared or nstale ~= stale then
  bump_gen()
end
-- The writes: this batch's and any the instance still had pending.
local rec = merged(id)
local w = {'', {}, tags_version(), ops}
if next(rec) then
  local epoch = new_epoch()
  save(id, ARGV[5], rec, epoch)
  drive(id, rec, true)
  w = {epoch, {id}, tags_version(), ops}
end
local wl = watch_on()
local watched = 0
if wl then
  watched = 1
  watch_batch(wl, P, Q.over, ARGV[#ARGV])
end
return {'ok', gap and 1 or 0, nstale and 1 or 0, exp, n, base[1] + stored, base[2] + removed,
  base[3] + orphaned, id, base[4] + Q.over, retired, w,
  watched}
