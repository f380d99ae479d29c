-- key_commit.lua: the fenced commit of a key-ordered run (ordering="key"), with its offset map.
--
-- The fence, the forward-only offset, the lease and run renewal and the idle ending are
-- commit.lua's, rule for rule (invariant 3): the caller must still be the owner at the epoch it was
-- given, with its pending token. What differs: the offset is the lowest *unfinished* offset
-- (RocketMQ's concurrent removeMessage rule) and the offsets finished above it are stored with it,
-- in the same atomic step, as the state HASH field 'done' (mqorder.consumer.offset_map): a new
-- owner after a failover redelivers only unfinished offsets. A map must be relative to the offset
-- committed with it ('<offset>:...') and at most ARGV[9] bytes: anything else is refused, so a
-- map can never describe other offsets than the ones its commit covers.
--
-- The caller pipelines a plain XRANGE for the next batch right behind this script, as with
-- commit.lua, and discards it if the commit was refused.
--
-- KEYS[1] state HASH  KEYS[2] next counter  KEYS[3] retries HASH
-- ARGV[1] client  ARGV[2] epoch  ARGV[3] token  ARGV[4] new offset (lowest unfinished)
-- ARGV[5] run_lease_ms  ARGV[6] lock_lease_ms  ARGV[7] '1': end the run here if nothing is left
-- ARGV[8] the offset map ('' when nothing finished above the offset)  ARGV[9] its size limit
-- ARGV[10] messages the run moved past because retention trimmed them before they were read,
--          counted with this commit as in commit.lua (its ARGV[8]; '' or 0: none)
-- ARGV[11] read_to: one past the highest offset the run has read (AHEAD if above the queue's next;
--          the map never covers an offset the run did not read)
-- ARGV[12..] pairs (offset, reconsume times) to record; times 0 deletes the offset's count; a pair
--          ('e', '<offset>|<ms>|<text>') is the run's last listener exception, as in commit.lua;
--          a pair ('u', '<offset>:<until ms>,...') the suspended keys' head offsets and the wall
--          clock time each key may run again, kept as the state's 'held' field for the next run
--          (begin.lua returns it): a run that ends while keys are suspended must not let the next
--          run retry them early
-- Returns {'OK', next, revoked_to}, {'IDLE'}
--      or {'FENCED', current_epoch, current_owner}, {'SUPERSEDED'}, {'BACKWARD', offset},
--         {'AHEAD', next}, {'BADMAP', reason}
-- State HASH fields: see mqorder.keys.sub_state; commit_fence, count_skipped, drop_retries_below, commit_end:
-- _commit.lua.
--- @include "_now"
--- @include "_commit"
local new = tonumber(ARGV[4])
local refused, st, cur, nxt = commit_fence(KEYS[1], KEYS[2], ARGV[1], ARGV[2], ARGV[3], new, ARGV[11])
if refused then return refused end
local map = ARGV[8]
if map ~= '' then
  if #map > tonumber(ARGV[9]) then return {'BADMAP', 'map of ' .. #map .. ' bytes over ' .. ARGV[9]} end
  local prefix = ARGV[4] .. ':'
  if string.sub(map, 1, #prefix) ~= prefix then return {'BADMAP', 'map not relative to offset ' .. ARGV[4]} end
end
local run_until = now + tonumber(ARGV[5])
local moved_ms = st[6] or 0
if new > cur then moved_ms = now end
redis.call('HSET', KEYS[1], 'offset', new, 'done', map, 'run', run_until, 'pend_until', run_until,
  'lease', now + tonumber(ARGV[6]), 'commit_ms', moved_ms)
count_skipped(KEYS[1], ARGV[10])
drop_retries_below(KEYS[3], new, cur)
for i = 12, #ARGV, 2 do
  if ARGV[i] == 'e' then
    redis.call('HSET', KEYS[1], 'error', ARGV[i + 1])
  elseif ARGV[i] == 'u' then
    redis.call('HSET', KEYS[1], 'held', ARGV[i + 1])
  elseif ARGV[i + 1] == '0' then
    redis.call('HDEL', KEYS[3], ARGV[i])
  else
    redis.call('HSET', KEYS[3], ARGV[i], ARGV[i + 1])
  end
end
return commit_end(KEYS[1], nxt, st, ARGV[1], new, ARGV[7] == '1')
