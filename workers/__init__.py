"""The reference Celery application: ``celery -A workers.app worker|beat|flower``."""
