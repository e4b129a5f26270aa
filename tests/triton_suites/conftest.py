"""Triton's vendored QA files match pytest's ``*_test.py`` pattern but are not the project's
tests: they run only as subprocesses of ``test_triton_suites.py`` (against a given server)."""

collect_ignore = ["vendor", "shim"]
