"""Shared contracts of profd's parts: request models, settings, messages, states, views,
errors, naming, files, schedules, and the one module that knows the Ray environment.

Nothing here imports Ray or torch at module level.
"""
