"""Harnesses that start real servers and processes for the tests, the benchmarks, the chaos runs
and the demo: a throw-away ``redis-server`` (``embedded``), ``celery worker``/``beat``
subprocesses (``launcher``) and a throw-away RabbitMQ vhost (``rabbit_vhost``).

They live apart from the library proper because no application code uses them: an application
runs against its own Redis and its own Celery workers. ``mqorder.demo`` uses them because the demo
is exactly such a throw-away run.
"""
