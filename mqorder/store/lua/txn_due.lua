-- txn_due.lua: the check-back's claim of the half messages of one queue that are due: prepared
-- longer than transaction_timeout_ms ago (or last checked a recheck interval ago) and still not
-- ended. Each claimed one has its check count incremented and its next check pushed back, in the
-- same step, so two check-backs running at once (two beats) do not both ask about it.
--
-- KEYS[1] transaction index (ZSET txid -> when to check it back)   KEYS[2] half messages (HASH)
-- ARGV[1] at most this many   ARGV[2] recheck interval ms
-- Returns flat {txid, header, body, checks (after this one), prepared ms} per claimed half message
--- @include "_now"
local due = redis.call('ZRANGEBYSCORE', KEYS[1], '-inf', now, 'LIMIT', 0, tonumber(ARGV[1]))
local out = {}
for _, txid in ipairs(due) do
  local half = redis.call('HMGET', KEYS[2], txid .. ':h', txid .. ':b', txid .. ':t')
  if half[1] then
    local n = redis.call('HINCRBY', KEYS[2], txid .. ':n', 1)
    redis.call('ZADD', KEYS[1], now + tonumber(ARGV[2]), txid)
    out[#out + 1] = txid
    out[#out + 1] = half[1]
    out[#out + 1] = half[2]
    out[#out + 1] = n
    out[#out + 1] = tonumber(half[3] or 0)
  else
    redis.call('ZREM', KEYS[1], txid)
  end
end
return out
