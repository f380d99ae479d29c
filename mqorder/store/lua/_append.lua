-- Prelude: the one append path (it includes _lock.lua, whose lock_live and request_pending it uses,
-- and _now.lua for the store time). Every script that stores messages (send.lua, and any script
-- that publishes staged messages) appends and wakes through these two functions, so offsets,
-- idempotency and wake-ups follow one rule wherever messages enter a queue.

--- @include "_now"
--- @include "_lock"

-- forget_expired(k_ids, k_exp, limit)
--   Drops up to limit ids whose dedup window ended (ZSET k_exp: id -> expiry ms, Redis clock)
--   from both k_ids and k_exp. Each windowed append adds at most n ids and forgets up to 2n + 16,
--   so the expired backlog only shrinks and no call does unbounded work (Redis 7.0 has no HEXPIRE).
local function forget_expired(k_ids, k_exp, limit)
  local gone = redis.call('ZRANGEBYSCORE', k_exp, '-inf', now, 'LIMIT', 0, limit)
  if #gone > 0 then
    redis.call('HDEL', k_ids, unpack(gone))
    redis.call('ZREM', k_exp, unpack(gone))
  end
end

-- append_entries(k_log, k_next, k_ids, n, idempotent, base, src, window)
--   Appends n messages read from src[base + 1 ...] (src: ARGV unless given, e.g. rows a script
--   assembled itself): (header, body) pairs, or (id, header, body) triples when idempotent. Offsets are contiguous from the queue's next-offset counter; a stream
--   entry is "<offset>-1" with fields h (header), b (body), s (store time, Redis clock).
--   Idempotent: an id already recorded in k_ids (HASH id -> offset), or earlier in this same call,
--   is not stored again; its existing offset is reported. So a retried or duplicated writer (a
--   Spark task retry, speculation, a producer retry) adds nothing twice and never reorders.
--   window (optional, idempotent only): {k_exp = ZSET id -> expiry ms, ms = window length}. The
--   ids then form a *dedup window* (the producer's dedup keys, SQS FIFO's 5 minutes): k_ids holds
--   only windowed ids, each new one is remembered until now + ms, expired ones are forgotten
--   first (forget_expired), an id found past its expiry is new again, and both keys expire at
--   least ms after the last write (the longest window of the writers), so the window stays
--   bounded and an idle queue keeps nothing. Without it ids are remembered for good (Spark).
--   In a window an empty id means "not deduplicated": one call carries a queue's sends with and
--   without dedup keys in call order (once such a batch took a round trip per alternation).
--   Returns first offset, number stored, and a flat list {index (0-based), offset} per duplicate.
-- Stops the script (before its first write: callers check first) on a deleted topic's queue
-- (mqorder.keys.queue_gone: "<prefix>:{tag}:gone" beside "<prefix>:{tag}:next", so in the same
-- slot): a producer still holding the topic's route is refused instead of storing messages
-- nobody reads, which a topic created again under the name then showed as its own.
local function refuse_if_gone(k_next)
  if redis.call('EXISTS', string.sub(k_next, 1, -5) .. 'gone') == 1 then
    error({err = 'MQORDER_TOPIC_DELETED ' .. string.sub(k_next, 1, -6)})
  end
end

local function append_entries(k_log, k_next, k_ids, n, idempotent, base, src, window)
  src = src or ARGV
  refuse_if_gone(k_next)
  if window then forget_expired(k_ids, window.k_exp, 2 * n + 16) end
  local first = tonumber(redis.call('GET', k_next) or 0)
  local off = first
  local stride = idempotent and 3 or 2
  local known = {}
  if idempotent and n > 0 then
    local ids = {}
    for i = 1, n do ids[i] = src[base + stride * (i - 1) + 1] end
    local stored = redis.call('HMGET', k_ids, unpack(ids))
    for i = 1, n do
      -- A windowed id whose window ended is new again, even if forget_expired has not reached it
      -- yet (after a burst it lags behind): once such a send was dropped as a duplicate.
      if stored[i] and (not window or (ids[i] ~= '' and tonumber(redis.call('ZSCORE', window.k_exp, ids[i]) or 0) > now)) then
        known[ids[i]] = tonumber(stored[i])
      end
    end
  end
  local dups = {}
  for i = 1, n do
    local a = base + stride * (i - 1)
    local prev = nil
    local remember = idempotent
    if idempotent then
      a = a + 1
      if window and src[a] == '' then remember = false else prev = known[src[a]] end
    end
    if prev then
      dups[#dups + 1] = i - 1
      dups[#dups + 1] = prev
    else
      redis.call('XADD', k_log, off .. '-1', 'h', src[a + 1], 'b', src[a + 2], 's', now)
      if remember then
        redis.call('HSET', k_ids, src[a], off)
        known[src[a]] = off
        if window then redis.call('ZADD', window.k_exp, now + window.ms, src[a]) end
      end
      off = off + 1
    end
  end
  if off > first then
    redis.call('SET', k_next, off)
    if window then
      -- Only ever lengthened: producers may use different windows, and a shorter one once cut
      -- every other producer's ids short (a resend within its own window was stored twice).
      if redis.call('PTTL', k_ids) < window.ms then redis.call('PEXPIRE', k_ids, window.ms) end
      if redis.call('PTTL', window.k_exp) < window.ms then redis.call('PEXPIRE', window.k_exp, window.ms) end
    end
  end
  return first, off - first, dups
end

-- publish_wake(chan, payload): PUBLISH, or SPUBLISH for a shard channel. A channel name with a
--   hash tag (mqorder.keys.wake_prefix on a Redis Cluster: mqorder:wake:{t:b:q}:<client>) is a
--   shard channel in the queue's own slot, delivered on this shard only. Returns the receivers.
local function publish_wake(chan, payload)
  if string.find(chan, '{', 1, true) then
    return redis.call('SPUBLISH', chan, payload)
  end
  return redis.call('PUBLISH', chan, payload)
end

-- ring_doorbell(chan, owner, k_state)
--   The queue of state k_state is adopted by a lingering request of its owner (its pending token
--   is the watch's, which starts with '!': mqorder.consumer.idle_watch) and not running: an entry
--   naming the state key in the owner's nudge stream (mqorder.keys.linger_nudge, named here from
--   the wake prefix "<prefix>:wake:" as "<prefix>:nudge:<owner>") ends the request's blocking
--   read, which then runs the queue. So that read blocks on two streams, not on every adopted
--   queue's log (an XREAD over the 240 queues of 60 groups cost Redis 0.6 ms a call). Never on a
--   Redis Cluster (a shard channel prefix has a brace): nothing adopts queues there.
local function ring_doorbell(chan, owner, k_state)
  if string.find(chan, '{', 1, true) then return end
  -- 128: mqorder.consumer.nudge.NUDGE_MAX_LEN, every writer's cap.
  redis.call('XADD', string.sub(chan, 1, -6) .. 'nudge:' .. owner, 'MAXLEN', '~', 128, '*', 'm', k_state)
end

-- wake_owners(k0, ttl, chan, base)
--   KEYS[k0 ..] are the state HASHes of every subscription of the queue; ARGV[base + 1 ...] holds
--   one (token, payload) pair per state key. The owner of each subscription that has a live lock
--   and no live pending ConsumeRequest is woken on chan .. owner, and the token becomes pending
--   (at most one pending request per queue: no task storm); one whose pending request is a
--   lingering request's adoption has its doorbell rung (ring_doorbell). Returns the woken owners.
local function wake_owners(k0, ttl, chan, base)
  local woken = {}
  for k = k0, #KEYS do
    local st = redis.call('HMGET', KEYS[k], 'owner', 'lease', 'pending', 'pend_until', 'run')
    local owner = st[1]
    if lock_live(owner, st[2]) then
      if not request_pending(st[3], st[4]) then
        local j = base + 2 * (k - k0) + 1
        -- Only a wake-up somebody received makes a request pending: if the owner is not listening
        -- (starting, reconnecting), the queue stays unclaimed and its sweep dispatches it in one
        -- sweep interval instead of waiting out a pending token nobody acts on.
        if publish_wake(chan .. owner, ARGV[j + 1]) > 0 then
          if tonumber(st[5] or 0) > 0 then
            -- A run claimed this queue and its run lease lapsed (a process paused or killed
            -- mid-run): the next run gets a new epoch, so the lapsed one is fenced even within
            -- one client.
            grant_epoch(KEYS[k])
          end
          redis.call('HSET', KEYS[k], 'pending', ARGV[j], 'pend_until', now + ttl, 'run', 0)
          woken[#woken + 1] = owner
        end
      elseif st[3] and string.byte(st[3], 1) == 33 and not ahead(st[5]) then
        ring_doorbell(chan, owner, KEYS[k])
      end
    end
  end
  return woken
end
