-- assign.lua: apply one rebalance result to the lock table of one broker, atomically per queue.
--
-- Records the assignee; moves the lock to it at once when the current owner is gone (lease out,
-- or heartbeat lapsed: fencing makes that safe) or idle; leaves a running owner alone, which then
-- hands the queue over itself when its run ends (finish.lua). A moved queue with a backlog gets a
-- pending token so the caller dispatches a ConsumeRequest to the new owner.
--
-- KEYS     pairs (state HASH, next counter), one pair per queue
-- ARGV[1]  lock_lease_ms  ARGV[2] pending_ttl_ms  ARGV[3] number d of dead clients
-- ARGV[4 .. 3+d]  dead client ids, then per queue: assignee (NOBODY = no live client), token
-- Returns  per queue: 'KEPT', 'BUSY', 'UNASSIGNED', 'MOVED' or 'DISPATCH'
-- State HASH fields: see mqorder.keys.sub_state; lock_live, ahead, release_lock: _lock.lua.
--- @include "_constants"
--- @include "_now"
--- @include "_lock"
local d = tonumber(ARGV[3])
local dead = {}
for i = 1, d do dead[ARGV[3 + i]] = true end
local base = 3 + d
local out = {}
for i = 1, #KEYS, 2 do
  local q = (i + 1) / 2
  local new = ARGV[base + 2 * q - 1]
  local token = ARGV[base + 2 * q]
  local st = redis.call('HMGET', KEYS[i], 'owner', 'lease', 'run', 'offset', 'pending', 'pend_until')
  local owner = st[1] or ''
  local live = lock_live(owner, st[2]) and not dead[owner]
  redis.call('HSET', KEYS[i], 'assignee', new)
  if new == NOBODY then
    -- Nobody consumes this lane: release the lock now unless a live owner is mid-run (that run
    -- sees the revocation at its next commit and releases the lock itself). The lane is retired,
    -- so a request still pending for it is dropped with the lock.
    if owner ~= '' and ((not live) or not ahead(st[3])) then
      release_lock(KEYS[i], false)
    end
    out[q] = 'UNASSIGNED'
  elseif owner == new and live then
    out[q] = 'KEPT'
  elseif live and ahead(st[3]) then
    out[q] = 'BUSY'
  else
    grant_epoch(KEYS[i])
    redis.call('HSET', KEYS[i], 'owner', new, 'lease', now + tonumber(ARGV[1]), 'run', 0)
    local nxt = tonumber(redis.call('GET', KEYS[i + 1]) or 0)
    if nxt > tonumber(st[4] or 0) then
      redis.call('HSET', KEYS[i], 'pending', token, 'pend_until', now + tonumber(ARGV[2]))
      out[q] = 'DISPATCH'
    else
      redis.call('HSET', KEYS[i], 'pending', '', 'pend_until', 0)
      out[q] = 'MOVED'
    end
  end
end
return out
