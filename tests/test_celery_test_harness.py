"""mqorder under Celery's own test harness (``celery.contrib.testing.worker.start_worker``), the way
a Celery user tests their app in process: the ConsumeRequest task took its client id from
``request.hostname``, which that harness sets to the bare host name, not the worker's node name
that owns the queues; every run then handed its queue "to the owner", itself, again (3,261 tasks in
20 s, nothing consumed; a Celery user's walk-through). The harness runs in a process of its own:
it makes its app the current one."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

from tests.support import ROOT

SCRIPT = textwrap.dedent("""
    import sys, time
    from celery import Celery
    from celery.contrib.testing.worker import start_worker
    from mqorder import ConsumeOrderlyStatus, Producer
    from mqorder.celery import install
    from mqorder.consumer.listener import orderly_listener
    from mqorder.settings import load_settings

    url = sys.argv[1]
    seen = {}

    @orderly_listener(topic="harness-t", group="harness-g")
    def handle(msgs, ctx):
        for m in msgs:
            key, seq = m.body.decode().split(":")
            seen.setdefault(key, []).append(int(seq))
        return ConsumeOrderlyStatus.SUCCESS

    settings = load_settings(redis_url=url)
    app = Celery("harness", broker=url, set_as_current=False)
    install(app, settings)
    producer = Producer(settings=settings)
    producer.create_topic("harness-t", queues=2)
    with start_worker(app, perform_ping_check=False, shutdown_timeout=20):
        for seq in range(10):
            for key in ("a", "b", "c"):
                producer.send_orderly("harness-t", f"{key}:{seq}".encode(), sharding_key=key)
        deadline = time.time() + 30
        while sum(map(len, seen.values())) < 30 and time.time() < deadline:
            time.sleep(0.1)
    producer.close()
    print(sorted(seen.items()))
""")


def test_listeners_consume_in_order_under_celerys_start_worker(redis_url: str, tmp_path: Path) -> None:
    script = tmp_path / "harness.py"
    script.write_text(SCRIPT)
    done = subprocess.run([sys.executable, str(script), redis_url], cwd=ROOT, capture_output=True, text=True,
                          timeout=90, check=False)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.strip().splitlines()[-1] == str([(k, list(range(10))) for k in ("a", "b", "c")]), (
        done.stdout[-2000:], done.stderr[-2000:])


BAD_REQUESTS = textwrap.dedent("""
    import logging, sys
    logging.basicConfig(level=logging.ERROR, stream=sys.stdout, format="%(message)s")
    from celery import Celery
    from mqorder.celery import install
    from mqorder.settings import load_settings

    app = Celery("bad", broker=sys.argv[1], set_as_current=False)
    install(app, load_settings(redis_url=sys.argv[1]))
    task = app.tasks["mqorder.consume_request"]
    for args in ([1, 2], [123, ["x"], {"a": 1}], []):
        print("RESULT", task.apply(args=args).result)
""")


def test_a_consume_request_with_arguments_mqorder_never_sends_is_refused_in_words(redis_url: str) -> None:
    """An adversarial walk-through: hand-made ``mqorder.consume_request`` messages gave bare
    tracebacks ("missing 1 required positional argument", "'list' object has no attribute
    'split'") from deep inside. Run in a process of its own (its app)."""
    done = subprocess.run([sys.executable, "-c", BAD_REQUESTS, redis_url], cwd=ROOT, capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr[-800:]
    assert done.stdout.count("RESULT {'verb': 'BAD_REQUEST'}") == 3, done.stdout
    assert "got arguments (123, ['x'], {'a': 1}), not (subscription, queue key, token) strings" in done.stdout
