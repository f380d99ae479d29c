"""A Django project's listener module (``tests/test_django.py``): it imports models at the top, as
a project's listeners do (``AppRegistryNotReady`` before ``django.setup()``), and writes one row
per message with Django's connection: a plain key-mode listener on the lane threads, an ``async
def`` one through ``sync_to_async`` (asgiref's thread-sensitive thread), as Django's async ORM does.

A database restart is simulated from ``ctl:<group>``'s ``drop_at`` (a time): a connection opened
before it has its DB-API connection closed under Django, as a server that went away leaves it;
Django only notices when its connection is closed and opened again."""

from __future__ import annotations

import json
import time

from asgiref.sync import sync_to_async
from django.contrib.auth.models import User  # noqa: F401 - a models import, as a project's listeners have
from django.db import connection

from mqorder import ConsumeOrderlyStatus, orderly_listener
from tests.listeners import r


def _write(group: str, msgs) -> None:
    drop_at = float(r().hget(f"ctl:{group}", "drop_at") or 0)
    connection.ensure_connection()
    if getattr(connection, "_mq_raw", None) is not connection.connection:
        connection._mq_raw = connection.connection
        connection._mq_opened = time.time()
    if drop_at and connection._mq_opened < drop_at:
        connection.connection.close()  # the server went away: Django's wrapper still holds it
    with connection.cursor() as cur:
        for m in msgs:
            body = json.loads(m.body)
            cur.execute("INSERT INTO handled (k, s) VALUES (%s, %s)", [f"{group}/{body['k']}", body["s"]])


@orderly_listener(topic="t-django", group="g-django", ordering="key", key_concurrency=4, max_reconsume_times=3,
                  suspend_current_queue_time_millis=200)
def write_rows(msgs, ctx):
    _write("g-django", msgs)
    return ConsumeOrderlyStatus.SUCCESS


@orderly_listener(topic="t-django-async", group="g-django-async", ordering="key", key_concurrency=4,
                  max_reconsume_times=3, suspend_current_queue_time_millis=200)
async def write_rows_async(msgs, ctx):
    await sync_to_async(_write)("g-django-async", msgs)
    return ConsumeOrderlyStatus.SUCCESS
