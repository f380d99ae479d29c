-- touch.lua: cheap "am I still the owner?" check that also keeps a long-running request's lease
-- and run mark alive (ctx.still_owner(), and before a listener call when the last fenced call is
-- getting old).
--
-- KEYS[1] state HASH
-- ARGV[1] client  ARGV[2] epoch  ARGV[3] token of the caller's run
-- ARGV[4] run_lease_ms (0 = check only, renew nothing)  ARGV[5] lock_lease_ms
-- Returns {1 if the caller's run is still current (owner, epoch, token, and a lease that has not
--         lapsed: a lapsed lease is re-granted under a new epoch, never renewed; see lock_batch.lua)
--         else 0, epoch, owner}
-- A run mark is renewed only while there is one (run > 0): a lingering request's switched-to runs
-- share its watch's token, and an adopted queue keeps that token and the epoch after its run ended
-- (finish.lua 'adopt'), so a renewal sent as a run ended (a LeaseKeeper tick) set a run mark on an
-- idle queue nobody ran: for the whole run lease, sends neither woke anybody nor rang the
-- doorbell, the rebalance left it BUSY, and the queue stalled 60 s (chaos, 2026-11-29).
-- State HASH fields: see mqorder.keys.sub_state.
--- @include "_now"
local st = redis.call('HMGET', KEYS[1], 'owner', 'epoch', 'pending', 'lease', 'run')
local ok = 0
if st[1] == ARGV[1] and tonumber(st[2] or 0) == tonumber(ARGV[2]) and st[3] == ARGV[3] and ahead(st[4]) then
  ok = 1
  if tonumber(ARGV[4]) > 0 and tonumber(st[5] or 0) > 0 then
    local run_until = now + tonumber(ARGV[4])
    redis.call('HSET', KEYS[1], 'run', run_until, 'pend_until', run_until, 'lease', now + tonumber(ARGV[5]))
  end
end
return {ok, tonumber(st[2] or 0), st[1] or ''}
