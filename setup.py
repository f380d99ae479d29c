"""The compiled parts of mqorder (see each source for why): ``mqorder.spark._resp``, which cuts
the Spark readers' replies, and ``mqorder.store._pack``, which packs a round trip's commands.

Everything else is in ``pyproject.toml``. Both extensions are optional: where they cannot be built
(no C compiler), the install goes on, ``mqorder.spark.resp_pages`` cuts replies with numpy and
``mqorder.store.packing`` packs commands with hiredis instead.
"""

from setuptools import Extension, setup

setup(ext_modules=[
    Extension("mqorder.spark._resp", ["mqorder/spark/_resp.c"], optional=True),
    Extension("mqorder.store._pack", ["mqorder/store/_pack.c"], optional=True),
])
