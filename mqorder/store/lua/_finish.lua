-- Prelude: the body of finish.lua (see there for its KEYS, ARGV and reply) as a function of its
-- keys and arguments, so that switch.lua can end a run in the same step that begins another one.
--- @include "_constants"
--- @include "_now"
--- @include "_lock"
-- finished_already(K, A, st): the reply to a finish.lua sent again after its reply was lost (a Redis
-- error after the script ran: the caller cannot tell, so it sends the same call, with the same new
-- token). The pending token is the one this call sets (or, action 'adopt', the watch's): the first
-- call ran, and the request it asked for, which only its caller sends, is still owed. The same
-- answer again: 'ADOPTED', or the request for the new token to whoever consumes the queue now
-- ('REQUEUE' to the caller; 'DISPATCH' otherwise: a first 'HANDOVER' moved the lock already).
-- Nil: not a repeat (STALE). Without it the retry read STALE and dropped the request: the queue,
-- backlog and all, waited out pending_ttl_ms and a sweep.
local function finished_already(K, A, st)
  if A[3] == 'adopt' and (A[7] or '') ~= '' and st[3] == A[7] then
    return {'ADOPTED', tonumber(st[4] or 0), tonumber(redis.call('GET', K[2]) or 0)}
  end
  if (A[4] or '') == '' or st[3] ~= A[4] then return nil end
  local target = st[5] or ''
  if lock_live(st[1], st[2]) then target = st[1] end
  if target == '' or target == NOBODY then
    redis.call('HSET', K[1], 'pending', '', 'pend_until', 0)
    return {'IDLE'}
  end
  -- The request is sent only now: its pend_until counts from now (a retry after a long outage
  -- found it lapsed, and the sweep dispatched a second request beside it).
  local pend_until = math.max(tonumber(st[6] or 0), now + tonumber(A[5]))
  redis.call('HSET', K[1], 'pend_until', pend_until)
  if target == A[1] then return {'REQUEUE', target, A[4]} end
  return {'DISPATCH', target, A[4]}
end

local function finish_run(K, A)
  local st = redis.call('HMGET', K[1], 'owner', 'lease', 'pending', 'offset', 'assignee', 'pend_until')
  if st[3] ~= A[2] then return finished_already(K, A, st) or {'STALE'} end
  local client = A[1]
  local owner, assignee = st[1] or '', st[5] or ''
  local ttl = tonumber(A[5])
  local nxt = tonumber(redis.call('GET', K[2]) or 0)
  local backlog = nxt > tonumber(st[4] or 0)
  local function pend(target, verb)
    redis.call('HSET', K[1], 'run', 0, 'pending', A[4], 'pend_until', now + ttl)
    return {verb, target, A[4]}
  end
  local function idle()
    redis.call('HSET', K[1], 'run', 0, 'pending', '', 'pend_until', 0)
    return {'IDLE'}
  end
  if owner == client and ahead(st[2]) then
    if assignee == NOBODY then
      -- No client consumes this lane any more (the last worker left): release the lock, and the
      -- pending token, which is this very run's.
      release_lock(K[1], false)
      return {'IDLE'}
    end
    if assignee ~= '' and assignee ~= client then
      -- removeUnnecessaryMessageQueue: consumption has stopped, so the lock may move now.
      redis.call('HSET', K[1], 'owner', assignee, 'lease', now + tonumber(A[6]))
      grant_epoch(K[1])
      if backlog then return pend(assignee, 'HANDOVER') end
      return idle()
    end
    if A[3] == 'adopt' then
      -- Handed to the watch with its next offset: a message stored while the run still held the
      -- queue rang no doorbell (ring_doorbell skips a running queue), so the caller learns of it here.
      redis.call('HSET', K[1], 'run', 0, 'pending', A[7], 'pend_until', now + tonumber(A[8]))
      return {'ADOPTED', tonumber(st[4] or 0), nxt}
    end
    if A[3] == 'requeue' or backlog then return pend(client, 'REQUEUE') end
    return idle()
  end
  -- The caller does not hold a live lock.
  if lock_live(owner, st[2]) then
    if backlog then return pend(owner, 'DISPATCH') end
    return idle()
  end
  if assignee ~= '' and assignee ~= NOBODY and backlog then return pend(assignee, 'DISPATCH') end
  return idle()
end
