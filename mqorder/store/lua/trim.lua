-- trim.lua: one bounded chunk of retention trimming of one queue (mqorder.retention.trimmer).
--
-- Removes the oldest entries of a queue's log that its retention rule lets go, at most ARGV[5]
-- of them per call, so Redis is never busy for more than a few ms; the caller calls again while
-- the reply says more is due. Offsets keep their meaning: an entry's id is "<offset>-1" and the
-- next-offset counter is never touched, so a trimmed queue only starts at a higher offset.
-- A consumer that finds its committed offset below the first stored one moves forward in its own
-- fenced commit and counts the skip (mqorder.consumer.consume_request, ConsumeRequest._put).
--
-- Safe with any number of trimmers at once: each call decides from the state it reads in the same
-- atomic step, and trimming what another call trimmed already is a no-op.
--
-- KEYS[1] log STREAM  KEYS[2] next counter  KEYS[3] ids HASH (idempotent appends: msg id -> offset)
-- KEYS[4..] 'consumed' only: the state HASHes (mqorder.keys.sub_state) of every subscription that
--           holds the data back (live groups, groups gone for less than retention_ms, broadcast
--           clients); their committed 'offset' is read here, atomically with the trim
-- ARGV[1] policy: 'time' (older than ARGV[2] goes, consumed or not) or 'consumed' (below every
--         holder's committed offset and older than ARGV[3] goes)
-- ARGV[2] retention_ms  ARGV[3] retention_min_ms  ARGV[4] most messages kept (0: no cap)
-- ARGV[5] chunk: most entries this call removes
-- Returns {trimmed, first, next, more, quiet}: entries removed, the first stored offset after the
-- call, the queue's next offset, 1 if more is due now (call again), else 0, and `quiet`: when this
-- call trimmed nothing, how many ms from now no call can trim anything with the same arguments
-- (the head's store time plus the age it must reach, minus now; for an empty queue, that age: a
-- later append is stored at or after now), else 0. Ages only grow and store times never decrease
-- along a queue, so a caller that keeps the same arguments may skip the queue that long
-- (mqorder.retention.trimmer's idle-queue skip). A duration, not a time: the caller measures it on
-- its own monotonic clock, whatever the skew between its host and this node. With a cap
-- (ARGV[4] > 0) appends alone make trimming due, so `quiet` is 0.
-- Store times ('s' field) are Redis's clock at append, non-decreasing along a queue.

--- @include "_now"

local function offset_of(id)
  return tonumber(string.match(id, '^(%d+)'))
end

local function store_ms(entry)
  local f = entry[2]
  for i = 1, #f, 2 do
    if f[i] == 's' then return tonumber(f[i + 1]) end
  end
  return 0
end

-- The lowest offset in [lo, hi) stored at or after cutoff, or hi when all of them are older:
-- a binary search of single-entry reads (about log2(chunk) of them), never a scan.
local function first_not_older(lo, hi, cutoff)
  if hi <= lo then return lo end
  local last = redis.call('XRANGE', KEYS[1], hi - 1, '+', 'COUNT', 1)
  if #last > 0 and offset_of(last[1][1]) == hi - 1 and store_ms(last[1]) < cutoff then return hi end
  while lo < hi do
    local mid = math.floor((lo + hi) / 2)
    local e = redis.call('XRANGE', KEYS[1], mid, '+', 'COUNT', 1)
    if #e == 0 then
      hi = mid
    else
      local o = offset_of(e[1][1])
      if store_ms(e[1]) < cutoff then lo = o + 1 else hi = mid end
    end
  end
  return lo
end

local max_n = tonumber(ARGV[4])
-- The age an entry must reach before any rule lets it go.
local min_age = tonumber(ARGV[2])
if ARGV[1] == 'consumed' then min_age = tonumber(ARGV[3]) end
local function quiet_from(store)
  if max_n > 0 then return 0 end
  return math.max(0, store + min_age - now)
end

local nxt = tonumber(redis.call('GET', KEYS[2]) or 0)
local head = redis.call('XRANGE', KEYS[1], '-', '+', 'COUNT', 1)
if #head == 0 then return {0, nxt, nxt, 0, quiet_from(now)} end
local first = offset_of(head[1][1])
local chunk = tonumber(ARGV[5])
local limit = math.min(nxt, first + chunk)
local by_count = first
if max_n > 0 then by_count = math.max(first, nxt - max_n) end

local cut
if ARGV[1] == 'consumed' then
  -- Nothing a holder has not consumed goes, whatever its age or the cap.
  local held = nxt
  for k = 4, #KEYS do
    local o = tonumber(redis.call('HGET', KEYS[k], 'offset') or 0)
    if o < held then held = o end
  end
  local by_age = first_not_older(first, math.min(held, limit), now - tonumber(ARGV[3]))
  cut = math.max(by_age, math.min(by_count, held))
else
  local by_age = first_not_older(first, limit, now - tonumber(ARGV[2]))
  cut = math.max(by_age, by_count)
end
if cut > limit then cut = limit end
if cut <= first then return {0, first, nxt, 0, quiet_from(store_ms(head[1]))} end

-- Ids of idempotent appends (Spark writes, DLQ replays) go with their entries, or the ids HASH
-- would grow for ever.
if redis.call('EXISTS', KEYS[3]) == 1 then
  local gone = redis.call('XRANGE', KEYS[1], first, cut - 1)
  for _, e in ipairs(gone) do
    local f = e[2]
    for i = 1, #f, 2 do
      if f[i] == 'h' then
        local ok, h = pcall(cjson.decode, f[i + 1])
        if ok and type(h) == 'table' and h['i'] then
          local stored = redis.call('HGET', KEYS[3], tostring(h['i']))
          -- Only this entry's own record: an id stored again later points at a later offset.
          if stored and tonumber(stored) < cut then redis.call('HDEL', KEYS[3], tostring(h['i'])) end
        end
      end
    end
  end
end

local trimmed = redis.call('XTRIM', KEYS[1], 'MINID', tostring(cut))
local more = 0
if cut == limit and limit < nxt then more = 1 end
return {trimmed, cut, nxt, more, 0}
