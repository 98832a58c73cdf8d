"""Helpers shared by the tests, imported as plain modules (pyproject.toml puts tests/ on sys.path): paths, data and
config files, tiny models, and launching training as real subprocesses. Fixtures stay in the conftest.py files."""
