"""What the exporter reads of each (group lane, queue), a few hundred lanes per read-only script.

Per lane the exporter needs the queue's next offset, the lane's state hash and, when it has a
backlog, its head message's store time and reconsume count (and in key mode how many messages are
parked): four to six commands. As plain pipelined commands that was 40,000 replies at 10,000
queues, each read and turned into a Python object one by one, and then judged in Python: on the
benchmark machine most of a scrape. ``LANES_LUA`` does the same reads inside Redis for up to
``BATCH`` lanes and returns eleven numbers per lane, already judged by that Redis's clock, so a
scrape of 10,000 lanes is a few dozen replies (``bench/RESULTS.md``, "Exporter scrape").

The script writes nothing and is sent with ``EVAL`` (no registration: it is cached by Redis like
any script), a batch per hash slot on a Redis Cluster (``Broker.slot_batches``: a script's keys
must share a slot), all batches of a broker in the exporter's one round trip
(``clocked_reads``). A batch holds Redis for about as long as its commands would take pipelined,
and other clients run between batches. ``XRANGE`` cannot leave fields out: the head's body is copied into the script too, so a
queue of large messages costs a copy of one body per lane with a backlog and scrape (never sent
to the exporter, unlike a pipelined ``XRANGE``).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, NamedTuple

from mqorder import keys
from mqorder.model import MessageQueue
from mqorder.store.brokers import Broker
from mqorder.store.replies import text

#: Lanes per script call: a few ms of Redis time each, at most.
BATCH = 200

#: KEYS, four per lane: state HASH (``keys.sub_state``), next counter, log STREAM, retries HASH.
#: Returns per lane, flat: next offset, live owner ('' if none), epoch, committed offset, running
#: (0/1), key mode (0/1: the ``done`` field only key_commit.lua writes is present), head age ms,
#: stalled ms, head reconsume count, parked messages (key mode: entries of the retries HASH),
#: and where what the lane owes starts: the head's offset (retention may have trimmed the
#: committed one and more: those are not owed, as ``mqorder status`` counts), the next offset when
#: nothing at or above the committed one is stored, else the committed offset.
#: The head is the first entry at or above the committed offset (retention may have trimmed
#: that one); its ``s`` field is its store time. Stalled: since the later of the offset's last
#: move (``commit_ms``) and the head's store time (``mqorder.admin.status.waiting_ms``'s rule).
LANES_LUA = """
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local out = {}
local n = 0
for i = 1, #KEYS, 4 do
  local st = redis.call('HMGET', KEYS[i], 'owner', 'lease', 'epoch', 'offset', 'run', 'commit_ms', 'done')
  local nxt = tonumber(redis.call('GET', KEYS[i + 1]) or 0)
  local owner = st[1] or ''
  if owner ~= '' and tonumber(st[2] or 0) <= now then owner = '' end
  local committed = tonumber(st[4] or 0)
  local running = 0
  if tonumber(st[5] or 0) > now then running = 1 end
  local key_mode = 0
  if st[7] then key_mode = 1 end
  local age, stalled, retries, parked = 0, 0, 0, 0
  local owed_from = committed
  if nxt > committed then
    local head = redis.call('XRANGE', KEYS[i + 2], committed, '+', 'COUNT', 1)
    owed_from = nxt
    if head[1] then
      owed_from = tonumber(string.match(head[1][1], '^(%d+)')) or committed
      local f = head[1][2]
      local stored = 0
      for j = 1, #f, 2 do
        if f[j] == 's' then stored = tonumber(f[j + 1]) or 0 end
      end
      if stored > 0 then age = math.max(0, now - stored) end
      local since = math.max(tonumber(st[6] or 0) or 0, stored)
      if since > 0 then stalled = math.max(0, now - since) end
      if tonumber(string.match(head[1][1], '^(%d+)')) == committed then
        retries = tonumber(redis.call('HGET', KEYS[i + 3], committed) or 0) or 0
      end
      if key_mode == 1 then parked = redis.call('HLEN', KEYS[i + 3]) end
    end
  end
  out[n + 1] = nxt
  out[n + 2] = owner
  out[n + 3] = st[3] or '0'
  out[n + 4] = committed
  out[n + 5] = running
  out[n + 6] = key_mode
  out[n + 7] = age
  out[n + 8] = stalled
  out[n + 9] = retries
  out[n + 10] = parked
  out[n + 11] = owed_from
  n = n + 11
end
return out
"""

Lane = tuple[str, MessageQueue]


class LaneReading(NamedTuple):
    """One lane, as ``LANES_LUA`` judged it (times in ms by the clock of its Redis)."""

    next_offset: int
    owner: str  # the holder of a live lock, "" if none
    epoch: int
    committed: int
    running: bool
    key_mode: bool
    head_age_ms: int
    stalled_ms: int
    head_retries: int
    parked: int
    owed_from: int

    @property
    def lag(self) -> int:
        """Messages the lane still owes: from the committed offset, or from the first one stored
        above it when retention trimmed the rest (those are gone, not owed: a lag that counted them
        stayed above 0 for good for a group without consumers, and its alert never resolved)."""
        return max(0, self.next_offset - max(self.committed, self.owed_from))


def lane_batches(store: Broker, lanes: Sequence[Lane]) -> list[list[Lane]]:
    """``lanes`` in script batches: at most ``BATCH`` each, one hash slot each on a cluster."""
    return [chunk for slot in store.slot_batches(lanes, lambda ln: ln[1].tag)
            for chunk in (slot[i:i + BATCH] for i in range(0, len(slot), BATCH))]


def lanes_command(batch: Sequence[Lane]) -> tuple[object, ...]:
    """The ``EVAL`` of ``LANES_LUA`` over ``batch``."""
    ks: list[str] = []
    for sub, mq in batch:
        tag = mq.tag
        ks += (keys.sub_state(tag, sub), keys.queue_next(tag), keys.queue_log(tag), keys.sub_retries(tag, sub))
    return ("EVAL", LANES_LUA, len(ks), *ks)


def parse_lanes(flat: Sequence[Any]) -> list[LaneReading]:
    """``LANES_LUA``'s reply, eleven values per lane, in the batch's order."""
    return [LaneReading(int(flat[j]), text(flat[j + 1]), int(flat[j + 2]), int(flat[j + 3]), flat[j + 4] == 1,
                        flat[j + 5] == 1, int(flat[j + 6]), int(flat[j + 7]), int(flat[j + 8]), int(flat[j + 9]),
                        int(flat[j + 10]))
            for j in range(0, len(flat), 11)]
