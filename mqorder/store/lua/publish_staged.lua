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
-- ARGV[5]        1: the ids were generated from the rows' content (no idColumn): number identical
--                rows over the whole queue (below); 0: the caller's ids, kept as they are
-- ARGV[6..5+K]   the runs' names (fields of the cursor)
-- ARGV[6+K..]    per state key: token, wake payload
-- Returns        {rows stored, rows skipped as already stored, rows still staged, first offset,
--                 woken owner...}
--
-- Each run is sorted by its sort key (order-preserving bytes of the orderBy value, then the msg
-- id), so K runs merge into one ordered sequence by comparing the keys byte by byte. The merged
-- rows go through the one append path (append_entries, idempotent by msg id, then wake_owners),
-- and the published rows leave their runs (and the cursor moves) in the same atomic step: a commit
-- interrupted between two calls resumes where it stopped, and rows it had stored are skipped by id.
--
-- Identical rows (same key, orderBy value and body) get the same generated id; a task tells its
-- own apart by count ("<id>", "<id>.1", "<id>.2"...), but two tasks of a plain df.write may each
-- hold one, and the second was skipped as a duplicate of the first. With ARGV[5] = 1 the merge
-- numbers them again over the queue's merged sequence, where they sort next to each other: the
-- n-th row of a group of identical rows gets "<id>" then "<id>.1"..., whatever the partitioning,
-- so a re-run of the job (any partitioning) gets the same ids and stores nothing twice. The group
-- open at the end of a call (its id and count) is kept in the cursor for the next call.
--- @include "_append"
local k = tonumber(ARGV[1])
local chunk = tonumber(ARGV[2])
local renumber = ARGV[5] == '1'

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
-- The group of identical rows last emitted (ARGV[5]): its id without a count, and its size so far.
local group_id, group_n
if renumber then
  local saved = redis.call('HMGET', KEYS[4], '~group', '~n')
  group_id, group_n = saved[1], tonumber(saved[2] or 0)
end
-- A generated id ends in 32 hex digits (a stream's prefix before them may hold dots and digits),
-- then a task's count of its twins if any: ".<n>".
local counted = '^(.*' .. string.rep('%x', 32) .. ')%.%d+$'
local function numbered(id, header)
  local base = string.match(id, counted) or id
  if base == group_id then group_n = group_n + 1 else group_id, group_n = base, 0 end
  local new = group_n == 0 and base or (base .. '.' .. group_n)
  if new == id then return id, header end
  local head = '{"i":"' .. id .. '"'
  if string.sub(header, 1, #head) ~= head then return id, header end -- not the writer's shape: as is
  return new, '{"i":"' .. new .. '"' .. string.sub(header, #head + 1)
end
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
  if renumber then
    rows[3 * m + 1], rows[3 * m + 2] = numbered(h[i + 1], h[i + 2])
  else
    rows[3 * m + 1], rows[3 * m + 2] = h[i + 1], h[i + 2]
  end
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
    redis.call('HINCRBY', KEYS[4], ARGV[5 + r], used)
  end
  remaining = remaining + redis.call('LLEN', KEYS[4 + r]) / 4
end
if remaining == 0 then
  for r = 1, k do redis.call('DEL', KEYS[4 + r]) end
  redis.call('DEL', KEYS[4])
else
  if renumber and group_id then redis.call('HSET', KEYS[4], '~group', group_id, '~n', group_n) end
  -- The cursor lives as long as the runs it describes (a commit that dies leaves nothing for good).
  local ttl = 0
  for r = 1, k do ttl = math.max(ttl, redis.call('PTTL', KEYS[4 + r])) end
  if ttl > 0 then redis.call('PEXPIRE', KEYS[4], ttl) end
end

local out = {stored, m - stored, remaining, first}
if stored > 0 then
  for _, owner in ipairs(wake_owners(5 + k, tonumber(ARGV[3]), ARGV[4], 5 + k)) do
    out[#out + 1] = owner
  end
end
return out
