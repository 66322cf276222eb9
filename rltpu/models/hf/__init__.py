"""Hugging Face checkpoints: read a local directory's config.json and safetensors, write them back.

    rltpu.models.hf.config   config.json <-> ``ModelConfig`` (pure Python)
    rltpu.models.hf.weights  streaming safetensors reader: whole tensors or row ranges, one at a time
    rltpu.models.hf.load     the trainer's FSDP shards and the sampler's JAX params from a directory
    rltpu.models.hf.export   a run checkpoint -> a directory ``transformers`` loads
    rltpu.models.hf.tiny     a tiny random checkpoint written by ``transformers`` itself (tests, dry runs)

Nothing here contacts the hub; ``transformers`` is needed only by ``tiny`` (and by users who
load an exported directory).
"""
