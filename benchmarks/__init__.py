"""`make bench`: measured figures for the README (speed and memory goals live here, not in tests).

Shared code is in benchmarks/harness.py; the suites import it and never each other."""
