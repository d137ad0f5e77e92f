"""``profd demo``: a small RL-style job on a private Ray, profiled over HTTP end to end."""
