-- Prelude: the lock rules the scripts share, written once. A script that judges or releases a lock
-- includes it; it includes _now.lua, whose `now` and `ahead` the rules below judge by.
-- (NOBODY, the assignee "no live client consumes this lane", is not here: it is generated from
-- mqorder.keys.NOBODY as the _constants include, so Lua and Python cannot disagree on it.)
--
-- The fields of the per-queue state HASH (owner, lease, epoch, assignee, run, runner, pending,
-- pend_until, offset), who writes and who reads each, are documented in one place: the docstring
-- of mqorder.keys.sub_state.

--- @include "_now"

-- lock_live(owner, lease): somebody holds the lock: an owner is recorded and its lease has not run
-- out. A lock whose lease lapsed is free to take (with a new epoch), whoever is recorded.
local function lock_live(owner, lease)
  return (owner or '') ~= '' and ahead(lease)
end

-- request_pending(pending, pend_until): a ConsumeRequest was dispatched for the queue and is not
-- presumed lost yet (pend_until not passed). While one is, nobody dispatches a second one (at most
-- one pending ConsumeRequest per queue: no task storm); once pend_until passes, the send path and
-- the sweep may replace it.
local function request_pending(pending, pend_until)
  return (pending or '') ~= '' and tonumber(pend_until or 0) >= now
end

-- grant_epoch(k): the fencing epoch of a new grant of queue k's lock, written and returned. Every
-- grant takes one (lock_batch, begin, assign, a handover in finish, the fencing of a lapsed run in
-- sweep and _append, an offset reset): never the epoch of the holder before it.
--
-- The epoch is max(epoch + 1, now * 1000): a hybrid clock, whose high part is Redis's clock in ms
-- at the grant and low part counts grants within one ms. That is the failover fence (invariant 9,
-- docs/ARCHITECTURE.md "Fencing across a failover"). Replication is asynchronous, so a promoted
-- replica may lack the last grants of the old primary; a counter alone would then hand out
-- again, on the new primary, an epoch that a client of the old one already holds. A clock does
-- not go back with the data: every grant made after a failover is at least (failover time) * 1000,
-- above every epoch the old primary granted before it died (each at most its grant time * 1000
-- plus the grants of that same ms), as long as the two nodes' clocks differ by less than the time
-- a failover takes (down-after-milliseconds and the election: seconds). Leases already rest on
-- Redis's clock the same way. 2^53 (exact in Lua's doubles) is reached in the year 2255.
local function grant_epoch(k)
  local e = math.max(tonumber(redis.call('HGET', k, 'epoch') or 0) + 1, now * 1000)
  redis.call('HSET', k, 'epoch', e)
  return e
end

-- release_lock(k, keep_request): the one way a lock is released. The queue gets no owner, its
-- lease is 0 and its run mark cleared; the epoch is kept (the next owner increments it, which is
-- what fences anything the released owner still has in flight).
--
-- keep_request = false (assign.lua when the lane goes to NOBODY, finish.lua when the caller's own
-- run releases it): the pending token is dropped too. The releasing side is deciding what happens
-- to the queue: finish.lua is the pending request itself, ending; assign.lua retires the lane,
-- and a request still queued for it must not consume it (begin.lua says REVOKED or NOT_LOCKED).
--
-- keep_request = true (unlock_batch.lua): a pending ConsumeRequest outlives the lock. unlockBatch
-- only gives up the lock of an idle queue (or of a dead incarnation, forced); it decides nothing
-- about the request already dispatched on the caller's direct queue, which is still the one
-- pending request of the queue. Kept, that request stays valid and moves the queue on when it
-- runs: begin.lua retakes the free lock if the queue is assigned to its client (or to nobody yet:
-- RocketMQ's tryLockLaterAndReconsume), or answers NOT_LOCKED and finish.lua hands the queue to
-- the owner or assignee. Cleared, that request would be dropped as STALE and, as soon as a new
-- owner holds the lock, send.lua or the sweep would dispatch a second request beside it; and
-- nothing would be gained: with no owner nobody is woken, and a rebalance that moves the queue
-- (assign.lua) replaces the token anyway. If the request is lost with its worker, pend_until
-- lapses (pending_ttl_ms at most) and the sweep dispatches again, as for any lost request.
local function release_lock(k, keep_request)
  if keep_request then
    redis.call('HSET', k, 'owner', '', 'lease', 0, 'run', 0)
  else
    redis.call('HSET', k, 'owner', '', 'lease', 0, 'run', 0, 'pending', '', 'pend_until', 0)
  end
end
