"""Orderly consumption: listeners, context, hooks, stats and the ConsumeRequest engine.

Nothing here imports Celery: the Celery tasks in ``mqorder.celery`` only carry a ConsumeRequest's
outcome (re-queue with a countdown, hand over, dispatch) to the right worker.
"""
