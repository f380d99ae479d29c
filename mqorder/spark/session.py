"""A Spark session for mqorder, and the registration of the ``mqorder`` format on a session.

Python data sources are registered per session (``spark.dataSource.register``); ``register`` does
it once per session, a classic one or a Spark Connect one (the class is sent to the server by
reference: the server's Python workers import mqorder themselves). Executors run the interpreter
``PYSPARK_PYTHON`` names and import mqorder from it: on ``local[*]`` and on a standalone cluster
of this machine that is this virtualenv (set here when unset); on other machines, install mqorder
there (``pip install 'mqorder[spark]'``) at the same interpreter path.
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

        if is_connect(spark):
            from mqorder.spark.connect_compat import install

            install()  # command streams that carry our workers' metrics (SPARK-59135)

        spark.dataSource.register(MQOrderDataSource)
        setattr(spark, _REGISTERED, True)
    return spark


def is_connect(spark: SparkSession) -> bool:
    """True for a Spark Connect client session (``SparkSession.builder.remote(...)``).

    Such a session has no ``sparkContext`` (no JVM in this process): callers that size jobs from
    it ask ``default_parallelism`` instead.
    """
    return type(spark).__module__.startswith("pyspark.sql.connect")


def default_parallelism(spark: SparkSession) -> int:
    """Task slots to size a job for: the context's ``defaultParallelism`` on a classic session;
    on Spark Connect (no context here) ``spark.default.parallelism`` if the server sets it, else
    ``spark.sql.shuffle.partitions``."""
    if not is_connect(spark):
        return int(spark.sparkContext.defaultParallelism)
    for name in ("spark.default.parallelism", "spark.sql.shuffle.partitions"):
        raw = spark.conf.get(name, None)
        if raw and str(raw).isdigit() and int(raw) > 0:
            return int(raw)
    return 2


def session(app_name: str = "mqorder", master: str | None = None, *, remote: str | None = None,
            **conf: Any) -> SparkSession:
    """``SparkSession`` on ``master`` (or ``MQORDER_SPARK_MASTER``, or ``local[*]``), mqorder registered.

    ``master`` may be ``spark://host:7077`` (a standalone cluster: executors in their own JVMs run
    ``PYSPARK_PYTHON``, set here to this interpreter when unset). ``remote="sc://host:15002"``
    opens a Spark Connect client session instead (no local JVM; ``master`` is the server's).

    ``conf`` entries are Spark settings with ``_`` for ``.`` left as given (pass
    ``{"spark.sql.shuffle.partitions": "8"}`` as ``**{...}``).
    """
    if remote is not None:
        if master is not None:
            raise ValueError("give master= (a Spark driver here) or remote= (a Spark Connect server), not both")
        builder = SparkSession.builder.remote(remote)
        # An error keeps the Python traceback that ends with mqorder's message, without the
        # server's JVM stack trace after it (what a classic session shows too).
        conf = {"spark.sql.connect.serverStacktrace.enabled": "false", **conf}
        for k, v in conf.items():
            builder = builder.config(k, str(v))
        return register(builder.getOrCreate())
    os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
    os.environ.setdefault("PYSPARK_DRIVER_PYTHON", sys.executable)
    builder = SparkSession.builder.appName(app_name).master(master or os.environ.get("MQORDER_SPARK_MASTER")
                                                               or DEFAULT_MASTER)
    for k, v in conf.items():
        builder = builder.config(k, str(v))
    return register(builder.getOrCreate())
