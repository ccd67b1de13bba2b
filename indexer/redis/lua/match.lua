-- Match: walk the prefix, stop at the first block no candidate holds.
-- ARGV: base, generation key, block name prefix of the first A blocks, block
-- name prefix of the others, A, keys packed as 8-byte big-endian words, then
-- the int ids to exclude (expired, stale, retired). Standalone: both prefixes
-- are base .. 'b:' .. ns id and A = 0; cluster: see KEYS.md (shallow copies on
-- this node, deep blocks under the anchor's tag).
-- Standalone only: ARGV[7] may be '=' .. the generation the caller's instance
-- table was read at (int ids are digits, so it is never an id); when the
-- stored generation differs the script returns {gen} at once, walking
-- nothing: the caller's exclusions are outdated, it refreshes and asks again.
-- Cluster (KEYS.md, "Match: one EVALSHA on one master"): ARGV[2] is the copy
-- tags, space separated, the caller's guess of this node's first; the script
-- uses the first one this node serves (a tag of another node fails the probe)
-- for the shallow copies, the generation copy and the unplaced copies, and
-- returns {0} when it serves none. ARGV[3] is the ns id. A block a candidate
-- does not hold where its chain position puts it is looked up among this
-- node's unplaced copies too, when the namespace has any.
-- Returns {gen, holders of block 0 as HGETALL gives them (id, mask, ...), then
-- id, gpu, cpu, disk of each candidate holding at least blocks 0 and 1}.
-- Holders of block 0 that are neither excluded nor listed after it matched
-- exactly one block: the caller derives those from the raw list, which is far
-- cheaper than emitting them one by one here (most of a Match's cost on a
-- shared first block).
local sp, dp, na = ARGV[3], ARGV[4], tonumber(ARGV[5])
local blob = ARGV[6]
local n = #blob / 8
local gen
local up = nil -- cluster: name prefix of this node's unplaced copies, when it has any
if CLUSTER then
  local pb = string.sub(B, 2, -3) .. ':' -- block names use the plain prefix
  for t in string.gmatch(ARGV[2], '%S+') do
    local g = redis.pcall('GET', pb .. 'g:{' .. t .. '}')
    if type(g) ~= 'table' then -- not an error: this node serves t
      gen = g or ''
      sp = pb .. 'b:{' .. t .. '}' .. ARGV[3]
      if redis.call('HGET', pb .. 'c:{' .. t .. '}', 'U' .. ARGV[3]) then
        up = pb .. 'b:{' .. t .. '}u' .. ARGV[3]
      end
      break
    end
  end
  if not gen then
    return {0}
  end
else
  gen = redis.call('GET', ARGV[2]) or ''
end
local x0 = 7 -- first excluded id
if ARGV[7] and string.byte(ARGV[7]) == 61 then -- '='
  if ARGV[7] ~= '=' .. gen then
    return {gen}
  end
  x0 = 8
end
if n == 0 then
  return {gen, {}}
end
local first = redis.call('HGETALL', (na > 0 and sp or dp) .. string.sub(blob, 1, 8))
-- Cluster: holders of the unplaced copies, for the candidates missing at the
-- block's place (vals[j] false): filled in place.
local function unplaced(vals, key, ids, m)
  local miss, at = {}, {}
  for j = 1, m do
    if not vals[j] then
      miss[#miss + 1] = ids[j]
      at[#at + 1] = j
    end
  end
  if #miss == 0 then
    return
  end
  local got
  if #miss <= 256 then
    got = redis.call('HMGET', up .. key, unpack(miss))
  else
    local all, map = redis.call('HGETALL', up .. key), {}
    for j = 1, #all, 2 do
      map[all[j]] = all[j + 1]
    end
    got = {}
    for x = 1, #miss do
      got[x] = map[miss[x]] or false
    end
  end
  for x = 1, #miss do
    if got[x] then
      vals[at[x]] = got[x]
    end
  end
end
if up then
  local extra = redis.call('HGETALL', up .. string.sub(blob, 1, 8))
  if #extra > 0 then
    local seen = {}
    for j = 1, #first, 2 do
      seen[first[j]] = true
    end
    for j = 1, #extra, 2 do
      if not seen[extra[j]] then
        first[#first + 1] = extra[j]
        first[#first + 1] = extra[j + 1]
      end
    end
  end
end
local out = {gen, first}
if #first == 0 or n == 1 then
  return out
end
local ex = {}
for i = x0, #ARGV do
  ex[ARGV[i]] = true
end
-- Candidates: holders of block 0 not excluded, with their tier mask there.
local ids, masks, m = {}, {}, 0
for j = 1, #first, 2 do
  local id = first[j]
  if not ex[id] then
    m = m + 1
    ids[m] = id
    masks[m] = first[j + 1]
  end
end
local function emit(id, c)
  out[#out + 1] = id
  out[#out + 1] = c[1]
  out[#out + 1] = c[2]
  out[#out + 1] = c[3]
end
-- Block 1 splits the candidates; only those going deeper get counters.
-- Most holders of a shared first block stop here, so with many candidates
-- one HGETALL of block 1 (usually small) beats an HMGET naming them all.
local cnt, k = {}, 0
if m > 0 then
  local bk = (na > 1 and sp or dp) .. string.sub(blob, 9, 16)
  local vals = {}
  if m > 8 then
    local all = redis.call('HGETALL', bk)
    local map = {}
    for j = 1, #all, 2 do
      map[all[j]] = all[j + 1]
    end
    for j = 1, m do
      vals[j] = map[ids[j]] or false
    end
  else
    vals = redis.call('HMGET', bk, unpack(ids, 1, m))
  end
  if up then
    unplaced(vals, string.sub(blob, 9, 16), ids, m)
  end
  local nids = {}
  for j = 1, m do
    local v = vals[j]
    if v then
      k = k + 1
      nids[k] = ids[j]
      local c = {0, 0, 0}
      local f0 = FASTS[masks[j]]
      c[f0] = 1
      local f1 = FASTS[v]
      c[f1] = c[f1] + 1
      cnt[k] = c
    end
  end
  ids, m = nids, k
end
local i = 3
while m > 0 and i <= n do
  if m == 1 then
    -- One candidate left (a conversation's own blocks, most of a long
    -- prompt): an HGET of its id per block, no tables made per block.
    local id, c = ids[1], cnt[1]
    while i <= n do
      local key = string.sub(blob, 8 * i - 7, 8 * i)
      local v = redis.call('HGET', (i <= na and sp or dp) .. key, id)
      if not v and up then
        v = redis.call('HGET', up .. key, id)
      end
      if not v then
        break
      end
      local f = FASTS[v]
      c[f] = c[f] + 1
      i = i + 1
    end
    emit(id, c)
    return out
  end
  local bk = (i <= na and sp or dp) .. string.sub(blob, 8 * i - 7, 8 * i)
  local vals
  if m <= 8 then
    vals = redis.call('HMGET', bk, unpack(ids, 1, m))
  else
    -- More candidates: one HGETALL beats an HMGET naming them all (a field
    -- named is a walk of the listpack: 64 named in a block of 64 holders
    -- took 25 us in one run, its HGETALL 6-9).
    local all, map = redis.call('HGETALL', bk), {}
    for j = 1, #all, 2 do
      map[all[j]] = all[j + 1]
    end
    vals = {}
    for j = 1, m do
      vals[j] = map[ids[j]] or false
    end
  end
  if up then
    unplaced(vals, string.sub(blob, 8 * i - 7, 8 * i), ids, m)
  end
  -- The candidates holding the block move up in place (the first m of ids
  -- and cnt count; no table made a block but the reply's).
  local k2 = 0
  for j = 1, m do
    local v = vals[j]
    local c = cnt[j]
    if v then
      k2 = k2 + 1
      ids[k2] = ids[j]
      local f = FASTS[v]
      c[f] = c[f] + 1
      cnt[k2] = c
    else
      emit(ids[j], c)
    end
  end
  m = k2
  i = i + 1
end
for j = 1, m do
  emit(ids[j], cnt[j])
end
return out
