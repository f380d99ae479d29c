-- stage.lua: stage rows of one Spark task for one queue (a "run") until the job commits.
-- Nothing staged is visible to consumers: publish_staged.lua moves a committed job's runs into the
-- queue's log, and an aborted job's runs are deleted (or expire).
--
-- KEYS[1]   the run (LIST, mqorder.keys.stage_run): four items per row, in the run's order:
--           sort key, msg id, header JSON, body
-- KEYS[2]   the job's cursor on this queue (HASH, mqorder.keys.stage_cursor): run -> rows of the
--           run already published and trimmed from the list by publish_staged.lua
-- ARGV[1]   position of the first row given (0-based within the run)
-- ARGV[2]   time to live of the run in ms, renewed by every call (a dead job leaves nothing behind)
-- ARGV[3]   the run's name (its Spark partition id)
-- ARGV[4..] n quadruples (sort key, msg id, header, body), in the run's order
-- Returns   {rows staged by this call, run length after it}
--
-- Idempotent by position: a task sorts its partition, so the rows of a run are one deterministic
-- sequence and every attempt of the task (a retry after a failure, a speculative copy running at
-- the same time) sends the same rows at the same positions. Positions already staged are skipped
-- (one variadic RPUSH appends the rest); the ids at those positions must be the ones given, or the
-- input changed between attempts (a non-deterministic DataFrame) and the call fails rather than
-- stage a mix of two inputs.
local start = tonumber(ARGV[1])
local n = (#ARGV - 3) / 4
local trimmed = tonumber(redis.call('HGET', KEYS[2], ARGV[3]) or 0)
local top = trimmed + redis.call('LLEN', KEYS[1]) / 4
if start > top then
  return redis.error_reply('MQORDER_STAGE_GAP run ' .. KEYS[1] .. ' has ' .. top ..
    ' rows; cannot stage from position ' .. start)
end
local skip = math.min(top, start + n) - start
local vfrom, vto = math.max(start, trimmed), start + skip - 1
if vto >= vfrom then
  local have = redis.call('LRANGE', KEYS[1], 4 * (vfrom - trimmed), 4 * (vto - trimmed) + 3)
  for p = vfrom, vto do
    if have[4 * (p - vfrom) + 2] ~= ARGV[3 + 4 * (p - start) + 2] then
      return redis.error_reply('MQORDER_STAGE_MISMATCH row ' .. p .. ' of run ' .. KEYS[1] ..
        ' differs between task attempts: the DataFrame is not deterministic (cache or checkpoint it)')
    end
  end
end
if skip < n then
  redis.call('RPUSH', KEYS[1], unpack(ARGV, 4 + 4 * skip, #ARGV))
end
redis.call('PEXPIRE', KEYS[1], ARGV[2])
redis.call('PEXPIRE', KEYS[2], ARGV[2])
return {n - skip, top + n - skip}
