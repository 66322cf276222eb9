"""What ``transformers`` says about a model directory of any architecture, without its weights.

``param_shapes_of``: parameter name -> shape as ``AutoModelForCausalLM`` holds them (tied weights
once), from a ``meta``-device build of the directory's config.json. For ``model.architecture:
other`` (``trainer.model_impl: hf``) this is the weight-sync spec: exactly the names and shapes the
trainer's model has, which ``rltpu.models.spec.param_shapes`` can only derive for the Llama family.
"""

from __future__ import annotations

import functools


@functools.lru_cache(maxsize=8)
def param_shapes_of(path: str) -> dict[str, tuple[int, ...]]:
    import os

    import torch

    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import transformers

    config = transformers.AutoConfig.from_pretrained(path)
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(config)
    return {n: tuple(p.shape) for n, p in model.named_parameters()}
