-- reset_offset.lua: `mqorder offsets reset` (RocketMQ's resetOffsetByTime), one call per broker
-- (on a Redis Cluster, one call per hash slot, all in one pipelined round trip).
--
-- Moves a group's committed offset on each queue to a new value (backward or forward) and, in the
-- same atomic step, takes the queue away from whoever consumes it, so a running owner can never
-- commit its old progress over the new offset:
--
-- 1. the epoch is incremented: every fenced call of the current run (commit.lua, touch.lua, the
--    lingering read) names the old epoch and is refused from now on;
-- 2. the lock is released with release_lock (_lock.lua), pending token included: a
--    ConsumeRequest still queued for the queue is dropped as STALE by begin.lua, and the running
--    one ends as FENCED or STALE (finish.lua) without dispatching anything;
-- 3. the offset is written (commit.lua's only-forward rule is for consumers; a reset is an
--    operator's decision), and commit_ms with it, so the queue is not reported stuck at once;
-- 4. the retries HASH is deleted: reconsume counts belong to the old head message; so is a
--    key-ordered run's offset map ('done', key_commit.lua): it described the old offset, and its
--    suspended keys ('held': their head offsets and times), which a run replaying the key from the
--    new offset would apply to a later message of a key whose earlier one it is still handling.
--
-- The caller then bumps the topology version: the workers rebalance, assign.lua finds the lock
-- free, gives it to the assignee under a new epoch and dispatches a ConsumeRequest that starts at
-- the new offset (or lock_all retakes it and the sweep dispatches it, one sweep interval later).
--
-- KEYS     pairs (state HASH, retries HASH), one pair per queue (one group lane, one broker)
-- ARGV     one new offset per queue, in the order of KEYS
-- Returns  per queue {old offset, new epoch, owner that held a live lock ('' if none)}
-- State HASH fields: see mqorder.keys.sub_state; lock_live, release_lock: _lock.lua.
--- @include "_now"
--- @include "_lock"
local out = {}
for i = 1, #KEYS, 2 do
  local q = (i + 1) / 2
  local st = redis.call('HMGET', KEYS[i], 'owner', 'lease', 'offset')
  local held = ''
  if lock_live(st[1], st[2]) then held = st[1] end
  local epoch = grant_epoch(KEYS[i])
  release_lock(KEYS[i], false)
  redis.call('HSET', KEYS[i], 'offset', tonumber(ARGV[q]), 'commit_ms', now)
  -- Key mode's map and suspended keys name offsets of the old position: neither holds at the new.
  redis.call('HDEL', KEYS[i], 'done', 'held')
  redis.call('DEL', KEYS[i + 1])
  out[q] = {tonumber(st[3] or 0), epoch, held}
end
return out
