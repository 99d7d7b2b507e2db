"""`make bench`: measured figures for the README (speed and memory goals live here, not in tests)."""

# What a suite's main() returns: 0 every goal met; GOALS_MISSED some goal not met on this machine
# (reported in its table, not a failure); BENCH_ERROR the suite could not measure (missing fio, a
# child that failed), which makes `python -m benchmarks` exit nonzero.
GOALS_MISSED = 1
BENCH_ERROR = 2
