-- switch.lua: a lingering run's switch to an adopted queue that got messages, decided and done in
-- the round trip of the lingering read that sees them (mqorder.consumer.linger).
--
-- A lingering ConsumeRequest blocks on one XREAD over its own drained queue and the idle queues
-- its IdleQueueWatch adopted (adopt.lua). When a message lands on an adopted queue, the run ends
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
-- ARGV[1] client  ARGV[2] the run's token  ARGV[3] its epoch  ARGV[4] one past what it pulled
-- ARGV[5] finish.lua's new token  ARGV[6] pending_ttl_ms  ARGV[7] lock_lease_ms
-- ARGV[8] the watch's token  ARGV[9] adopt ttl_ms  ARGV[10] run_lease_ms  ARGV[11] pull_n
-- ARGV[12] runner id  ARGV[13] the offset the run has committed once the commit sent before the
--         read (if any) is accepted: a refused or unsent commit leaves another offset, and no switch
-- Returns {0} (no switch) or {i, finish.lua's reply, begin.lua's reply}: candidate i (1-based)
--         runs next, the caller's run has ended.
--- @include "_now"
--- @include "_finish"
--- @include "_begin"
local client, watch_token = ARGV[1], ARGV[8]
local function held_by_caller(owner, lease, assignee)
  return owner == client and ahead(lease) and (assignee == '' or assignee == client)
end
local own = redis.call('HMGET', KEYS[1], 'owner', 'lease', 'epoch', 'pending', 'assignee', 'offset')
if not held_by_caller(own[1] or '', own[2], own[5] or '') or tonumber(own[3] or 0) ~= tonumber(ARGV[3])
    or own[4] ~= ARGV[2] or tonumber(own[6] or 0) ~= tonumber(ARGV[13])
    or tonumber(redis.call('GET', KEYS[2]) or 0) ~= tonumber(ARGV[4]) then
  return {0}
end
-- A backlog first, with the two cheapest reads there are (as sweep.lua does): most candidates
-- have none, and the read returned for one that has.
for i = 3, #KEYS, 4 do
  if tonumber(redis.call('GET', KEYS[i + 2]) or 0) > tonumber(redis.call('HGET', KEYS[i], 'offset') or 0) then
    local st = redis.call('HMGET', KEYS[i], 'owner', 'lease', 'assignee', 'run', 'pending')
    if st[5] == watch_token and not ahead(st[4]) and held_by_caller(st[1] or '', st[2], st[3] or '') then
      local done = finish_run({KEYS[1], KEYS[2]},
        {client, ARGV[2], 'adopt', ARGV[5], ARGV[6], ARGV[7], watch_token, ARGV[9]})
      local begun = begin_run({KEYS[i], KEYS[i + 1], KEYS[i + 2], KEYS[i + 3]},
        {client, watch_token, ARGV[10], ARGV[7], ARGV[11], ARGV[12]})
      return {(i + 1) / 4, done, begun}
    end
  end
end
return {0}
