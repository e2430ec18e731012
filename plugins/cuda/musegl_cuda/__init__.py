"""musegl-cuda: the Muse Glimmer decoder in PyTorch (CUDA, or CPU without a GPU)."""
