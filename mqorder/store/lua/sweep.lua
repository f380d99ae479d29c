-- sweep.lua: re-dispatch owned queues that have a backlog and no live ConsumeRequest (a task lost
-- from the Celery broker, a pool process killed mid-run): invariant 5, "no stall".
--
-- KEYS        pairs (state HASH, next counter), one pair per queue
-- ARGV[1]     client ('' = any owner)   ARGV[2] pending_ttl_ms   ARGV[3..] one token per queue
-- Returns     flat list of (queue index (1-based), owner, token) for each queue to dispatch
-- State HASH fields: see mqorder.keys.sub_state; lock_live, ahead, request_pending: _lock.lua.
--- @include "_now"
--- @include "_lock"
--
-- Only a queue with a backlog (next > offset) can need a request, so that is tested first, with
-- the two cheapest reads there are (a GET and a one-field HGET); the lock and request fields are
-- read only for a queue that has one. An idle deployment's queues have none: its sweep then costs
-- two plain reads per owned queue, not a six-field HMGET turned into a Lua table and judged
-- (about 2.5x less Redis time per idle queue, issue 27). Every read is in this one script, so the
-- order of the tests changes nothing in what it decides.
local out = {}
for i = 1, #KEYS, 2 do
  local q = (i + 1) / 2
  local nxt = tonumber(redis.call('GET', KEYS[i + 1]) or 0)
  if nxt > tonumber(redis.call('HGET', KEYS[i], 'offset') or 0) then
    local st = redis.call('HMGET', KEYS[i], 'owner', 'lease', 'pending', 'pend_until', 'run')
    local owner = st[1] or ''
    if lock_live(owner, st[2]) and (ARGV[1] == '' or owner == ARGV[1])
        and not ahead(st[5]) and not request_pending(st[3], st[4]) then
      if tonumber(st[5] or 0) > 0 then
        -- The previous run's lease lapsed mid-run: fence it with a new epoch (same owner).
        grant_epoch(KEYS[i])
      end
      redis.call('HSET', KEYS[i], 'pending', ARGV[2 + q], 'pend_until', now + tonumber(ARGV[2]), 'run', 0)
      out[#out + 1] = q
      out[#out + 1] = owner
      out[#out + 1] = ARGV[2 + q]
    end
  end
end
return out
