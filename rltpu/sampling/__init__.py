"""The sampling engine: compiled JAX generation over a fixed grid of shapes (``engine``)."""
