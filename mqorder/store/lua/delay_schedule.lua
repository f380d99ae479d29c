-- delay_schedule.lua: hold a delayed message (RocketMQ's delay_time_level) beside its queue's log
-- until it is due. Like RocketMQ's SCHEDULE_TOPIC_XXXX it is stored but not in the log, so no
-- consumer sees it; delay_move.lua appends it to the log once due.
--
-- KEYS[1] the queue's schedule (ZSET member -> due ms, Redis clock)
-- KEYS[2] the queue's delayed messages (HASH "<member>:h" header, "<member>:b" body)
-- KEYS[3] the queue's schedule sequence (STRING counter)
-- KEYS[4] (optional) the send's dedup key (STRING: the due ms it got), kept ARGV[4] ms: a
--         consumer's send-back to its retry topic whose reply was lost is sent again by the
--         retried run, and must not be stored twice (the DLQ writer dedups the same case)
-- ARGV[1] delay in ms   ARGV[2] header JSON   ARGV[3] body   ARGV[4] how long KEYS[4] is kept
-- Returns {due ms} (the first send's, for a send made again)
-- Members are a zero-padded per-queue sequence: messages due at the same ms keep their send order
-- (a ZSET orders equal scores by member).
--- @include "_now"
-- A deleted topic's queue refuses (mqorder.keys.queue_gone beside this schedule, in its hash tag),
-- as append_entries does: a delayed message held here reached a topic created again under the name.
if redis.call('EXISTS', string.sub(KEYS[1], 1, -6) .. 'gone') == 1 then
  return redis.error_reply('MQORDER_TOPIC_DELETED ' .. string.sub(KEYS[1], 1, -7))
end
if KEYS[4] then
  local seen = redis.call('GET', KEYS[4])
  if seen then return {tonumber(seen)} end
end
local seq = redis.call('INCR', KEYS[3])
local member = string.format('%015d', seq)
local due = now + tonumber(ARGV[1])
redis.call('HSET', KEYS[2], member .. ':h', ARGV[2], member .. ':b', ARGV[3])
redis.call('ZADD', KEYS[1], due, member)
if KEYS[4] then redis.call('SET', KEYS[4], due, 'PX', tonumber(ARGV[4])) end
return {due}
