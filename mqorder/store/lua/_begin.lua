-- Prelude: the body of begin.lua (see there for its KEYS, ARGV and reply) as a function of its keys
-- and arguments, so that switch.lua can begin a run in the same step that ends another one.
--- @include "_now"
--- @include "_lock"
local function begin_run(K, A)
  local st = redis.call('HMGET', K[1], 'owner', 'lease', 'epoch', 'assignee', 'offset', 'pending', 'run', 'runner',
    'done', 'node', 'held')
  if st[6] ~= A[2] then return {'STALE'} end
  if ahead(st[7]) and st[8] ~= A[6] then return {'BUSY'} end
  local client = A[1]
  local owner, assignee = st[1] or '', st[4] or ''
  local epoch = tonumber(st[3] or 0)
  local lock_ttl = tonumber(A[4])
  if owner ~= client or not ahead(st[2]) then
    local free = not lock_live(owner, st[2])
    if free and (assignee == client or assignee == '') then
      -- A new grant, also when the lapsed lease was the caller's own (see lock_batch.lua).
      epoch = grant_epoch(K[1])
      owner = client
    else
      return {'NOT_LOCKED', owner, assignee}
    end
  end
  if assignee ~= '' and assignee ~= client then return {'REVOKED', assignee} end
  local run_until = now + tonumber(A[3])
  -- run_node: the node the sweep last recorded for this queue, which a sweep on another node (after
  -- a failover) tells from its own (sweep.lua).
  redis.call('HSET', K[1], 'owner', client, 'lease', now + lock_ttl, 'run', run_until, 'pend_until', run_until,
    'runner', A[6], 'run_node', st[10] or '')
  local offset = tonumber(st[5] or 0)
  local nxt = tonumber(redis.call('GET', K[3]) or 0)
  local entries = {}
  local pull_n = tonumber(A[5])
  if pull_n > 0 and nxt > offset then
    entries = redis.call('XRANGE', K[2], offset, '+', 'COUNT', pull_n)
  end
  local rc = {}
  if redis.call('EXISTS', K[4]) == 1 then rc = redis.call('HGETALL', K[4]) end
  return {'OK', epoch, offset, nxt, entries, rc, st[9] or '', st[11] or ''}
end
