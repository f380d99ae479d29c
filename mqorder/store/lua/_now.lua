-- Prelude: the current time in milliseconds by Redis's own clock, so leases are never judged by a
-- worker's clock. Included (store/scripts.py) by every script and prelude that reads `now`.
local __t = redis.call('TIME')
local now = tonumber(__t[1]) * 1000 + math.floor(tonumber(__t[2]) / 1000)

-- ahead(ms): a deadline field (lease, run) is still in the future by Redis's clock. A missing
-- field (nil, or false from HMGET) counts as 0: never set, so never live.
local function ahead(ms)
  return tonumber(ms or 0) > now
end
