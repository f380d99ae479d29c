"""Importing the ``MQORDER_LISTENERS`` modules: at ``install``, or at the worker's start for a
module that imports the app ``install`` is still configuring.

Why the second: Celery's usual layout has the app in ``proj/celery.py``, re-exported by
``proj/__init__.py`` (``from .celery import app``), and task or listener modules that do ``from
proj import app``. ``install`` runs inside ``proj.celery``'s import, so such a module failed with
"cannot import name 'app' from partially initialized module 'proj'". Celery's own
``autodiscover_tasks`` imports lazily for the same reason. Every other module is still imported
at once, so a stock app stops at its start with one line naming a bad module (``mqorder.app``).
A Django project's listener modules import models, which raise ``AppRegistryNotReady`` before
``django.setup()``: they are deferred the same way (the worker's Django fixup sets Django up
before the bootstep imports them).
"""

from __future__ import annotations

import importlib
import logging
import sys
import traceback

from celery import Celery

from mqorder.errors import ConfigError, MQOrderError

log = logging.getLogger(__name__)

#: The attribute of a Celery app listing the listener modules ``install`` deferred.
DEFERRED = "mqorder_deferred_listeners"


def import_listeners(modules: list[str], app: Celery | None = None) -> None:
    """Import each module now; with ``app``, defer one that is a circular import of the app's
    own module to ``import_deferred``. Anything else that fails raises ``ConfigError``."""
    for name in modules:
        try:
            _import(name)
        except _Circular:
            if app is None:
                raise ConfigError(f"listener module {name!r} (MQORDER_LISTENERS) imports a module that is still "
                                  "being imported (a circular import)") from None
            sys.modules.pop(name, None)  # its half-run import: imported whole at the worker's start
            deferred: list[str] = getattr(app, DEFERRED, None) or []
            deferred.append(name)
            setattr(app, DEFERRED, deferred)
            log.info("mqorder.celery.install: listener module %r needs what is still being set up (the app "
                     "being configured, or Django's app registry); a worker imports it when it starts", name)


def import_deferred(app: Celery) -> None:
    """At the worker's start (``ConsumerClientStep``): import what ``install`` deferred; an error
    raises, and the worker does not start without its listeners."""
    names: list[str] = list(getattr(app, DEFERRED, None) or [])
    setattr(app, DEFERRED, [])
    for name in names:
        try:
            _import(name)
        except _Circular as exc:
            raise ConfigError(f"listener module {name!r} (MQORDER_LISTENERS) cannot be imported: "
                              f"{exc.__cause__}") from None


class _Circular(Exception):
    """The module's import hit a module that was still being imported, or Django's app registry
    before ``django.setup()``."""


def _import(name: str) -> None:
    try:
        importlib.import_module(name)
    except ImportError as exc:
        if "partially initialized module" in str(exc):
            raise _Circular(name) from exc
        raise ConfigError(
            f"MQORDER_LISTENERS names {name!r}, which cannot be imported ({exc}); give "
            "comma-separated module paths importable from the worker's working directory"
        ) from exc
    except Exception as exc:
        if type(exc).__name__ == "AppRegistryNotReady":
            # A Django project: install() runs inside proj/celery.py's import, before django.setup()
            # (the worker's Django fixup calls it later), so a module that imports models raised
            # here, and with it every process importing the project, manage.py migrate included.
            raise _Circular(name) from exc
        if isinstance(exc, MQOrderError):  # a decorator refused its arguments (ListenerError, a bad name)
            raise ConfigError(f"listener module {name!r} (MQORDER_LISTENERS): {exc}") from exc
        # Its own code raised: a traceback inside Celery's "Unable to load" buried it.
        where = traceback.extract_tb(exc.__traceback__)[-1]
        raise ConfigError(f"listener module {name!r} (MQORDER_LISTENERS) raised at import: {type(exc).__name__}: "
                          f"{exc} ({where.filename}:{where.lineno})") from exc
