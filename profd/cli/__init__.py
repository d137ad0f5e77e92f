"""The ``profd`` command line: service commands (up / down / status), sessions, traces,
analysis, and the Ray cluster profd starts and stops."""
