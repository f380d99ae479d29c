-- publish_staged.lua: move the staged runs of one queue of a committed Spark job into the queue's
-- log, in order, up to a chunk per call (a long job never blocks Redis for long). The caller
-- repeats until nothing remains; a repeated call after a crash is harmless (see below).
--
-- KEYS[1]        queue log (STREAM), entry ids "<offset>-1"
-- KEYS[2]        queue next-offset counter (STRING)
-- KEYS[3]        queue ids (HASH msg id -> offset)
-- KEYS[4]        the job's cursor on this queue (HASH run -> rows published, see stage.lua)
-- KEYS[5..4+K]   the K runs of this queue staged by the job's tasks (LISTs, stage.lua)
-- KEYS[5+K..]    state HASH of each subscription of the topic on this queue
-- ARGV[1]        K
-- ARGV[2]        at most this many rows per call
-- ARGV[3]        pending_ttl_ms, ARGV[4] wake channel prefix
-- ARGV[5..4+K]   the runs' names (fields of the cursor)
-- ARGV[5+K..]    per state key: token, wake payload
-- Returns        {rows stored, rows skipped as already stored, rows still staged, first offset,
--                 woken owner...}
--
-- Each run is sorted by its sort key (order-preserving bytes of the orderBy value, then the msg
-- id), so K runs merge into one ordered sequence by comparing the keys byte by byte. The merged
-- rows go through the one append path (append_entries, idempotent by msg id, then wake_owners),
-- and the published rows leave their runs (and the cursor moves) in the same atomic step: a commit
-- interrupted between two calls resumes where it stopped, and rows it had stored are skipped by id.
--- @include "_append"
local k = tonumber(ARGV[1])
local chunk = tonumber(ARGV[2])

-- Byte order, not Lua's '<' (which follows the server's collation locale). Eight bytes per
-- string.byte call: an orderBy value is eight bytes for numbers and times.
local byte = string.byte
local function bytes_lt(a, b)
  if a == b then return false end
  local n = math.min(#a, #b)
  local i = 1
  while i + 7 <= n do
    local a1, a2, a3, a4, a5, a6, a7, a8 = byte(a, i, i + 7)
    local b1, b2, b3, b4, b5, b6, b7, b8 = byte(b, i, i + 7)
    if a1 ~= b1 then return a1 < b1 end
    if a2 ~= b2 then return a2 < b2 end
    if a3 ~= b3 then return a3 < b3 end
    if a4 ~= b4 then return a4 < b4 end
    if a5 ~= b5 then return a5 < b5 end
    if a6 ~= b6 then return a6 < b6 end
    if a7 ~= b7 then return a7 < b7 end
    if a8 ~= b8 then return a8 < b8 end
    i = i + 8
  end
  while i <= n do
    local x, y = byte(a, i), byte(b, i)
    if x ~= y then return x < y end
    i = i + 1
  end
  return #a < #b
end

local heads, at, more = {}, {}, {}
for r = 1, k do
  heads[r] = redis.call('LRANGE', KEYS[4 + r], 0, 4 * chunk - 1)
  at[r] = 1  -- index of the current row's first item
  more[r] = #heads[r] == 4 * chunk
end

-- The merged rows, as the (id, header, body) triples append_entries reads.
local rows = {}
local m = 0
while m < chunk do
  local best = nil
  local blocked = false
  for r = 1, k do
    local sk = heads[r][at[r]]
    if sk then
      if best == nil or bytes_lt(sk, heads[best][at[best]]) then best = r end
    elseif more[r] then
      blocked = true -- this run has unread rows that may sort first: merge no further this call
    end
  end
  if best == nil or blocked then break end
  local h, i = heads[best], at[best]
  rows[3 * m + 1] = h[i + 1]
  rows[3 * m + 2] = h[i + 2]
  rows[3 * m + 3] = h[i + 3]
  at[best] = i + 4
  m = m + 1
end

local first, stored, dups = append_entries(KEYS[1], KEYS[2], KEYS[3], m, true, 0, rows)

local remaining = 0
for r = 1, k do
  local used = (at[r] - 1) / 4
  if used > 0 then
    redis.call('LTRIM', KEYS[4 + r], 4 * used, -1)
    redis.call('HINCRBY', KEYS[4], ARGV[4 + r], used)
  end
  remaining = remaining + redis.call('LLEN', KEYS[4 + r]) / 4
end
if remaining == 0 then
  for r = 1, k do redis.call('DEL', KEYS[4 + r]) end
  redis.call('DEL', KEYS[4])
else
  -- The cursor lives as long as the runs it describes (a commit that dies leaves nothing for good).
  local ttl = 0
  for r = 1, k do ttl = math.max(ttl, redis.call('PTTL', KEYS[4 + r])) end
  if ttl > 0 then redis.call('PEXPIRE', KEYS[4], ttl) end
end

local out = {stored, m - stored, remaining, first}
if stored > 0 then
  for _, owner in ipairs(wake_owners(5 + k, tonumber(ARGV[3]), ARGV[4], 4 + k)) do
    out[#out + 1] = owner
  end
end
return out
