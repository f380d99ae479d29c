"""Order events → enriched, re-keyed by customer → another topic, on mqorder's source and sink.

``spark-pipelines run`` imports this file with ``spark`` (a Spark Connect session) in its
globals. The source topic's messages carry JSON bodies ``{"order_id", "customer", "seq", "amount",
"ts"}`` and are keyed by order: one order's events live in one queue, in the order they were sent.
The flow re-keys them by customer, ordered by ``ts`` within each micro-batch; micro-batches follow
the source queues' offsets, so each order's events reach the sink topic in the order they were
sent, end to end. The sink is a micro-batch ``format("mqorder")`` write: all or nothing per
micro-batch, and a micro-batch replayed after a failure stores nothing twice.
"""

import os

from pyspark import pipelines as dp
from pyspark.sql import SparkSession
from pyspark.sql import functions as F

import mqorder.spark

spark: SparkSession = globals()["spark"]  # given by spark-pipelines
mqorder.spark.register(spark)


def setting(name: str, default: str = "") -> str:
    """``mqorder.<name>`` of the pipeline spec's ``configuration``."""
    return spark.conf.get(f"mqorder.{name}", default) or default


SOURCE = setting("source", "orders")
SINK = setting("sink", "orders-by-customer")
#: Where Redis is: the spec's mqorder.redisUrl, else this process's MQORDER_REDIS_URL, else the server's.
REDIS = setting("redisUrl", os.environ.get("MQORDER_REDIS_URL", ""))
CONNECTION = {"redisUrl": REDIS} if REDIS else {}
EVENT = "order_id STRING, customer STRING, seq INT, amount DOUBLE, ts BIGINT"

dp.create_sink(
    "orders_by_customer",
    format="mqorder",
    options={"topic": SINK, "key": "customer", "orderBy": "ts", "body": "json", **CONNECTION},
)


@dp.append_flow(target="orders_by_customer")
def enrich_and_rekey():
    events = (spark.readStream.format("mqorder").options(**CONNECTION).option("topic", SOURCE)
              .option("startingOffsets", "earliest")
              .option("maxOffsetsPerTrigger", setting("maxOffsetsPerTrigger", "10000")).load())
    e = F.from_json(F.col("body").cast("string"), EVENT)
    return (events.select(e.alias("e"), "queue", "offset")
            .select("e.*", F.struct(F.lit(SOURCE).alias("topic"), "queue", "offset").alias("source"))
            .withColumn("amount_band", F.when(F.col("amount") >= 100, "large")
                        .when(F.col("amount") >= 20, "medium").otherwise("small")))
