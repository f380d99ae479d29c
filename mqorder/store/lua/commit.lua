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
-- ARGV[9] read_to: one past the highest offset the run has read (AHEAD if above the queue's next)
-- ARGV[10..] pairs (offset, reconsume times) to record; a pair ('e', '<offset>|<ms>|<text>') is the
--         run's last listener exception instead, kept as the state's 'error' field (read by
--         `mqorder status --key`; void once the offset moves past <offset>)
-- Returns {'OK', next, revoked_to}, {'IDLE'} (run ended, queue drained)
--      or {'FENCED', current_epoch, current_owner}, {'SUPERSEDED'}, {'BACKWARD', offset},
--         {'AHEAD', next}
-- State HASH fields: see mqorder.keys.sub_state; commit_fence, count_skipped, drop_retries_below, commit_end:
-- _commit.lua.
--- @include "_now"
--- @include "_commit"
local new = tonumber(ARGV[4])
local refused, st, cur, nxt = commit_fence(KEYS[1], KEYS[2], ARGV[1], ARGV[2], ARGV[3], new, ARGV[9])
if refused then return refused end
local run_until = now + tonumber(ARGV[5])
-- commit_ms: when the offset last moved (read by `mqorder status` to tell a stuck queue from a
-- slow one); a commit that does not move it keeps the old time, in the same HSET.
local moved_ms = st[6] or 0
if new > cur then moved_ms = now end
redis.call('HSET', KEYS[1], 'offset', new, 'run', run_until, 'pend_until', run_until,
  'lease', now + tonumber(ARGV[6]), 'commit_ms', moved_ms)
count_skipped(KEYS[1], ARGV[8])
drop_retries_below(KEYS[3], new, cur)
for i = 10, #ARGV, 2 do
  if ARGV[i] == 'e' then
    redis.call('HSET', KEYS[1], 'error', ARGV[i + 1])
  else
    redis.call('HSET', KEYS[3], ARGV[i], ARGV[i + 1])
  end
end
return commit_end(KEYS[1], nxt, st, ARGV[1], new, ARGV[7] == '1')
