"""musegl-executorch: ``musegl export`` and the ``executorch`` executor."""
