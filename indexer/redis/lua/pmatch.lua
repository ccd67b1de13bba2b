-- Predicted depths of a Match with include_predicted (KEYS.md,
-- "Predictions"), after the Match itself. Cluster: on the control slot
-- (KEYS: its generation, for routing), where 'pr:' lives and 'k:<id>' says
-- what an id holds.
-- ARGV: base, ns id, now, keys packed as 8-byte big-endian words (may be
--   empty), np, then np int ids whose pending predictions to count, then
--   pairs (int id, confirmed depth) of the Match's hits.
-- Returns m (-1: not counted, the user may not ZCOUNT), then m pairs (int id,
-- its predictions still pending: 'P:pq:<id>' scored after now, or, for an id
-- whose predictions an older writer recorded without 'pq:', 'P:po:<id>'
-- unexpired; ids with none left out), then pairs (int id, predicted depth): each hit's, then every holder
-- of a live prediction of block 0 that is not a hit (its confirmed depth 0).
-- Each walks on from its confirmed depth while a block is predicted for it
-- (an unexpired expiry) or held: O(candidates + predicted blocks). Only
-- commands of the indexer's least ACL rights (indexer/redis/connection.py).
local nid, now, blob = ARGV[2], tonumber(ARGV[3]), ARGV[4]
local bpre, ppre = B .. 'b:' .. nid, B .. 'pr:' .. nid
local n = #blob / 8
local sub = string.sub
-- Whether id holds block k (cluster: its authoritative entries, 'k:<id>').
local function held(id, k)
  if CLUSTER then
    return redis.call('HGET', B .. 'k:' .. id, nid .. k)
  end
  return redis.call('HGET', bpre .. k, id)
end
local function walk(id, d)
  local from = d
  while d < n do
    local k = sub(blob, 8 * d + 1, 8 * d + 8)
    local e = redis.call('HGET', ppre .. k, id)
    if not (e and tonumber(e) > now) then
      if d == from or not held(id, k) then
        break
      end
    end
    d = d + 1
  end
  return d
end
-- The pending prefill (MatchResponse.pending): a store confirms a prediction
-- (apply.lua, capply.lua), so what is left unexpired is unconfirmed. pcall: a
-- user of an older ACL rule without +zcount gets the Match without it.
local np = tonumber(ARGV[5])
local pend = {}
for i = 6, 5 + np do
  local q = B .. 'pq:' .. ARGV[i]
  local c = redis.pcall('ZCOUNT', q, '(' .. ARGV[3], '+inf')
  if c == 0 and redis.call('EXISTS', q) == 0 then
    c = redis.pcall('ZCOUNT', B .. 'po:' .. ARGV[i], '(' .. ARGV[3], '+inf')
  end
  if type(c) ~= 'number' then
    pend = nil
    break
  end
  if c > 0 then
    pend[#pend + 1] = ARGV[i]
    pend[#pend + 1] = c
  end
end
local out, seen = {pend and #pend / 2 or -1}, {}
if pend then
  for _, v in ipairs(pend) do
    out[#out + 1] = v
  end
end
for i = 6 + np, #ARGV, 2 do
  local id = ARGV[i]
  seen[id] = true
  out[#out + 1] = id
  out[#out + 1] = walk(id, tonumber(ARGV[i + 1]))
end
if n > 0 then
  local first = redis.call('HGETALL', ppre .. sub(blob, 1, 8))
  for j = 1, #first, 2 do
    local id = first[j]
    if not seen[id] and tonumber(first[j + 1]) > now then
      out[#out + 1] = id
      out[#out + 1] = walk(id, 0)
    end
  end
end
return out
