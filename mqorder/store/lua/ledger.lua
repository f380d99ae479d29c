-- ledger.lua: append the consumption ledger records of one pulled batch, in one command.
--
-- The ledger is opt-in (MQORDER_LEDGER=1 or @orderly_listener(ledger=True)): one stream entry per
-- handled message, in a stream per group and broker, trimmed to about ARGV[1] entries. It is
-- pipelined behind the batch's fenced commit, so it costs one command per pulled batch, not one
-- per message. It touches only its own key (Cluster-safe).
--
-- KEYS[1] ledger STREAM
-- ARGV[1] max length (approximate trim)   ARGV[2..] one JSON record per handled message
-- Returns the number of records written
for i = 2, #ARGV do
  redis.call('XADD', KEYS[1], 'MAXLEN', '~', ARGV[1], '*', 'r', ARGV[i])
end
return #ARGV - 1
