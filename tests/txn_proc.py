"""A producer process the transaction tests kill -9 between phase one and phase two.

    python -m tests.txn_proc TOPIC KEY SEQ LOCAL_STATE MARKER

Its local transaction records ``local:<msg id> = LOCAL_STATE`` (unless ``-``), writes the msg id
to MARKER, and then hangs: the process dies there, with its half message stored and no phase two.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import redis

from mqorder.client.transaction import TransactionProducer


def main() -> None:
    topic, key, seq, local_state, marker = sys.argv[1:6]
    producer = TransactionProducer()
    r = redis.Redis.from_url(producer.settings.redis_url)

    def executor(msg, arg):
        if local_state != "-":
            r.set(f"local:{msg.msg_id}", local_state)
        # Written under another name and renamed: the test sees the marker only once it holds the
        # whole id (it read an empty file under load once, and waited for a transaction "").
        Path(marker + ".tmp").write_text(msg.msg_id)
        Path(marker + ".tmp").rename(marker)
        time.sleep(600)  # killed here: between phase one and phase two

    producer.send_in_transaction(topic, json.dumps({"k": key, "s": int(seq)}).encode(), sharding_key=key,
                                 executor=executor)


if __name__ == "__main__":
    main()
