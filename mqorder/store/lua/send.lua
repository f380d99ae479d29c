-- send.lua: append messages to one queue's log (idempotently when ids are given) and wake the
-- owner of every subscription that has no ConsumeRequest pending. Both steps are the prelude's
-- (_append.lua), shared with every other script that stores messages.
--
-- KEYS[1]      queue log (STREAM), entry ids "<offset>-1"
-- KEYS[2]      queue next-offset counter (STRING)
-- KEYS[3]      queue ids (HASH msg id -> offset), read and written only when idempotent
-- KEYS[4..]    state HASH of each subscription of the topic on this queue
-- ARGV[1]      n, the number of messages
-- ARGV[2]      '1': idempotent (ids given), '0': not
-- ARGV[3..]    n pairs (header JSON, body bytes), or n triples (id, header, body) when idempotent
-- then         pending_ttl_ms, wake channel prefix, and per state key: token, wake payload
-- Returns      {first_offset, store_ms, stored, {index, offset per duplicate...}, woken owner...}
-- Replacing a token whose run lease lapsed mid-run also increments the epoch (see wake_owners).
-- State HASH fields: see mqorder.keys.sub_state.
local n = tonumber(ARGV[1])
local idempotent = ARGV[2] == '1'
local first, stored, dups = append_entries(KEYS[1], KEYS[2], KEYS[3], n, idempotent, 2)
local a = 3 + (idempotent and 3 or 2) * n
local out = {first, now, stored, dups}
if stored > 0 then
  for _, owner in ipairs(wake_owners(4, tonumber(ARGV[a]), ARGV[a + 1], a + 1)) do
    out[#out + 1] = owner
  end
end
return out
