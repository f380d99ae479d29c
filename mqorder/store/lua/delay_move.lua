-- delay_move.lua: the delay mover's step for one queue: append every due delayed message to the
-- queue's log, in due order (then send order), through the one append path (append_entries, then
-- wake_owners), and forget them, all in one atomic step: each is made visible exactly once.
--
-- KEYS[1] the queue's schedule (ZSET)   KEYS[2] the queue's delayed messages (HASH)
-- KEYS[3] queue log   KEYS[4] next-offset counter   KEYS[5..] state HASH of each subscription
-- ARGV[1] at most this many per call   ARGV[2] pending_ttl_ms   ARGV[3] wake channel prefix
-- ARGV[4..] per state key: token, wake payload
-- Returns {moved, first offset, next due ms or -1, woken owner...}
--- @include "_now"
--- @include "_append"
local due = redis.call('ZRANGEBYSCORE', KEYS[1], '-inf', now, 'LIMIT', 0, tonumber(ARGV[1]))
local rows = {}
local gone = {}
for _, member in ipairs(due) do
  local m = redis.call('HMGET', KEYS[2], member .. ':h', member .. ':b')
  if m[1] then
    rows[#rows + 1] = m[1]
    rows[#rows + 1] = m[2]
  end
  gone[#gone + 1] = member .. ':h'
  gone[#gone + 1] = member .. ':b'
end
local first, stored = 0, 0
if #due > 0 then
  first, stored = append_entries(KEYS[3], KEYS[4], nil, #rows / 2, false, 0, rows)
  redis.call('ZREM', KEYS[1], unpack(due))
  redis.call('HDEL', KEYS[2], unpack(gone))
end
local nxt = redis.call('ZRANGE', KEYS[1], 0, 0, 'WITHSCORES')
local out = {stored, first, tonumber(nxt[2] or -1)}
if stored > 0 then
  for _, owner in ipairs(wake_owners(5, tonumber(ARGV[2]), ARGV[3], 3)) do
    out[#out + 1] = owner
  end
end
return out
