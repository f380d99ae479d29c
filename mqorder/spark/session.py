"""A Spark session for mqorder, and the registration of the ``mqorder`` format on a session.

Python data sources are registered per session (``spark.dataSource.register``); ``register`` does
it once per session. Executors run the interpreter ``PYSPARK_PYTHON`` names and import mqorder from
it: on ``local[*]`` that is this virtualenv (set here when unset); on a cluster, install mqorder on
the executors or ship it with ``spark.sparkContext.addPyFile``.
"""

from __future__ import annotations

import os
import sys
from typing import Any

from pyspark.sql import SparkSession

#: The master when none is given: ``MQORDER_SPARK_MASTER``, else every local core.
DEFAULT_MASTER = "local[*]"
_REGISTERED = "_mqorder_registered"


def register(spark: SparkSession) -> SparkSession:
    """Register ``format("mqorder")`` on ``spark`` (idempotent); returns the session."""
    if not getattr(spark, _REGISTERED, False):
        from mqorder.spark.source import MQOrderDataSource

        spark.dataSource.register(MQOrderDataSource)
        setattr(spark, _REGISTERED, True)
    return spark


def session(app_name: str = "mqorder", master: str | None = None, **conf: Any) -> SparkSession:
    """``SparkSession`` on ``master`` (or ``MQORDER_SPARK_MASTER``, or ``local[*]``), mqorder registered.

    ``conf`` entries are Spark settings with ``_`` for ``.`` left as given (pass
    ``{"spark.sql.shuffle.partitions": "8"}`` as ``**{...}``).
    """
    os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
    os.environ.setdefault("PYSPARK_DRIVER_PYTHON", sys.executable)
    builder = SparkSession.builder.appName(app_name).master(master or os.environ.get("MQORDER_SPARK_MASTER")
                                                               or DEFAULT_MASTER)
    for k, v in conf.items():
        builder = builder.config(k, str(v))
    return register(builder.getOrCreate())
