"""What runs in a job's driver: the single-controller step announcer, launch-time sessions,
and verl's profiler configuration.
"""
