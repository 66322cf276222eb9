"""Which projections the trainer splits for tensor parallelism (Megatron), by Hugging Face name.

Pure Python, so two sides agree without importing each other: ``learner/tp.py`` applies it with
torch's tensor-parallel plans, and ``rltpu.sync.collective`` derives from it which rows of each
tensor a (dp, tp) trainer rank sends.

q/k/v and MLP gate/up are split by output rows (``ColwiseParallel``: each rank holds whole heads,
``num_heads / tp`` and ``num_kv_heads / tp`` of them), ``o_proj`` and ``down_proj`` by input
columns (``RowwiseParallel``: their all-reduce closes the block). Embeddings, the LM head, norms and
``o_proj``'s bias stay whole on every TP rank (FSDP still shards them over dp).
"""

from __future__ import annotations

COLWISE = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "mlp.gate_proj", "mlp.up_proj")
ROWWISE = ("self_attn.o_proj", "mlp.down_proj")


def split_dim(name: str) -> int | None:
    """The dim of parameter ``name`` that tensor parallelism splits: 0 (colwise weight or bias),
    1 (rowwise weight), or None (whole on every TP rank)."""
    module, _, leaf = name.rpartition(".")
    if module.endswith(COLWISE):
        return 0
    if module.endswith(ROWWISE) and leaf == "weight":
        return 1
    return None


def tp_problem(model_cfg, tp: int) -> str:
    """Why the trainer cannot split this model over ``tp`` ranks ("" when it can): one line naming the fix."""
    if tp == 1:
        return ""
    for what, n in (("num_attention_heads", model_cfg.num_attention_heads),
                    ("num_key_value_heads", model_cfg.num_key_value_heads),
                    ("intermediate_size", model_cfg.intermediate_size)):
        if n % tp:
            return (f"placement.chips_per_trainer={tp}: model.{what}={n} is not divisible by {tp}, so the trainer "
                    f"cannot split it over {tp} tensor-parallel ranks; set placement.chips_per_trainer to a divisor "
                    f"of {n}")
    return ""
