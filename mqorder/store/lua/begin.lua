-- begin.lua: the "check" step of a ConsumeRequest, and its first pull, in one round trip.
--
-- Claims the run for this request's token (no two ConsumeRequests of a queue run at once, in one
-- pool or across workers), verifies the lock (taking it if it is free and assigned to the caller:
-- RocketMQ's tryLockLaterAndReconsume), renews the lease and reads the first batch.
--
-- KEYS[1] state HASH  KEYS[2] log STREAM  KEYS[3] next counter  KEYS[4] retries HASH
-- ARGV[1] client id   ARGV[2] token   ARGV[3] run_lease_ms   ARGV[4] lock_lease_ms   ARGV[5] pull_n
-- ARGV[6] runner id: unique per task execution; the same execution may re-enter its own live run
--         (after a Redis outage interrupted it), a duplicate delivery of the task may not
-- Returns {'OK', epoch, offset, next, entries, retries, done} (done: the offset map a key-ordered
--         run committed with the offset, key_commit.lua; '' if none)
--      or {'STALE'} (token superseded), {'BUSY'} (this token already running),
--         {'NOT_LOCKED', owner, assignee}, {'REVOKED', assignee}
-- State HASH fields: see mqorder.keys.sub_state; lock_live, ahead: _lock.lua.
--- @include "_now"
--- @include "_lock"
local st = redis.call('HMGET', KEYS[1], 'owner', 'lease', 'epoch', 'assignee', 'offset', 'pending', 'run', 'runner',
  'done', 'node')
if st[6] ~= ARGV[2] then return {'STALE'} end
if ahead(st[7]) and st[8] ~= ARGV[6] then return {'BUSY'} end
local client = ARGV[1]
local owner, assignee = st[1] or '', st[4] or ''
local epoch = tonumber(st[3] or 0)
local lock_ttl = tonumber(ARGV[4])
if owner ~= client or not ahead(st[2]) then
  local free = not lock_live(owner, st[2])
  if free and (assignee == client or assignee == '') then
    -- A new grant, also when the lapsed lease was the caller's own (see lock_batch.lua).
    epoch = grant_epoch(KEYS[1])
    owner = client
  else
    return {'NOT_LOCKED', owner, assignee}
  end
end
if assignee ~= '' and assignee ~= client then return {'REVOKED', assignee} end
local run_until = now + tonumber(ARGV[3])
-- run_node: the node the sweep last recorded for this queue, which a sweep on another node (after
-- a failover) tells from its own (sweep.lua).
redis.call('HSET', KEYS[1], 'owner', client, 'lease', now + lock_ttl, 'run', run_until, 'pend_until', run_until,
  'runner', ARGV[6], 'run_node', st[10] or '')
local offset = tonumber(st[5] or 0)
local nxt = tonumber(redis.call('GET', KEYS[3]) or 0)
local entries = {}
local pull_n = tonumber(ARGV[5])
if pull_n > 0 and nxt > offset then
  entries = redis.call('XRANGE', KEYS[2], offset, '+', 'COUNT', pull_n)
end
local rc = {}
if redis.call('EXISTS', KEYS[4]) == 1 then rc = redis.call('HGETALL', KEYS[4]) end
return {'OK', epoch, offset, nxt, entries, rc, st[9] or ''}
