-- txn_prepare.lua: phase one of a transactional send: store a *half* message (RocketMQ's
-- RMQ_SYS_TRANS_HALF_TOPIC) that no consumer can see, in its queue's hash tag.
--
-- A half message is not in the queue's log, so nothing reads it (like a Spark job's staged run,
-- stage.lua): only txn_end.lua moves it into the log, at the position of the commit, or drops it.
-- It never expires on its own either: the check-back (txn_due.lua) resolves every half message,
-- so none is left half-way.
--
-- KEYS[1] the queue's transaction index (ZSET txid -> when to check it back, ms)
-- KEYS[2] the queue's half messages (HASH "<txid>:h" header, ":b" body, ":n" checks, ":t" prepared ms)
-- ARGV[1] txid (the message id)   ARGV[2] header JSON   ARGV[3] body   ARGV[4] transaction_timeout_ms
-- Returns {prepared ms}; preparing the same txid again changes nothing (a retried phase one).
--- @include "_now"
local txid = ARGV[1]
-- A deleted topic's queue refuses (mqorder.keys.queue_gone beside this index, in its hash tag), as
-- append_entries does: a half message stored there would wait for a check-back that never looks.
if redis.call('EXISTS', string.sub(KEYS[1], 1, -4) .. 'gone') == 1 then
  return redis.error_reply('MQORDER_TOPIC_DELETED ' .. string.sub(KEYS[1], 1, -5))
end
if redis.call('ZSCORE', KEYS[1], txid) then
  return {tonumber(redis.call('HGET', KEYS[2], txid .. ':t') or now)}
end
redis.call('HSET', KEYS[2], txid .. ':h', ARGV[2], txid .. ':b', ARGV[3], txid .. ':n', 0, txid .. ':t', now)
redis.call('ZADD', KEYS[1], now + tonumber(ARGV[4]), txid)
return {now}
