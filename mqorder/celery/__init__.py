"""Celery integration: tasks, the worker bootstep and the beat schedule.

``install(app)`` is all an application needs::

    app = Celery("workers")
    mqorder.celery.install(app)

(the stock apps, ``mqorder.app`` and the checkout's ``workers.app``, do exactly this).
"""

from mqorder.celery.setup import install

__all__ = ["install"]
