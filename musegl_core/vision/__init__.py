"""Images: preprocessing on the worker's control thread (numpy + pillow)."""
