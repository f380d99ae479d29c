"""The one compiled part of mqorder: ``mqorder.spark._resp`` (see its source for why).

Everything else is in ``pyproject.toml``. The extension is optional: where it cannot be built (no
C compiler), the install goes on and ``mqorder.spark.resp_pages`` cuts replies with numpy instead.
"""

from setuptools import Extension, setup

setup(ext_modules=[Extension("mqorder.spark._resp", ["mqorder/spark/_resp.c"], optional=True)])
