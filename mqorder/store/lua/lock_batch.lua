-- lock_batch.lua: RebalanceLockManager.tryLockBatch, one call per broker per batch.
--
-- For each queue: renew the caller's own live lock; take a free or expired one, the caller's own
-- lapsed lock included (new fencing epoch, grant_epoch)
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
  if owner == client and live then
    redis.call('HSET', KEYS[i], 'lease', lease_until)
    out[i] = tonumber(st[3] or 0)
  elseif (not live) and (assignee == '' or assignee == client) then
    -- Free, expired, or the caller's own lease lapsed: a new grant either way. A lapsed lease is
    -- never renewed in place: after a failover the promoted replica may hold the caller's old,
    -- lapsed lock while another client was granted a newer epoch on the old primary; renewing the
    -- old epoch would take the epochs backward (grant_epoch, _lock.lua).
    local epoch = grant_epoch(KEYS[i])
    redis.call('HSET', KEYS[i], 'owner', client, 'lease', lease_until, 'run', 0)
    out[i] = epoch
  else
    out[i] = 0
  end
end
return out
