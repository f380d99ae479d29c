"""The Redis side of mqorder: named brokers, Lua scripts, topic routes and queue logs.

Nothing here imports Celery.
"""
