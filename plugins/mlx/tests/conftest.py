"""Route MLX's float32 products to OpenBLAS before any test module imports MLX
(``musegl_mlx.blas``: MLX binds its BLAS when it is loaded)."""

from musegl_mlx import blas

blas.route()
