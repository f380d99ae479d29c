-- send.lua: append messages to one queue's log and wake the owner of every subscription that
-- has no ConsumeRequest pending (at most one pending per queue: no task storm).
--
-- KEYS[1]      queue log (STREAM), entry ids "<offset>-1"
-- KEYS[2]      queue next-offset counter (STRING)
-- KEYS[3..]    state HASH of each subscription of the topic on this queue
-- ARGV[1]      n, the number of messages
-- ARGV[2..]    n pairs (header JSON, body bytes)
-- then         pending_ttl_ms, wake channel prefix, and per state key: token, wake payload
-- Returns      {first_offset, store_ms, woken owner...}
-- Replacing a token whose run lease lapsed mid-run also increments the epoch (see below).
local n = tonumber(ARGV[1])
local first = redis.call('INCRBY', KEYS[2], n) - n
for i = 0, n - 1 do
  redis.call('XADD', KEYS[1], (first + i) .. '-1', 'h', ARGV[2 + 2 * i], 'b', ARGV[3 + 2 * i], 's', now)
end
local a = 2 + 2 * n
local ttl = tonumber(ARGV[a])
local chan = ARGV[a + 1]
local out = {first, now}
for k = 3, #KEYS do
  local st = redis.call('HMGET', KEYS[k], 'owner', 'lease', 'pending', 'pend_until', 'run')
  local owner = st[1]
  if owner and owner ~= '' and tonumber(st[2] or 0) > now then
    if (not st[3]) or st[3] == '' or tonumber(st[4] or 0) < now then
      local j = a + 2 + 2 * (k - 3)
      -- Only a wake-up somebody received makes a request pending: if the owner is not listening
      -- (starting, reconnecting), the queue stays unclaimed and its sweep dispatches it in one
      -- sweep interval instead of waiting out a pending token nobody acts on.
      if redis.call('PUBLISH', chan .. owner, ARGV[j + 1]) > 0 then
        if tonumber(st[5] or 0) > 0 then
          -- A run claimed this queue and its run lease lapsed (a process paused or killed
          -- mid-run): the next run gets a new epoch, so the lapsed one is fenced even within
          -- one client.
          redis.call('HINCRBY', KEYS[k], 'epoch', 1)
        end
        redis.call('HSET', KEYS[k], 'pending', ARGV[j], 'pend_until', now + ttl, 'run', 0)
        out[#out + 1] = owner
      end
    end
  end
end
return out
