-- Shared prelude, prepended by indexer/redis_backend.py to every script.
-- ARGV[1] is always the key base "<prefix>:"; names follow indexer/keys.py.
local B = ARGV[1]
local FIELDS = {'id', 'w', 'r', 'm', 'a', 'ttl', 'inc', 'exp', 'seq', 'st', 'n'}
-- bits set in a tier mask 0..7
local POP = {[0] = 0, 1, 1, 2, 1, 2, 2, 3}
-- tier (1 gpu, 2 cpu, 3 disk) holding the fastest copy, for masks 1..7
local FAST = {1, 2, 1, 3, 1, 2, 1}

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
local function copy_add(id, eh, tb)
  redis.call('HINCRBY', B .. 'cp:' .. id, eh .. tb, 1)
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
local function retire(id)
  if redis.call('EXISTS', B .. 'e:' .. id) == 1 then
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
-- ARGV[p], registered if new. Returns the index after them.
local function register_namespaces(p)
  local nn = tonumber(ARGV[p])
  for j = 1, nn do
    redis.call('HSETNX', B .. 'ns', ARGV[p + 2 * j - 1], ARGV[p + 2 * j])
  end
  return p + 2 * nn + 1
end
