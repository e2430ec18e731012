"""musegl-mlx: the Muse Glimmer decoder in MLX behind the executor contract (docs/mlx.md)."""
