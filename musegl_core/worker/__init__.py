"""The worker process (owns the model) and the front's client for it."""
