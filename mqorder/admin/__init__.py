"""The operator's side of mqorder (RocketMQ's ``mqadmin``), one module per command group.

``topics`` (create, list, describe, delete), ``status`` (per-queue progress of a group, stuck
queues), ``consumers`` (live clients of a group), ``dlq`` (list, show, replay the dead letters),
``offsets`` (fenced reset), ``messages`` (show by queue and offset, or by msg id) and ``produce``
(JSON lines from a file or stdin). Each returns plain dataclasses with a ``to_json()``, so the
command line (``mqorder.cli``) only renders them and tests call them without a terminal.

Everything here reads and writes Redis directly and imports nothing from Celery: an operator's
laptop needs no worker code to inspect or repair a cluster.
"""
