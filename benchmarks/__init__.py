"""`make bench`: measured figures for the README (speed and memory goals live here, not in tests)."""
