-- touch.lua: cheap "am I still the owner?" check that also keeps a long-running request's lease
-- and run mark alive (ctx.still_owner(), and before a listener call when the last fenced call is
-- getting old).
--
-- KEYS[1] state HASH
-- ARGV[1] client  ARGV[2] epoch  ARGV[3] token ('' = do not renew)  ARGV[4] run_lease_ms
-- ARGV[5] lock_lease_ms
-- Returns {1 if still owner at that epoch else 0, current epoch, current owner}
local st = redis.call('HMGET', KEYS[1], 'owner', 'epoch', 'pending')
local ok = 0
if st[1] == ARGV[1] and tonumber(st[2] or 0) == tonumber(ARGV[2]) then
  ok = 1
  if ARGV[3] ~= '' and st[3] == ARGV[3] then
    local run_until = now + tonumber(ARGV[4])
    redis.call('HSET', KEYS[1], 'run', run_until, 'pend_until', run_until, 'lease', now + tonumber(ARGV[5]))
  end
end
return {ok, tonumber(st[2] or 0), st[1] or ''}
