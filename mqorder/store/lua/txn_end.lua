-- txn_end.lua: phase two of a transactional send, by the producer or by the check-back: COMMIT
-- appends the half message to the queue's log *now* (through the one append path, append_entries
-- then wake_owners), so it takes the position of the commit; ROLLBACK drops it. Either way the
-- half message and its index entry go, and the outcome is recorded, in the same atomic step: a
-- half message ends visible or rolled back exactly once, whoever ends it first (a late second
-- end gets GONE and changes nothing).
--
-- KEYS[1] queue log   KEYS[2] next-offset counter   KEYS[3] transaction index (ZSET)
-- KEYS[4] half messages (HASH, see txn_prepare.lua)   KEYS[5] outcome log (STREAM, capped)
-- KEYS[6..] state HASH of each subscription of the topic on this queue
-- ARGV[1] txid   ARGV[2] 'COMMIT' or 'ROLLBACK'   ARGV[3] reason   ARGV[4] who ends it
-- ARGV[5] outcome log length cap   ARGV[6] pending_ttl_ms   ARGV[7] wake channel prefix
-- ARGV[8] claims not to count as checks in the outcome (1: the check-back's give-up claimed it
--         without asking: 'checks' then says how many times a checker was asked)
-- ARGV[9..] per state key: token, wake payload
-- Returns {'COMMIT', offset, store ms, woken owner...}, {'ROLLBACK'} or {'GONE'} (already ended)
--- @include "_now"
--- @include "_append"
local txid = ARGV[1]
local half = redis.call('HMGET', KEYS[4], txid .. ':h', txid .. ':b', txid .. ':n')
if not half[1] then
  redis.call('ZREM', KEYS[3], txid)
  return {'GONE'}
end
if ARGV[2] == 'COMMIT' then refuse_if_gone(KEYS[2]) end -- before the half message goes
redis.call('HDEL', KEYS[4], txid .. ':h', txid .. ':b', txid .. ':n', txid .. ':t')
redis.call('ZREM', KEYS[3], txid)
local out
local offset = -1
if ARGV[2] == 'COMMIT' then
  local first = append_entries(KEYS[1], KEYS[2], nil, 1, false, 0, {half[1], half[2]})
  offset = first
  out = {'COMMIT', first, now}
  for _, owner in ipairs(wake_owners(6, tonumber(ARGV[6]), ARGV[7], 8)) do
    out[#out + 1] = owner
  end
else
  out = {'ROLLBACK'}
end
redis.call('XADD', KEYS[5], 'MAXLEN', '~', ARGV[5], '*', 'txid', txid, 'outcome', ARGV[2],
  'reason', ARGV[3], 'by', ARGV[4], 'checks', math.max(0, tonumber(half[3] or 0) - tonumber(ARGV[8])),
  'offset', offset)
return out
