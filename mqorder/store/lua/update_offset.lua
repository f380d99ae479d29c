-- update_offset.lua: a pull consumer's fenced commit of its consume offset (PullConsumer.update_offset).
--
-- The same rule as the engine's commit.lua (invariant 3): the offset moves only forward, and only
-- if the caller still holds the queue at the epoch fetch_message_queues_in_balance gave it. A pull
-- consumer that was paused past its lease, or whose queue a rebalance moved, is refused here in the
-- same atomic step as the write, so it can never commit over the new holder's progress. There is
-- no dispatch token (the application drives its own loop), and an offset past the end of the log
-- is refused: nothing can be acknowledged before it was stored. Success renews the lease.
--
-- An offset moving forward can also name the message the consumer pulled at new - 1 (ARGV[5], its
-- msg id): the entry stored there must be that message, or the commit is refused (CHANGED). The
-- offset check alone (ILLEGAL) holds only while the store has fewer messages than the consumer
-- read: after a failover to a replica that missed appends the consumer had pulled, producers
-- refill those offsets with other messages, and committing past them would skip them. A message
-- stored again under its own id (a producer's retry) is the same message: accepted.
--
-- KEYS[1] state HASH of the group on the queue   KEYS[2] the queue's next-offset counter
-- KEYS[3] the queue's log (read only when ARGV[5] is given)
-- ARGV[1] client id   ARGV[2] epoch   ARGV[3] new offset   ARGV[4] lock_lease_ms
-- ARGV[5] msg id of the message at new - 1 as the consumer pulled it ('' or absent: not checked)
-- Returns {'OK', previous offset}, {'FENCED', current epoch, current owner},
--         {'BACKWARD', committed offset}, {'ILLEGAL', next offset} or {'CHANGED', msg id stored
--         at new - 1} (an entry trimmed since it was pulled is not checked)
-- State HASH fields: see mqorder.keys.sub_state.
--- @include "_now"
local st = redis.call('HMGET', KEYS[1], 'owner', 'epoch', 'offset', 'commit_ms', 'lease')
-- A lapsed lease is not held, even by its last owner (see _commit.lua's commit_fence).
if st[1] ~= ARGV[1] or tonumber(st[2] or 0) ~= tonumber(ARGV[2]) or not ahead(st[5]) then
  return {'FENCED', tonumber(st[2] or 0), st[1] or ''}
end
local cur = tonumber(st[3] or 0)
local new = tonumber(ARGV[3])
if new < cur then return {'BACKWARD', cur} end
local nxt = tonumber(redis.call('GET', KEYS[2]) or 0)
if new > nxt then return {'ILLEGAL', nxt} end
local want = ARGV[5] or ''
if want ~= '' and new > cur then
  -- Absent: trimmed by retention since it was pulled (below next, offsets have no holes), no
  -- evidence either way: accepted as before.
  -- The header is decoded (any JSON writer's spacing and escapes); one that does not decode, or
  -- has no string id, cannot tell either: accepted.
  local e = redis.call('XRANGE', KEYS[3], new - 1, new - 1)
  if e[1] then
    local f, hdr = e[1][2], nil
    for i = 1, #f, 2 do
      if f[i] == 'h' then hdr = f[i + 1] end
    end
    local ok, h = pcall(cjson.decode, hdr or '')
    if ok and type(h) == 'table' and type(h.i) == 'string' and h.i ~= want then
      return {'CHANGED', h.i}
    end
  end
end
local moved_ms = st[4] or 0
if new > cur then moved_ms = now end
redis.call('HSET', KEYS[1], 'offset', new, 'commit_ms', moved_ms, 'lease', now + tonumber(ARGV[4]))
return {'OK', cur}
