-- stage.lua: stage rows of one Spark task for one queue (a "run") until the job commits.
-- Nothing staged is visible to consumers: publish_staged.lua moves a committed job's runs into the
-- queue's log, and an aborted job's runs are deleted (or expire).
--
-- KEYS[1]   the run (STREAM, mqorder.keys.stage_run): entry "<position>-1" holds the row at that
--           position, fields k (sort key), i (msg id), h (header JSON), b (body)
-- ARGV[1]   position of the first row given (0-based within the run)
-- ARGV[2]   time to live of the run in ms, renewed by every call (a dead job leaves nothing behind)
-- ARGV[3..] n quadruples (sort key, msg id, header, body), in the run's order
-- Returns   {rows staged by this call, run length after it}
--
-- Idempotent by position: a task sorts its partition, so the rows of a run are one deterministic
-- sequence and every attempt of the task (a retry after a failure, a speculative copy running at
-- the same time) sends the same rows at the same positions. Positions already staged are skipped;
-- the ids at those positions must be the ones given, or the input changed between attempts (a
-- non-deterministic DataFrame) and the call fails rather than stage a mix of two inputs.
local start = tonumber(ARGV[1])
local n = (#ARGV - 2) / 4
local top = -1
local last = redis.call('XREVRANGE', KEYS[1], '+', '-', 'COUNT', 1)
if last[1] then top = tonumber(string.match(last[1][1], '^(%d+)')) end
if start > top + 1 then
  return redis.error_reply('MQORDER_STAGE_GAP run ' .. KEYS[1] .. ' has ' .. (top + 1) ..
    ' rows; cannot stage from position ' .. start)
end
local overlap_end = math.min(top, start + n - 1)
if overlap_end >= start then
  local have = redis.call('XRANGE', KEYS[1], start .. '-1', overlap_end .. '-1')
  for _, e in ipairs(have) do
    local pos = tonumber(string.match(e[1], '^(%d+)'))
    local given = ARGV[3 + 4 * (pos - start) + 1]
    if e[2][4] ~= given then
      return redis.error_reply('MQORDER_STAGE_MISMATCH row ' .. pos .. ' of run ' .. KEYS[1] ..
        ' differs between task attempts: the DataFrame is not deterministic (cache or checkpoint it)')
    end
  end
end
local staged = 0
for pos = math.max(start, top + 1), start + n - 1 do
  local a = 3 + 4 * (pos - start)
  redis.call('XADD', KEYS[1], pos .. '-1', 'k', ARGV[a], 'i', ARGV[a + 1], 'h', ARGV[a + 2], 'b', ARGV[a + 3])
  staged = staged + 1
end
redis.call('PEXPIRE', KEYS[1], ARGV[2])
return {staged, math.max(top + 1, start + n)}
