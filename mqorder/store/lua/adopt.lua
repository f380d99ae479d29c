-- adopt.lua: a lingering ConsumeRequest takes the pending slot of one more *idle* queue of its
-- client, so that the producer's next message there wakes nobody: it rings the request's doorbell
-- (ring_doorbell in _append.lua, for a token marked '!'), and the request runs the queue itself
-- (through begin.lua, with this token), instead of a pub/sub wake-up and a new Celery task waiting
-- for a pool slot.
--
-- Only a queue that nothing is happening on is taken: locked by the caller (live lease), assigned
-- to it (or not assigned yet), no run, no live pending request, and nothing unconsumed (a queue
-- with a backlog already has, or is about to get, its own request). The adoption is an ordinary
-- pending request with a short pend_until: if the adopting process dies, it lapses and the send
-- path or the sweep dispatch the queue as for any lost request. Ending the adoption is finish.lua
-- with the same token (idle: cleared; a backlog: a new request, dispatched by the caller).
--
-- KEYS[1] state HASH  KEYS[2] next counter
-- ARGV[1] client  ARGV[2] token  ARGV[3] ttl_ms (pend_until = now + ttl)
-- Returns {1, offset, next} (adopted, or already adopted with this token: pend_until renewed;
-- next past offset: a renewed adoption has a backlog, whose doorbell the caller may have missed)
-- or {0}.
-- State HASH fields: see mqorder.keys.sub_state; lock_live, ahead, request_pending: _lock.lua.
--- @include "_now"
--- @include "_lock"
local st = redis.call('HMGET', KEYS[1], 'owner', 'lease', 'assignee', 'run', 'pending', 'pend_until', 'offset')
local client = ARGV[1]
if st[1] ~= client or not ahead(st[2]) then return {0} end
local assignee = st[3] or ''
if assignee ~= '' and assignee ~= client then return {0} end
if ahead(st[4]) then return {0} end
local mine = st[5] == ARGV[2]
if not mine and request_pending(st[5], st[6]) then return {0} end
local offset = tonumber(st[7] or 0)
local nxt = tonumber(redis.call('GET', KEYS[2]) or 0)
if not mine and nxt > offset then return {0} end
redis.call('HSET', KEYS[1], 'pending', ARGV[2], 'pend_until', now + tonumber(ARGV[3]))
return {1, offset, nxt}
