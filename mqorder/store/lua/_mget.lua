-- Prelude: MGET of any number of keys. Lua's unpack puts every value on the C stack, which holds a
-- few thousand at most, so the keys go a few hundred per MGET (sweep.lua reads every owned
-- queue's next counter, switch.lua every adopted candidate's).

-- mget_all(names)
--   The values of the keys in list names, in order (false for a missing key).
local function mget_all(names)
  local out = {}
  for c = 1, #names, 500 do
    local got = redis.call('MGET', unpack(names, c, math.min(#names, c + 499)))
    for j = 1, #got do
      out[#out + 1] = got[j]
    end
  end
  return out
end
