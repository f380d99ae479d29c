-- unlock_batch.lua: RebalanceLockManager.unlockBatch. Releases only the caller's own locks, and
-- (unless forced) only where no ConsumeRequest is running: RocketMQ unlocks a queue only when it
-- can take the ProcessQueue's consume lock, i.e. when nothing is consuming it.
--
-- KEYS     state HASH of each queue
-- ARGV[1]  client id   ARGV[2] '1' to unlock even while running (only for a dead client)
-- Returns  1 per queue unlocked, 0 where it was kept
-- State HASH fields: see mqorder.keys.sub_state; ahead, release_lock: _lock.lua.
--
-- Only the lock is released: pending/pend_until stay. A ConsumeRequest already dispatched for the
-- queue is still its one pending request; when it runs it retakes the lock (queue assigned to its
-- client) or hands the queue to the owner or assignee (begin.lua NOT_LOCKED, then finish.lua).
-- Clearing the token would drop that request and let a second one be dispatched beside it. The
-- full reasoning is at release_lock in _lock.lua.
--- @include "_now"
--- @include "_lock"
local out = {}
for i = 1, #KEYS do
  local st = redis.call('HMGET', KEYS[i], 'owner', 'run')
  if st[1] == ARGV[1] and (ARGV[2] == '1' or not ahead(st[2])) then
    release_lock(KEYS[i], true)
    out[i] = 1
  else
    out[i] = 0
  end
end
return out
