-- unlock_batch.lua: RebalanceLockManager.unlockBatch. Releases only the caller's own locks, and
-- (unless forced) only where no ConsumeRequest is running: RocketMQ unlocks a queue only when it
-- can take the ProcessQueue's consume lock, i.e. when nothing is consuming it.
--
-- KEYS     state HASH of each queue
-- ARGV[1]  client id   ARGV[2] '1' to unlock even while running (only for a dead client)
-- Returns  1 per queue unlocked, 0 where it was kept
local out = {}
for i = 1, #KEYS do
  local st = redis.call('HMGET', KEYS[i], 'owner', 'run')
  if st[1] == ARGV[1] and (ARGV[2] == '1' or tonumber(st[2] or 0) <= now) then
    redis.call('HSET', KEYS[i], 'owner', '', 'lease', 0, 'run', 0)
    out[i] = 1
  else
    out[i] = 0
  end
end
return out
