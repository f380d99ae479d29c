-- txn_unclaim.lua: the check-back gives back half messages it claimed (txn_due.lua) and then did
-- not ask about, because ending an earlier one of the batch failed (the broker went away, refused
-- a write): their claim counted a check nobody made, and with transaction_check_max such lost
-- checks rolled back transactions asked fewer times than allowed. Each one still half gets its
-- check count back and is due again at once; one ended meanwhile is left alone.
--
-- KEYS[1] transaction index (ZSET txid -> when to check it back)   KEYS[2] half messages (HASH)
-- ARGV    the txids
-- Returns the number given back
--- @include "_now"
local n = 0
for _, txid in ipairs(ARGV) do
  if redis.call('HEXISTS', KEYS[2], txid .. ':h') == 1 and redis.call('ZSCORE', KEYS[1], txid) then
    redis.call('HINCRBY', KEYS[2], txid .. ':n', -1)
    redis.call('ZADD', KEYS[1], 'XX', now, txid)
    n = n + 1
  end
end
return n
