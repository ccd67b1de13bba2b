-- Shared prelude, prepended by indexer/redis_backend.py to every script.
-- ARGV[1] is always the key base "<prefix>:"; names follow indexer/keys.py.
local B = ARGV[1]
local FIELDS = {'id', 'w', 'r', 'm', 'a', 'ttl', 'inc', 'exp', 'seq', 'st', 'n'}
-- bits set in a tier mask 0..7
local POP = {[0] = 0, 1, 1, 2, 1, 2, 2, 3}
-- tier (1 gpu, 2 cpu, 3 disk) holding the fastest copy, for masks 1..7
local FAST = {1, 2, 1, 3, 1, 2, 1}
-- the same by the mask as a reply gives it (a digit string): no tonumber a block
local FASTS = {['1'] = 1, ['2'] = 2, ['3'] = 1, ['4'] = 3, ['5'] = 1, ['6'] = 2, ['7'] = 1}

-- New generation when this script bumped it (reported to the caller in cluster mode).
local bumped = false
local function bump_gen()
  local k = B .. 'gen'
  if redis.call('EXISTS', k) == 0 then
    -- Start from the server time in microseconds so that a generation seen
    -- before a Redis restart is never seen again after it.
    local t = redis.call('TIME')
    redis.call('SET', k, t[1] .. string.format('%06d', tonumber(t[2])))
  end
  bumped = redis.call('INCR', k)
  return bumped
end

local function state(meta)
  return redis.call('HMGET', meta, unpack(FIELDS))
end

-- Replaced by true in the scripts of cluster mode (indexer/redis_backend.py).
local CLUSTER = false

local function new_id()
  if redis.call('EXISTS', B .. 'ids') == 0 then
    -- A restarted Redis must not hand out ids that a replica's cached table
    -- still gives to an instance of before the restart (its Matches would
    -- name that instance with the new one's blocks), nor, in cluster mode, ids
    -- that block entries left on the other nodes still carry: start from the
    -- clock (ms).
    local t = redis.call('TIME')
    redis.call('SET', B .. 'ids', t[1] .. string.format('%03d', math.floor(tonumber(t[2]) / 1000)))
  end
  return tostring(redis.call('INCR', B .. 'ids'))
end

-- Per-namespace counter deltas, flushed once per script.
local nsd = {}
local function ns_add(ns, dblocks, dpairs)
  local d = nsd[ns]
  if not d then
    d = {0, 0}
    nsd[ns] = d
  end
  d[1] = d[1] + dblocks
  d[2] = d[2] + dpairs
end
local function ns_flush()
  for ns, d in pairs(nsd) do
    if d[1] ~= 0 and redis.call('HINCRBY', B .. 'nsb', ns, d[1]) <= 0 then
      redis.call('HDEL', B .. 'nsb', ns)
    end
    if d[2] ~= 0 and redis.call('HINCRBY', B .. 'nsbi', ns, d[2]) <= 0 then
      redis.call('HDEL', B .. 'nsbi', ns)
    end
  end
end

-- Cluster: a (block key, id) pair added to or dropped from 'k:<id>'. 'kh'
-- (field ns id .. key) counts each key's holders in the control slot, so that
-- P:nsb counts a key once however its holders' entries are placed.
local function pair_add(suf)
  local first = redis.call('HINCRBY', B .. 'kh', suf, 1) == 1
  ns_add(string.sub(suf, 1, 8), first and 1 or 0, 1)
end
local function pair_drop(suf)
  local left = redis.call('HINCRBY', B .. 'kh', suf, -1)
  if left <= 0 then
    redis.call('HDEL', B .. 'kh', suf)
  end
  ns_add(string.sub(suf, 1, 8), left <= 0 and -1 or 0, -1)
end

-- Batches that count copies ('T' / 'Q' ops): 'cp:<id>' field engine hash ..
-- tier bit digit -> copies of that (block, tier) beyond the first.
local cp_held = {} -- per id: whether 'cp:<id>' may exist (looked up once a script)
local function copy_add(id, eh, tb)
  redis.call('HINCRBY', B .. 'cp:' .. id, eh .. tb, 1)
  cp_held[id] = true
end
-- The copies of `eh` on the tiers of `mask` go (its block goes from those
-- tiers, or the hash now names another block), as the memory backend drops them.
local function copies_drop(id, eh, mask)
  local ck = B .. 'cp:' .. id
  local held = cp_held[id]
  if held == nil then
    held = redis.call('EXISTS', ck) == 1
    cp_held[id] = held
  end
  if held then
    for _, b in ipairs({1, 2, 4}) do
      if bit.band(mask, b) ~= 0 then
        redis.call('HDEL', ck, eh .. b)
      end
    end
  end
end
-- The bits of `mask` whose last copy of `eh` goes; one copy of each other
-- bit is taken.
local function uncopied(id, eh, mask)
  local ck = B .. 'cp:' .. id
  local out = 0
  for _, b in ipairs({1, 2, 4}) do
    if bit.band(mask, b) ~= 0 then
      local f = eh .. b
      local c = tonumber(redis.call('HGET', ck, f) or '0')
      if c <= 0 then
        out = out + b
      elseif c == 1 then
        redis.call('HDEL', ck, f)
      else
        redis.call('HSET', ck, f, c - 1)
      end
    end
  end
  return out
end

-- Drop the entry of int id `id` on block `suf` (ns id .. key); return bits dropped.
local function drop_entry(suf, id)
  local bk = B .. 'b:' .. suf
  local m = redis.call('HGET', bk, id)
  if not m then
    return 0
  end
  redis.call('HDEL', bk, id)
  if redis.call('EXISTS', bk) == 0 then
    ns_add(string.sub(suf, 1, 8), -1, -1)
  else
    ns_add(string.sub(suf, 1, 8), 0, -1)
  end
  return POP[tonumber(m)]
end

-- Queue the int id of `meta` for purging when it still has entries; return it or ''.
-- A store confirms id's prediction of block suf (KEYS.md, "Predictions"):
-- it leaves 'po:<id>', 'pq:<id>' and 'pr:', so what 'po:<id>' holds unexpired is the
-- prefill routers sent the id and its engine has not finished (apply.lua,
-- capply.lua). One EXISTS per id a script, and nothing more where the id has
-- no prediction.
local pred_of, predicting = nil, false
local function confirm(id, suf)
  if pred_of ~= id then
    pred_of = id
    predicting = redis.call('EXISTS', B .. 'po:' .. id) == 1
  end
  if predicting and redis.call('ZREM', B .. 'po:' .. id, suf) == 1 then
    redis.call('HDEL', B .. 'pr:' .. suf, id)
    redis.call('ZREM', B .. 'pq:' .. id, suf)
  end
end

local function retire(id)
  -- Its route-time predictions (standalone: 'po:' lists them) are purged too.
  if redis.call('EXISTS', B .. 'e:' .. id) == 1 or redis.call('EXISTS', B .. 'po:' .. id) == 1 then
    redis.call('SADD', B .. 'dead', id)
    return id
  end
  return ''
end

-- Sequence numbers are uint64s passed and stored as decimal strings (no
-- leading zeros). They are compared exactly, by length then digit by digit:
-- a Lua number (a double) can not tell neighbours apart above 2^53.
local function seq_le(a, b)
  if #a ~= #b then
    return #a < #b
  end
  for i = 1, #a do
    local x, y = string.byte(a, i), string.byte(b, i)
    if x ~= y then
      return x < y
    end
  end
  return true
end

-- The decimal string of s - 1, for a decimal string s > 0.
local function seq_dec(s)
  local i = #s
  while string.byte(s, i) == 48 do -- trailing zeros become nines
    i = i - 1
  end
  local head = string.sub(s, 1, i - 1)
  local d = string.byte(s, i) - 1
  if head ~= '' or d ~= 48 or i == #s then -- no leading zero, but '0' itself
    head = head .. string.char(d)
  end
  return head .. string.rep('9', #s - i)
end

-- The parents a caller resolved before a batch: nb, then nb pairs (engine hash,
-- value it assumed in map `ek`; '' = absent) from ARGV[p]. All must still hold,
-- checked before any write, so that the caller's key chain and orphan
-- prediction hold. Returns the index after them, or nil when one changed.
local function parents_hold(ek, p)
  local nb = tonumber(ARGV[p])
  for j = 1, nb do
    local v = redis.call('HGET', ek, ARGV[p + 2 * j - 1])
    if (v or '') ~= ARGV[p + 2 * j] then
      return nil
    end
  end
  return p + 2 * nb + 1
end

-- Namespaces a batch names: nn, then nn pairs (ns id, model \0 lora) from
-- ARGV[p]. Returns the index after them. A name is registered (ns_note) once a
-- store in its namespace is admitted: a store the quotas leave out registers none.
local ns_names = {}
local function register_namespaces(p)
  local nn = tonumber(ARGV[p])
  for j = 1, nn do
    ns_names[ARGV[p + 2 * j - 1]] = ARGV[p + 2 * j]
  end
  return p + 2 * nn + 1
end
local function ns_note(ns)
  local name = ns_names[ns]
  if name then
    redis.call('HSETNX', B .. 'ns', ns, name)
    ns_names[ns] = nil
  end
end

-- Quotas (KEYS.md, "Quotas"; indexer/index.py). 'q:<identity>' counts what the
-- instances an identity owns hold: 'i' instances, 'b' blocks (the sum of their
-- usage, each instance's share in its field 'q'), 'n' namespaces and, per
-- namespace, 's' .. ns id -> how many of its instances hold it. 'l:<id>' is the
-- set of LoRA namespaces int id stored in. An instance's owner is its field
-- 'o', its model's ns id 'qn'.
local function q_key(owner)
  return B .. 'q:' .. owner
end
-- One more instance of qk holds namespace ns.
local function q_hold(qk, ns)
  if redis.call('HINCRBY', qk, 's' .. ns, 1) == 1 then
    redis.call('HINCRBY', qk, 'n', 1)
  end
end
-- One instance of qk less holds namespace ns.
local function q_drop(qk, ns)
  if redis.call('HINCRBY', qk, 's' .. ns, -1) <= 0 then
    redis.call('HDEL', qk, 's' .. ns)
    redis.call('HINCRBY', qk, 'n', -1)
  end
end
-- The LoRA namespaces of int id leave qk (nil: an instance of nobody).
local function q_release(qk, id)
  local lk = B .. 'l:' .. id
  if qk then
    for _, ns in ipairs(redis.call('SMEMBERS', lk)) do
      q_drop(qk, ns)
    end
  end
  redis.call('DEL', lk)
end
-- Add d to the blocks qk holds (never a '-0', which HINCRBY refuses).
local function q_blocks(qk, d)
  if d ~= 0 then
    redis.call('HINCRBY', qk, 'b', string.format('%d', d))
  end
end
-- What qk holds: instances, namespaces (numbers; 0 for none).
local function q_counts(qk)
  local c = redis.call('HMGET', qk, 'i', 'n')
  return tonumber(c[1] or '0'), tonumber(c[2] or '0')
end
-- An instance leaves its owner: meta fields o, qn, q and its int id.
local function q_leave(o, qn, q, id)
  if not o then
    redis.call('DEL', B .. 'l:' .. id)
    return
  end
  local qk = q_key(o)
  q_release(qk, id)
  q_drop(qk, qn)
  q_blocks(qk, 0 - tonumber(q or '0'))
  if redis.call('HINCRBY', qk, 'i', -1) <= 0 then
    redis.call('DEL', qk)
  end
end

-- The quota walk of one batch: ARGV[p .. p + 4] are the caps (blocks per
-- instance, blocks of the owner, namespaces of the owner; 0: none), the
-- instance's model's ns id and the ns ids outside every cap (8 bytes each).
local Q = nil
local function q_begin(meta, p, id, n)
  local f = redis.call('HMGET', meta, 'o', 'q')
  Q = {
    qk = f[1] and q_key(f[1]) or nil,
    q = tonumber(f[2] or '0'),
    ci = tonumber(ARGV[p]),
    cb = tonumber(ARGV[p + 1]),
    cn = tonumber(ARGV[p + 2]),
    base = ARGV[p + 3],
    free = {},
    used = math.max(n, redis.call('HLEN', B .. 'e:' .. id)),
    owned = 0,
    over = 0,
  }
  if Q.qk then
    Q.owned = tonumber(redis.call('HGET', Q.qk, 'b') or '0')
  end
  local free = ARGV[p + 4]
  for i = 1, #free, 8 do
    Q.free[string.sub(free, i, i + 7)] = true
  end
  return p + 5
end
-- A store op's hashes and keys cut to the blocks the quotas admit, for int id.
local function q_admit(ns, hb, kb, id)
  if Q.free[ns] then
    if #hb > 0 then
      ns_note(ns)
    end
    return hb, kb
  end
  local cnt = #hb / 8
  local keep = cnt
  if Q.qk and ns ~= Q.base and redis.call('SADD', B .. 'l:' .. id, ns) == 1 then
    q_hold(Q.qk, ns)
    if Q.cn > 0 and select(2, q_counts(Q.qk)) > Q.cn then
      q_drop(Q.qk, ns)
      redis.call('SREM', B .. 'l:' .. id, ns)
      keep = 0
    end
  end
  if keep > 0 and Q.ci > 0 then
    keep = math.min(keep, Q.ci - Q.used)
  end
  if keep > 0 and Q.qk and Q.cb > 0 then
    keep = math.min(keep, Q.cb - Q.owned)
  end
  if keep < 0 then
    keep = 0
  end
  if keep < cnt then
    Q.over = Q.over + cnt - keep
    hb, kb = string.sub(hb, 1, 8 * keep), string.sub(kb, 1, 8 * keep)
  end
  Q.used = Q.used + keep
  Q.owned = Q.owned + keep
  if keep > 0 then
    ns_note(ns)
  end
  return hb, kb
end
-- AllBlocksCleared: the retired int id's LoRA namespaces go, its usage is given back.
local function q_clear(old)
  q_release(Q.qk, old)
  Q.owned = Q.owned - Q.used
  Q.used = 0
end
-- After the batch: the instance's usage (int id id, n bits) enters its owner's count.
local function q_end(meta, id, n)
  local u = math.max(n, redis.call('HLEN', B .. 'e:' .. id))
  if u ~= Q.q then
    if Q.qk then
      q_blocks(Q.qk, u - Q.q)
    end
    redis.call('HSET', meta, 'q', u)
  end
end

-- Watching (KEYS.md, "Watching"): while a replica serves followers over this
-- Redis, 'wl' holds the stream's length bound (set by wstart.lua, with a
-- lease) and every change of the index is appended to the stream 'w', each
-- entry numbered by 'wn' (field 'n', one more than the entry before it) so
-- that a reader tells a lost or trimmed entry. Nobody watching: one GET.
local function watch_on()
  return redis.call('GET', B .. 'wl')
end
local function watch_pub(wl, kind, name, now, ...)
  local k = B .. 'wn'
  if redis.call('EXISTS', k) == 0 then
    -- From the server time in microseconds: a Redis restarted empty never
    -- numbers an entry as the one a reader expects next.
    local t = redis.call('TIME')
    redis.call('SET', k, t[1] .. string.format('%06d', tonumber(t[2])))
  end
  local n = redis.call('INCR', k)
  redis.call('XADD', B .. 'w', 'MAXLEN', '~', wl, '*', 'n', n, 'k', kind, 'i', name, 't', now, ...)
end

-- Apply in parts (KEYS.md, "Apply in parts"): a part's ARGV[3] is 'seq start
-- stop'; the instance field 'pp' is 'id seq position flag counts' while a long
-- batch is applied in parts. part_begin reads both: {seq, start, stop, at,
-- carry, base} with at the position Redis holds for this batch (nil: none),
-- carry whether the part's first store goes on with an orphaned event (its
-- piece before was an orphan: the whole event is, as when applied whole) and
-- base the batch's counts so far (stored, removed, orphaned, over quota),
-- whichever replica applied its parts.
local function part_begin(arg, pp, id)
  local P = {base = {0, 0, 0, 0}, carry = false}
  P.seq, P.start, P.stop = string.match(arg, '^(%d+) (%S+) (%S+)$')
  if not P.seq then
    P.seq = arg
  end
  if pp then
    local pid, pseq, ppos, pflag, pc = string.match(pp, '^(%S+) (%S+) (%S+) ?(%S*) ?(%S*)$')
    if pid == id and pseq == P.seq then
      P.at = ppos
      P.carry = pflag == 'o' and P.start ~= nil and string.match(P.start, ':0$') == nil
      local i = 1
      for c in string.gmatch(pc or '', '%d+') do
        P.base[i] = tonumber(c)
        i = i + 1
      end
    end
  end
  return P
end
-- Whether the call does not go where the batch stands: a part that does not
-- start there, or a whole batch of which parts are in (answered {'part', at}).
local function part_elsewhere(P)
  return (P.start and P.start ~= (P.at or '0:0')) or (not P.start and P.at)
end
-- The end of an apply (apply.lua, capply.lua): a part before the last records
-- where the batch stands (for the next part, with the counts so far); the last
-- part or a whole batch records the sequence and the stale flag.
local function batch_end(meta, P, id, n, nstale, lastorph, stored, removed, orphaned, over)
  if P.start and P.stop ~= 'end' then
    local b = P.base
    local counts = table.concat({b[1] + stored, b[2] + removed, b[3] + orphaned, b[4] + over}, ',')
    redis.call('HSET', meta, 'n', n, 'pp',
      id .. ' ' .. P.seq .. ' ' .. P.stop .. ' ' .. (lastorph and 'o' or '-') .. ' ' .. counts)
    return
  end
  redis.call('HSET', meta, 'seq', P.seq, 'st', nstale and 1 or 0, 'n', n)
  if P.start then
    redis.call('HDEL', meta, 'pp')
  end
end
-- An apply's entry in the change stream, while a replica watches: the batch
-- as applied ('b'), one part of a long batch ('q', with ARGV[3] as 'z'), or,
-- for a batch the quotas cut (not the batch its writer sent), 'r': readers
-- read the instance.
local function watch_batch(wl, P, over, blob)
  if over ~= 0 then
    watch_pub(wl, 'r', ARGV[5], ARGV[2])
  elseif P.start then
    watch_pub(wl, 'q', ARGV[5], ARGV[2], 'x', blob, 'z', ARGV[3])
  else
    watch_pub(wl, 'b', ARGV[5], ARGV[2], 'x', blob)
  end
end
