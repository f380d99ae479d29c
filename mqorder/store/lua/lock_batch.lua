-- lock_batch.lua: RebalanceLockManager.tryLockBatch, one call per broker per batch.
--
-- For each queue: renew the caller's own lock; take a free or expired one (new fencing epoch)
-- unless the rebalance assigned it to somebody else; refuse a live lock of another client.
--
-- KEYS     state HASH of each queue (one group, one broker)
-- ARGV[1]  client id   ARGV[2] lock_lease_ms
-- Returns  one epoch per queue, 0 where the lock was refused
-- State HASH fields: see mqorder.keys.sub_state; lock_live: _lock.lua.
--- @include "_now"
--- @include "_lock"
local client = ARGV[1]
local lease_until = now + tonumber(ARGV[2])
local out = {}
for i = 1, #KEYS do
  local st = redis.call('HMGET', KEYS[i], 'owner', 'lease', 'epoch', 'assignee')
  local owner, assignee = st[1] or '', st[4] or ''
  local live = lock_live(owner, st[2])
  if owner == client then
    redis.call('HSET', KEYS[i], 'lease', lease_until)
    out[i] = tonumber(st[3] or 0)
  elseif (not live) and (assignee == '' or assignee == client) then
    local epoch = redis.call('HINCRBY', KEYS[i], 'epoch', 1)
    redis.call('HSET', KEYS[i], 'owner', client, 'lease', lease_until, 'run', 0)
    out[i] = epoch
  else
    out[i] = 0
  end
end
return out
