"""Benchmarks of mqorder against a raw ceiling and naive Celery baselines (``make bench``).

Everything is measured in one run on the current machine; ``python -m bench.run`` writes
``bench/RESULTS.md``. See ``bench/run.py`` for the sections and ``--quick`` / ``--only``,
``bench/targets.py`` for every target and its threshold, ``bench/report.py`` for the document.
"""
