-- commit.lua: the fenced commit of consume progress, fused with the next pull.
--
-- The offset moves only forward, and only if the caller is still the owner *at the epoch it was
-- given*: a holder that was paused past its lease and replaced is refused here, in the same atomic
-- step as the write (invariant 3). Success renews the lease and the run mark.
--
-- KEYS[1] state HASH  KEYS[2] log STREAM  KEYS[3] next counter  KEYS[4] retries HASH
-- ARGV[1] client  ARGV[2] epoch  ARGV[3] token  ARGV[4] new offset  ARGV[5] run_lease_ms
-- ARGV[6] lock_lease_ms  ARGV[7] pull_n  ARGV[8] pull from (offset; taken messages not yet
-- committed, with auto_commit off, are not read again)  ARGV[9] '1': if nothing is left to read,
-- end the run here (what finish.lua would do for an idle queue, one round trip earlier)
-- ARGV[10..] pairs (offset, reconsume times)
-- Returns {'OK', next, revoked_to, entries, retries}, {'IDLE'} (run ended, queue drained)
--      or {'FENCED', current_epoch, current_owner}, {'SUPERSEDED'}, {'BACKWARD', offset}
local st = redis.call('HMGET', KEYS[1], 'owner', 'epoch', 'pending', 'offset', 'assignee')
if st[1] ~= ARGV[1] or tonumber(st[2] or 0) ~= tonumber(ARGV[2]) then
  return {'FENCED', tonumber(st[2] or 0), st[1] or ''}
end
if st[3] ~= ARGV[3] then return {'SUPERSEDED'} end
local cur = tonumber(st[4] or 0)
local new = tonumber(ARGV[4])
if new < cur then return {'BACKWARD', cur} end
local run_until = now + tonumber(ARGV[5])
redis.call('HSET', KEYS[1], 'offset', new, 'run', run_until, 'pend_until', run_until,
  'lease', now + tonumber(ARGV[6]))
if new > cur and redis.call('EXISTS', KEYS[4]) == 1 then
  local fields = redis.call('HKEYS', KEYS[4])
  for _, f in ipairs(fields) do
    if tonumber(f) < new then redis.call('HDEL', KEYS[4], f) end
  end
end
for i = 10, #ARGV, 2 do redis.call('HSET', KEYS[4], ARGV[i], ARGV[i + 1]) end
local assignee = st[5] or ''
local revoked = ''
if assignee ~= '' and assignee ~= ARGV[1] then revoked = assignee end
local nxt = tonumber(redis.call('GET', KEYS[3]) or 0)
local entries = {}
local rc = {}
local pull_n = tonumber(ARGV[7])
local from = math.max(new, tonumber(ARGV[8]))
if ARGV[9] == '1' and revoked == '' and nxt <= new then
  -- Drained and fully committed: release the pending token atomically with the commit, so a
  -- producer appending right after this sees no pending request and wakes the owner.
  redis.call('HSET', KEYS[1], 'run', 0, 'pending', '', 'pend_until', 0)
  return {'IDLE'}
end
if pull_n > 0 and revoked == '' and nxt > from then
  entries = redis.call('XRANGE', KEYS[2], from, '+', 'COUNT', pull_n)
  if redis.call('EXISTS', KEYS[4]) == 1 then rc = redis.call('HGETALL', KEYS[4]) end
end
return {'OK', nxt, revoked, entries, rc}
