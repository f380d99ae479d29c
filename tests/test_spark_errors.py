"""``mqorder.spark.errors.mqorder_error``: mqorder's exception out of the text of a Spark error.

The texts are the shapes Spark gives (a data source's Python traceback inside an
``AnalysisException``, followed by Spark's tail); the cluster and Connect tests check the real
thing end to end (``tests/spark_checks.py``: ``check_refusals``).
"""

from __future__ import annotations

import pytest

pytest.importorskip("pyspark")

from mqorder.errors import ConfigError, MQOrderError, TopicNotFoundError
from mqorder.spark.errors import mqorder_error
from mqorder.spark.writer import JobRefusedError

TRACEBACK = """[PYTHON_DATA_SOURCE_ERROR] Failed to initialize Python data source writer: Traceback (most recent call last):
  File "mqorder/spark/source.py", line 45, in writer
    return self.writer_class(self._plan(schema, overwrite))
{chained}mqorder.{cls}: {message}
 SQLSTATE: 38000

JVM stacktrace:
org.apache.spark.sql.AnalysisException
\tat org.apache.spark.sql.errors.QueryCompilationErrors$.pythonDataSourceError(QueryCompilationErrors.scala:3200)
"""


def _spark_error(cls: str, message: str, chained: str = "") -> Exception:
    return Exception(TRACEBACK.format(cls=cls, message=message, chained=chained))


def test_the_raised_mqorder_error_comes_back_as_itself() -> None:
    err = mqorder_error(_spark_error("errors.TopicNotFoundError", "topic 'nope' does not exist; create it first"))
    assert isinstance(err, TopicNotFoundError) and str(err) == "topic 'nope' does not exist; create it first"
    err = mqorder_error(_spark_error("spark.writer.JobRefusedError", "nothing of this job was published: 3 rows "
                                     "have a null key ('k')"))
    assert isinstance(err, JobRefusedError) and "3 rows have a null key" in str(err)


def test_the_last_error_of_a_chain_wins_and_a_message_may_span_lines() -> None:
    chained = ("mqorder.errors.TopicNotFoundError: first\n\nDuring handling of the above exception, another "
               "exception occurred:\n\nTraceback (most recent call last):\n  File \"x.py\", line 1, in f\n")
    err = mqorder_error(_spark_error("errors.ConfigError", "key column 'c' is not in the DataFrame\nits columns: a, b",
                                     chained))
    assert isinstance(err, ConfigError) and str(err) == "key column 'c' is not in the DataFrame\nits columns: a, b"


def test_no_mqorder_line_gives_none_and_an_unknown_class_keeps_its_name() -> None:
    assert mqorder_error(Exception("[UNRESOLVED_COLUMN] A column `x` cannot be resolved.")) is None
    err = mqorder_error(_spark_error("errors.NoSuchThingError", "gone"))
    assert type(err) is MQOrderError and str(err) == "NoSuchThingError: gone"
