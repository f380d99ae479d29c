-- send.lua: append messages to one queue's log (idempotently when ids are given) and wake the
-- owner of every subscription that has no ConsumeRequest pending. Both steps are the prelude's
-- (_append.lua), shared with every other script that stores messages.
--
-- KEYS[1]      queue log (STREAM), entry ids "<offset>-1"
-- KEYS[2]      queue next-offset counter (STRING)
-- KEYS[3]      queue ids (HASH msg id -> offset), read and written only when idempotent; in
--              mode '2' the queue's dedup window instead (HASH dedup key -> offset)
-- KEYS[4..]    state HASH of each subscription of the topic on this queue (mode '2': KEYS[5..],
--              KEYS[4] being the window's expiry ZSET, dedup key -> expiry ms)
-- ARGV[1]      n, the number of messages
-- ARGV[2]      '1': idempotent (ids given), '0': not, '2': idempotent within a dedup window
--              (the producer's dedup keys: see append_entries), whose length in ms is ARGV[3]
-- ARGV[3..]    n pairs (header JSON, body bytes), or n triples (id, header, body) when idempotent
--              (mode '2': from ARGV[4])
-- then         pending_ttl_ms, wake channel prefix, and per state key: token, wake payload
-- Returns      {first_offset, store_ms, stored, {index, offset per duplicate...}, woken owner...}
-- Replacing a token whose run lease lapsed mid-run also increments the epoch (see wake_owners).
-- State HASH fields: see mqorder.keys.sub_state.
--- @include "_now"
--- @include "_append"
local n = tonumber(ARGV[1])
local windowed = ARGV[2] == '2'
local idempotent = ARGV[2] == '1' or windowed
local base, k0, window = 2, 4, nil
if windowed then
  base, k0, window = 3, 5, {k_exp = KEYS[4], ms = tonumber(ARGV[3])}
end
local first, stored, dups = append_entries(KEYS[1], KEYS[2], KEYS[3], n, idempotent, base, nil, window)
local a = base + 1 + (idempotent and 3 or 2) * n
local out = {first, now, stored, dups}
if stored > 0 then
  for _, owner in ipairs(wake_owners(k0, tonumber(ARGV[a]), ARGV[a + 1], a + 1)) do
    out[#out + 1] = owner
  end
end
return out
