"""The mqorder settings of a Celery app: the ones ``install(app, settings)`` was given.

The bootstep, the tasks and the engines of a worker read them from the app, not from the
environment alone: an application that passed ``install(app, load_settings(redis_url=...))``
had its broker and listeners from those settings while its worker's consumer joined the
environment's Redis (by default ``redis://127.0.0.1:6379/0``) and consumed nothing.
"""

from __future__ import annotations

from celery import Celery, current_app

from mqorder.settings import Settings, get_settings

#: The attribute of the Celery app that holds them (an attribute, not ``app.conf``: Celery's
#: ``inspect conf`` would try to print a settings object).
ATTRIBUTE = "mqorder_settings"


def remember(app: Celery, settings: Settings) -> None:
    setattr(app, ATTRIBUTE, settings)


def settings_of(app: Celery | None = None) -> Settings:
    """The settings ``install`` gave ``app`` (the current app by default), else the environment's."""
    found = getattr(app if app is not None else current_app, ATTRIBUTE, None)
    return found if isinstance(found, Settings) else get_settings()
