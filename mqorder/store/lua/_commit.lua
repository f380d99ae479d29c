-- Prelude: the rules every fenced commit of consume progress shares (commit.lua for queue order,
-- key_commit.lua for key order), written once so the two cannot drift (invariant 3).
--- @include "_now"

-- commit_fence(k, k_next, client, epoch, token, new, read_to): the fence. Returns a refusal reply,
-- or nil, the state fields (owner, epoch, pending, offset, assignee, commit_ms, lease), the current
-- offset and the queue's next offset.
-- Refused: another owner or epoch (a paused, replaced holder: FENCED), a lapsed lease (FENCED: a
-- lease that ran out is not held, even by its last owner, who must be granted a new epoch first;
-- after a failover this is what stops a holder whose lock the old primary had already given to
-- somebody else), another pending token (SUPERSEDED), an offset going backward (BACKWARD), or a
-- run that read past the end of the queue (AHEAD: read_to, one past the highest offset it read,
-- is above the queue's next offset). AHEAD only happens after a failover to a replica that missed
-- the last appends: what the run read there is not in this store, and the offsets it would commit
-- or mark finished belong to other messages now. The run ends; the next one reads from here.
local function commit_fence(k, k_next, client, epoch, token, new, read_to)
  local st = redis.call('HMGET', k, 'owner', 'epoch', 'pending', 'offset', 'assignee', 'commit_ms', 'lease')
  if st[1] ~= client or tonumber(st[2] or 0) ~= tonumber(epoch) or not ahead(st[7]) then
    return {'FENCED', tonumber(st[2] or 0), st[1] or ''}
  end
  if st[3] ~= token then return {'SUPERSEDED'} end
  local cur = tonumber(st[4] or 0)
  if new < cur then return {'BACKWARD', cur} end
  local nxt = tonumber(redis.call('GET', k_next) or 0)
  if tonumber(read_to or 0) > nxt then return {'AHEAD', nxt} end
  return nil, st, cur, nxt
end

-- drop_retries_below(k, new, cur): reconsume counts exist only for offsets not committed yet.
local function drop_retries_below(k, new, cur)
  if new > cur and redis.call('EXISTS', k) == 1 then
    local fields = redis.call('HKEYS', k)
    for _, f in ipairs(fields) do
      if tonumber(f) < new then redis.call('HDEL', k, f) end
    end
  end
end

-- count_skipped(k, n): messages retention trimmed before the group read them, moved past by this
-- commit: added to the state's 'skipped' count ('' or absent: 0). Called only by a commit that
-- passed commit_fence, so a stale holder counts nothing, and each skip is counted by the one run
-- whose commit moved past it.
local function count_skipped(k, n)
  n = tonumber(n or 0) or 0
  if n > 0 then redis.call('HINCRBY', k, 'skipped', n) end
end

-- commit_end(k_state, nxt, st, client, new, end_if_drained): the reply of a commit that was
-- written. {'OK', next, revoked_to}; or {'IDLE'} when the caller asked to end its run on a drained
-- queue, nobody else is assigned it and nothing is left to read: the pending token is released in
-- the same step, so a producer appending right after sees no pending request and wakes the owner.
local function commit_end(k_state, nxt, st, client, new, end_if_drained)
  local assignee = st[5] or ''
  local revoked = ''
  if assignee ~= '' and assignee ~= client then revoked = assignee end
  if end_if_drained and revoked == '' and nxt <= new then
    redis.call('HSET', k_state, 'run', 0, 'pending', '', 'pend_until', 0)
    return {'IDLE'}
  end
  return {'OK', nxt, revoked}
end
