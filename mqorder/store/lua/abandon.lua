-- abandon.lua: a run whose process died (a Celery prefork child killed mid-run: the OOM killer,
-- kill -9, `celery control terminate`) gives its queue up now instead of at its run lease (60 s).
--
-- KEYS[1]   the queue's state HASH (one key per call: the calls of one client go in a pipeline,
--           which a Redis Cluster spreads over its slots)
-- ARGV[1]   the dead execution's runner prefix ("<Celery task id>/": engine.run's runner ids)
-- Returns   1 if a live run of that execution was ended here, 0 otherwise
--
-- Only a live run mark written by that execution is touched (its runner id, unique per execution,
-- starts with the prefix), so a run a new request began meanwhile is left alone. The queue gets a
-- new epoch, as the sweep gives a run whose lease lapsed, so whatever the dead execution left in
-- flight is fenced; its run mark and pending token go, and the client's sweep, run right after,
-- dispatches the queue if it has a backlog.
--- @include "_now"
--- @include "_lock"
local st = redis.call('HMGET', KEYS[1], 'run', 'runner')
local prefix = ARGV[1]
if not ahead(st[1]) or prefix == '' or string.sub(st[2] or '', 1, #prefix) ~= prefix then
  return 0
end
grant_epoch(KEYS[1])
redis.call('HSET', KEYS[1], 'run', 0, 'pending', '', 'pend_until', 0)
return 1
