-- commit.lua: the fenced commit of consume progress.
--
-- The offset moves only forward, and only if the caller is still the owner *at the epoch it was
-- given*: a holder that was paused past its lease and replaced is refused here, in the same atomic
-- step as the write (invariant 3). Success renews the lease and the run mark.
--
-- The caller pipelines a plain XRANGE for the next batch right behind this script (one round
-- trip per pulled batch) and discards it if the commit was refused: reading the entries outside
-- Lua saves Redis the conversion of every entry into Lua tables and back.
--
-- KEYS[1] state HASH  KEYS[2] next counter  KEYS[3] retries HASH
-- ARGV[1] client  ARGV[2] epoch  ARGV[3] token  ARGV[4] new offset  ARGV[5] run_lease_ms
-- ARGV[6] lock_lease_ms  ARGV[7] '1': if nothing is left to read, end the run here (what
-- finish.lua would do for an idle queue, one round trip earlier)
-- ARGV[8] messages the run skipped since its last commit because retention trimmed them before
--         they were read (the committed offset was below the queue's first stored offset): added
--         to the state's 'skipped' count with the commit that moves past them ('' or absent: 0)
-- ARGV[9..] pairs (offset, reconsume times) to record
-- Returns {'OK', next, revoked_to}, {'IDLE'} (run ended, queue drained)
--      or {'FENCED', current_epoch, current_owner}, {'SUPERSEDED'}, {'BACKWARD', offset}
-- State HASH fields: see mqorder.keys.sub_state.
local st = redis.call('HMGET', KEYS[1], 'owner', 'epoch', 'pending', 'offset', 'assignee', 'commit_ms')
if st[1] ~= ARGV[1] or tonumber(st[2] or 0) ~= tonumber(ARGV[2]) then
  return {'FENCED', tonumber(st[2] or 0), st[1] or ''}
end
if st[3] ~= ARGV[3] then return {'SUPERSEDED'} end
local cur = tonumber(st[4] or 0)
local new = tonumber(ARGV[4])
if new < cur then return {'BACKWARD', cur} end
local run_until = now + tonumber(ARGV[5])
-- commit_ms: when the offset last moved (read by `mqorder status` to tell a stuck queue from a
-- slow one); a commit that does not move it keeps the old time, in the same HSET.
local moved_ms = st[6] or 0
if new > cur then moved_ms = now end
redis.call('HSET', KEYS[1], 'offset', new, 'run', run_until, 'pend_until', run_until,
  'lease', now + tonumber(ARGV[6]), 'commit_ms', moved_ms)
local skipped = tonumber(ARGV[8] or 0) or 0
if skipped > 0 then redis.call('HINCRBY', KEYS[1], 'skipped', skipped) end
if new > cur and redis.call('EXISTS', KEYS[3]) == 1 then
  local fields = redis.call('HKEYS', KEYS[3])
  for _, f in ipairs(fields) do
    if tonumber(f) < new then redis.call('HDEL', KEYS[3], f) end
  end
end
for i = 9, #ARGV, 2 do redis.call('HSET', KEYS[3], ARGV[i], ARGV[i + 1]) end
local assignee = st[5] or ''
local revoked = ''
if assignee ~= '' and assignee ~= ARGV[1] then revoked = assignee end
local nxt = tonumber(redis.call('GET', KEYS[2]) or 0)
if ARGV[7] == '1' and revoked == '' and nxt <= new then
  -- Drained and fully committed: release the pending token atomically with the commit, so a
  -- producer appending right after this sees no pending request and wakes the owner.
  redis.call('HSET', KEYS[1], 'run', 0, 'pending', '', 'pend_until', 0)
  return {'IDLE'}
end
return {'OK', nxt, revoked}
