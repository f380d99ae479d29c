-- finish.lua: the end of a ConsumeRequest run: clear its run mark and decide, atomically with
-- the producer's send script, who consumes this queue next. This is what keeps "at most one
-- pending ConsumeRequest per queue" and "a queue with a backlog and an owner always gets one".
--
-- KEYS[1] state HASH  KEYS[2] next counter
-- ARGV[1] client  ARGV[2] token  ARGV[3] action ('done' | 'requeue' | 'adopt')  ARGV[4] new token
-- ARGV[5] pending_ttl_ms (already including any countdown)  ARGV[6] lock_lease_ms
-- ARGV[7] adopt token, ARGV[8] adopt ttl_ms: action 'adopt' only (see below)
-- An assignee of NOBODY means "assigned to nobody" (no live client consumes the lane).
-- State HASH fields: see mqorder.keys.sub_state; lock_live, release_lock: _lock.lua.
-- Returns {'IDLE'}, {'STALE'}, {'ADOPTED', offset}, or {verb, target client, token} with verb one of
--   'REQUEUE' (to the caller), 'HANDOVER' (lock moved to the assignee), 'DISPATCH' (to the owner)
--
-- Action 'adopt': the run ends because its lingering read found messages on another queue its
-- IdleQueueWatch adopted (mqorder.consumer.idle_watch), which the same task runs next. While the
-- caller still holds the live lock and the queue is still its own (assignee: the caller or nobody
-- yet), the pending slot passes to the watch (pending = ARGV[7], pend_until = now + ARGV[8]) in
-- this same step, as adopt.lua would set it, backlog or not: the watch's blocking read covers it
-- from its committed offset at once, so a send arriving now wakes nobody and needs no new Celery
-- task (ended as 'done' then adopted in a second call, a send in between took the wake-up path).
-- Otherwise it ends as 'done'.
--- @include "_constants"
--- @include "_now"
--- @include "_lock"
local st = redis.call('HMGET', KEYS[1], 'owner', 'lease', 'pending', 'offset', 'assignee')
if st[3] ~= ARGV[2] then return {'STALE'} end
local client = ARGV[1]
local owner, assignee = st[1] or '', st[5] or ''
local ttl = tonumber(ARGV[5])
local nxt = tonumber(redis.call('GET', KEYS[2]) or 0)
local backlog = nxt > tonumber(st[4] or 0)
local function pend(target, verb)
  redis.call('HSET', KEYS[1], 'run', 0, 'pending', ARGV[4], 'pend_until', now + ttl)
  return {verb, target, ARGV[4]}
end
local function idle()
  redis.call('HSET', KEYS[1], 'run', 0, 'pending', '', 'pend_until', 0)
  return {'IDLE'}
end
if owner == client and ahead(st[2]) then
  if assignee == NOBODY then
    -- No client consumes this lane any more (the last worker left): release the lock, and the
    -- pending token, which is this very run's.
    release_lock(KEYS[1], false)
    return {'IDLE'}
  end
  if assignee ~= '' and assignee ~= client then
    -- removeUnnecessaryMessageQueue: consumption has stopped, so the lock may move now.
    redis.call('HSET', KEYS[1], 'owner', assignee, 'lease', now + tonumber(ARGV[6]))
    grant_epoch(KEYS[1])
    if backlog then return pend(assignee, 'HANDOVER') end
    return idle()
  end
  if ARGV[3] == 'adopt' then
    redis.call('HSET', KEYS[1], 'run', 0, 'pending', ARGV[7], 'pend_until', now + tonumber(ARGV[8]))
    return {'ADOPTED', tonumber(st[4] or 0)}
  end
  if ARGV[3] == 'requeue' or backlog then return pend(client, 'REQUEUE') end
  return idle()
end
-- The caller does not hold a live lock.
if lock_live(owner, st[2]) then
  if backlog then return pend(owner, 'DISPATCH') end
  return idle()
end
if assignee ~= '' and assignee ~= NOBODY and backlog then return pend(assignee, 'DISPATCH') end
return idle()
