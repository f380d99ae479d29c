"""The ``mqorder`` data source: ``format("mqorder")`` for batch and streaming reads and writes.

Spark creates it from the options wherever it needs a reader or a writer (a Python process it
starts for planning): every check that needs only the options, the schema and the topic's route
happens there, before any task runs.
"""

from __future__ import annotations

from pyspark.sql.datasource import DataSource, DataSourceReader, DataSourceStreamReader, DataSourceStreamWriter
from pyspark.sql.types import StructType

from mqorder.spark.ledger import LEDGER_SCHEMA_DDL, LedgerReader, ledger_options
from mqorder.spark.options import reachable, read_options, write_options
from mqorder.spark.plan import WritePlan, build_plan
from mqorder.spark.reader import SCHEMA_DDL, MQOrderReader, queue_spans
from mqorder.spark.streaming import MQOrderStreamReader
from mqorder.spark.worker_gc import freeze_imports
from mqorder.spark.writer import MQOrderStreamWriter, MQOrderWriter


class MQOrderDataSource(DataSource):
    #: The writer classes; a subclass may swap them (the failure-injection tests do).
    writer_class: type[MQOrderWriter] = MQOrderWriter
    stream_writer_class: type[MQOrderStreamWriter] = MQOrderStreamWriter

    @classmethod
    def name(cls) -> str:
        return "mqorder"

    def schema(self) -> str:
        freeze_imports()  # the first call in a reused planning worker (no-op elsewhere)
        if "ledger" in self.options:
            return LEDGER_SCHEMA_DDL
        return SCHEMA_DDL

    def _plan(self, schema: StructType, overwrite: bool) -> WritePlan:
        freeze_imports()
        opts = write_options(self.options)
        brokers = opts.conn.registry()
        try:
            queues = queue_spans(brokers, opts.topic)
        finally:
            brokers.close()
        return build_plan(opts, schema, queues, overwrite=overwrite)

    def writer(self, schema: StructType, overwrite: bool) -> MQOrderWriter:
        with reachable("planning the write"):
            return self.writer_class(self._plan(schema, overwrite))

    def streamWriter(self, schema: StructType, overwrite: bool) -> DataSourceStreamWriter:
        with reachable("planning the stream's writes"):
            return self.stream_writer_class(self._plan(schema, overwrite))

    def reader(self, schema: StructType) -> DataSourceReader:
        freeze_imports()
        with reachable("planning the read"):
            if "ledger" in self.options:
                return LedgerReader(ledger_options(self.options), schema)
            return MQOrderReader(read_options(self.options, streaming=False))

    def streamReader(self, schema: StructType) -> DataSourceStreamReader:
        freeze_imports()
        with reachable("planning the stream's reads"):
            return MQOrderStreamReader(read_options(self.options, streaming=True))
