"""Django settings of the test project the worker's Django fixup is tested with
(``tests/test_django.py``): sqlite, Django's default ``CONN_MAX_AGE`` (0: a connection per unit of
work), and the auth app so a listener module can import models."""

import os

SECRET_KEY = "mqorder-tests"
INSTALLED_APPS = ["django.contrib.contenttypes", "django.contrib.auth"]
DATABASES = {"default": {"ENGINE": "django.db.backends.sqlite3", "NAME": os.environ.get("MQORDER_TEST_DJANGO_DB", ":memory:")}}
USE_TZ = True
