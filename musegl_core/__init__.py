"""musegl: a serving framework for Meta's Muse Glimmer models.

The core package holds the engine (scheduler, KV bookkeeping, sessions), the
worker process, the HTTP front, the chat protocol and the plugin hooks. Model
execution lives in executor plugins (``plugins/cuda``, ``plugins/mlx``).
"""

__version__ = "0.1.0"
