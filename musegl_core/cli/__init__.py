"""The ``musegl`` command line."""
