"""Configuration of the reference application (settings, Celery config, beat schedule)."""
