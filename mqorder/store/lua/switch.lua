-- switch.lua: a lingering run's switch to an adopted queue that got messages, decided and done in
-- the round trip of the lingering read that sees them (mqorder.consumer.linger).
--
-- A lingering ConsumeRequest blocks on one XREAD over its own drained queue and its client's nudge
-- stream, where a send to an idle queue its IdleQueueWatch adopted (adopt.lua) rings a doorbell
-- (ring_doorbell in _append.lua). When a message lands on an adopted queue, the run ends
-- its own queue (finish.lua, action 'adopt': handed to the watch) and begins that one (begin.lua,
-- with the watch's token). Sent as its own round trip after the read, that switch made a
-- trickling message cost the worker two round trips. This script goes in the read's pipeline,
-- right after the XREAD and the run's state, so Redis runs it as soon as the read returns, and
-- the switch costs no round trip of its own.
--
-- It switches only when the outcome is certain: the caller's run still holds its queue (owner,
-- live lock, epoch, pending token, not reassigned) and has read it to its end (its next offset is
-- exactly one past what the run pulled: nothing new, and no failover took appends it read, which
-- the commit before the read refuses as AHEAD), whose committed offset is the one the run
-- committed (the commit sent before the read, if any, was accepted), and an adopted
-- queue of the same listener has a backlog while it is still adopted by this watch (its owner's
-- live lock, assigned to the caller, no run). Then finish.lua and begin.lua run exactly as the
-- caller would have sent them, one after the other, and their replies are returned for the
-- caller to take as its own. Anything else changes nothing: the caller decides from the read as
-- before (a switch the usual way, messages of its own queue, a lost queue).
--
-- KEYS[1] state HASH, KEYS[2] next counter of the caller's queue; then per adopted candidate, in
--         the caller's order: state HASH, log STREAM, next counter, retries HASH (begin.lua's)
-- ARGV[1] the run's epoch  ARGV[2] one past what it pulled  ARGV[3] the offset the run has committed
--         once the commit sent before the read (if any) is accepted: a refused or unsent commit
--         leaves another offset, and no switch
-- ARGV[4..11] finish.lua's ARGV for the run (action 'adopt': client, the run's token, 'adopt', new
--         token, pending_ttl_ms, lock_lease_ms, the watch's token, adopt ttl_ms)
-- ARGV[12..17] begin.lua's ARGV for a candidate (client, the watch's token, run_lease_ms,
--         lock_lease_ms, pull_n, runner id)
-- ARGV[18..] per candidate, in the same order: its committed offset as the watch last saw it (when
--         it adopted the queue). Offsets only grow, so a candidate whose next counter is not past
--         it has no backlog, and one MGET of every next counter rules out most candidates.
-- Returns {0} (no switch) or {i, finish.lua's reply, begin.lua's reply}: candidate i (1-based)
--         runs next, the caller's run has ended.
--- @include "_now"
--- @include "_finish"
--- @include "_begin"
--- @include "_mget"
local client, watch_token = ARGV[4], ARGV[10]
local function held_by_caller(owner, lease, assignee)
  return owner == client and ahead(lease) and (assignee == '' or assignee == client)
end
local own = redis.call('HMGET', KEYS[1], 'owner', 'lease', 'epoch', 'pending', 'assignee', 'offset')
if not held_by_caller(own[1] or '', own[2], own[5] or '') or tonumber(own[3] or 0) ~= tonumber(ARGV[1])
    or own[4] ~= ARGV[5] or tonumber(own[6] or 0) ~= tonumber(ARGV[3]) then
  return {0}
end
-- Every next counter in one call, the run's own first: most candidates have no backlog, and the
-- read returned for one that has.
local counters = {KEYS[2]}
for i = 3, #KEYS, 4 do
  counters[#counters + 1] = KEYS[i + 2]
end
local nexts = mget_all(counters)
if tonumber(nexts[1] or 0) ~= tonumber(ARGV[2]) then
  return {0}
end
for j = 2, #nexts do
  local i, last = 4 * j - 5, tonumber(nexts[j] or 0)
  if last > tonumber(ARGV[16 + j] or 0) then
    local st = redis.call('HMGET', KEYS[i], 'owner', 'lease', 'assignee', 'run', 'pending', 'offset')
    if last > tonumber(st[6] or 0) and st[5] == watch_token and not ahead(st[4])
        and held_by_caller(st[1] or '', st[2], st[3] or '') then
      local done = finish_run({KEYS[1], KEYS[2]}, {unpack(ARGV, 4, 11)})
      local begun = begin_run({KEYS[i], KEYS[i + 1], KEYS[i + 2], KEYS[i + 3]}, {unpack(ARGV, 12, 17)})
      return {j - 1, done, begun}
    end
  end
end
return {0}
