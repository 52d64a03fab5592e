"""What the tests share: builders of tiny checkpoints and engines, processes and their reaping, fake
peers on real sockets, and launched or in-process runs.

Test modules import from here (``from helpers.engines import make_engine``) and never from one
another; pyproject's ``[tool.pytest.ini_options] pythonpath`` puts ``tests/`` (and ``benchmarks/``,
for ``tiny_model``) on ``sys.path``, so the import works from any test folder under
``--import-mode=importlib``. Fixtures stay in ``tests/conftest.py``.
"""
