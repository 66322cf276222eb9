"""One Llama-style decoder written twice: torch (``torch_llama``, trainer) and JAX (``jax_llama``,
sampler), the parameter list both share (``spec``), and Hugging Face checkpoints (``hf``)."""
