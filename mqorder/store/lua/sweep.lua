-- sweep.lua: re-dispatch owned queues that have a backlog and no live ConsumeRequest (a task lost
-- from the Celery broker, a pool process killed mid-run): invariant 5, "no stall".
--
-- KEYS        pairs (state HASH, next counter), one pair per queue
-- ARGV[1]     client ('' = any owner)   ARGV[2] pending_ttl_ms
-- ARGV[3]     the node's identity: the replication id of the primary these keys are on (INFO
--             replication's master_replid, read by the caller), passed to record it (below); ''
--             for queues the caller already recorded under it, or when it is unknown
-- ARGV[4..]   one token per queue
-- Returns     flat list of (queue index (1-based), owner, token) for each queue to dispatch
--
-- A run mark written on another node (invariant 9's failover, docs/ARCHITECTURE.md "A run the
-- promoted replica still thinks is running"). Replication is asynchronous: a promoted replica may
-- lack a run's finish.lua, and keep its run mark and pending token until run_lease_ms (60 s)
-- lapses, while nothing dispatches the queue. So the sweep records, in the state's `node` field,
-- the identity of the node it swept the queue on, and begin.lua copies that field into `run_node`
-- when a run starts. When the recorded node is not this one, this is the first sweep of the queue
-- since a failover (or a restart that changed the replication id). A live run mark whose
-- `run_node` is not this node was written before it, by a run that either died with the old
-- primary or goes on here (a run cut by the failover retries begin.lua; one that began here before
-- this first sweep copied the old `node`). The sweep tells them apart by the mark itself: it notes
-- the mark's deadline (`suspect`), and a live run renews its mark (every commit, touch and begin
-- moves `run`). At the first sweep on this node SUSPECT_GRACE_MS after that, a mark with the same
-- deadline is judged lapsed: fenced with a new epoch and dispatched, as the sweep does for any
-- lapsed run; one that moved is left alone. Safe either way, since a run that does go on is
-- refused at its next commit (FENCED) and what it read is redelivered. A queue never swept before has no `node`: recorded, not
-- judged, so a new deployment fences nothing. On a steady primary the sweep only reads the fields.
-- A held queue with no live run, first swept on another node than the recorded one, gets a new
-- epoch: what the node holds may be older than what its holder saw (a restore, a lost re-grant).
--- @include "_now"
--- @include "_lock"
--- @include "_mget"
--
-- Only a queue with a backlog (next > offset) can need a request, so that is tested first, with
-- the cheapest reads there are (its next counter, read for every queue in one MGET, and a
-- one-field HGET); the lock and request fields are read only for a queue that has one, or that is
-- to be recorded (an identity passed: a caller records each queue once per identity,
-- RebalanceLockManager.sweep_lanes, backlog or not, since a trickle rarely has a backlog at the
-- instant of a sweep). An idle deployment's queues have neither: its sweep then costs an HGET
-- per owned queue and one MGET, not an eight-field HMGET turned into a Lua table and judged
-- (issue 27's idle cost). Every read is in this one script, so the order of the tests changes
-- nothing in what it decides.
local node = ARGV[3]
-- How long a noted mark may stay unrenewed before it is judged: a run cut by the failover retries
-- begin.lua on a doubling backoff (0.25 s, then 0.5, 1, 2, 4: mqorder.consumer.engine), so the
-- retry that finds the new primary (promoted ~3 s after a kill) comes within about 4 s of it;
-- and a lingering run renews nothing for its linger (1 s by default). Fencing a live run would
-- redeliver what it holds; waiting longer delays a dead one. Well under the 60 s run lease.
local SUSPECT_GRACE_MS = 5000
local out = {}
-- Every next counter first (mget_all): an MGET where a GET per queue was, so an idle queue costs
-- Redis one MGET slot and one HGET.
local counters = {}
for i = 2, #KEYS, 2 do
  counters[#counters + 1] = KEYS[i]
end
local nexts = mget_all(counters)
for i = 1, #KEYS, 2 do
  local q = (i + 1) / 2
  local nxt = tonumber(nexts[q] or 0)
  local backlog = nxt > tonumber(redis.call('HGET', KEYS[i], 'offset') or 0)
  if backlog or node ~= '' then
    local st = redis.call('HMGET', KEYS[i], 'owner', 'lease', 'pending', 'pend_until', 'run', 'node', 'run_node',
      'suspect', 'suspect_at')
    local owner = st[1] or ''
    local run_live = ahead(st[5])
    local pend_live = request_pending(st[3], st[4])
    local swept_on, fenced = st[6] or '', false
    if node ~= '' and swept_on ~= node then
      if swept_on ~= '' and run_live and (st[7] or '') ~= node then
        redis.call('HSET', KEYS[i], 'node', node, 'suspect', st[5], 'suspect_at', now)
      else
        redis.call('HSET', KEYS[i], 'node', node, 'suspect', '')
        if swept_on ~= '' and lock_live(owner, st[2]) and not run_live then
          -- A held queue with no run, first swept on this node: its stored epoch may be older than
          -- one its holder already used (Redis restored from an older snapshot, or a re-grant the
          -- failover lost), and a renewal keeps the stored epoch, so the holder would go on under
          -- it and a fenced sink refuse everything (a durability walk-through: a message to the
          -- DLQ every 16 s). A new grant is above every epoch handed out before (a clock). No run
          -- holds the queue, so this fences nothing in flight.
          grant_epoch(KEYS[i])
          fenced = true
        end
      end
    elseif (st[8] or '') ~= '' then
      if not (run_live and st[8] == st[5]) then
        redis.call('HSET', KEYS[i], 'suspect', '')  -- renewed or ended: a live run, or none
      elseif now - tonumber(st[9] or 0) >= SUSPECT_GRACE_MS then
        -- Written on another node and not renewed since the first sweep here: lapsed (see above),
        -- fenced and cleared now, whether or not this sweep dispatches the queue (with no live
        -- lock, the next grant's request must not find it BUSY). Its pending token is the run's
        -- own (begin.lua sets pend_until to the run's deadline), so it goes with it.
        grant_epoch(KEYS[i])
        redis.call('HSET', KEYS[i], 'run', 0, 'pending', '', 'pend_until', 0, 'suspect', '')
        run_live, pend_live, fenced = false, false, true
      end
      -- Otherwise not renewed yet, but a run cut by the failover may still be retrying, or
      -- lingering: judged at a later sweep.
    end
    if backlog and lock_live(owner, st[2]) and (ARGV[1] == '' or owner == ARGV[1]) and not run_live
        and not pend_live then
      if not fenced and tonumber(st[5] or 0) > 0 then
        -- The previous run's lease lapsed mid-run: fence it with a new epoch (same owner).
        grant_epoch(KEYS[i])
      end
      redis.call('HSET', KEYS[i], 'pending', ARGV[3 + q], 'pend_until', now + tonumber(ARGV[2]), 'run', 0)
      out[#out + 1] = q
      out[#out + 1] = owner
      out[#out + 1] = ARGV[3 + q]
    end
  end
end
return out
