"""PPO's value model: the policy's decoder with a scalar head instead of the LM head.

Names follow Hugging Face's token-classification models (``model.*`` + ``score.weight``), so a
critic checkpoint reads like one. The backbone starts from the policy's initial weights (the usual
choice when no reward model is at hand) and the head at zero, so the first values are 0 and the
first advantages are the plain returns.
"""

from __future__ import annotations

import torch
from torch import nn

from rltpu.models.torch_llama import LlamaForCausalLM


class LlamaForValue(LlamaForCausalLM):
    def __init__(self, cfg, vocab_size: int | None = None):
        # tied embeddings: the backbone never needs an LM head, so none is allocated
        super().__init__(cfg.model_copy(update={"tie_word_embeddings": True}), vocab_size)
        self.score = nn.Linear(cfg.hidden_size, 1, bias=False, dtype=self.model.embed_tokens.weight.dtype)
        nn.init.zeros_(self.score.weight)

    def forward(self, input_ids, position_ids=None, attention_mask=None) -> torch.Tensor:
        """[B, T] -> fp32 values [B, T]: the value of the state after token t."""
        return self.score(self.hidden_states(input_ids, position_ids, attention_mask)).squeeze(-1).float()


def critic_state_from_policy(policy_state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The backbone part of a policy state dict (``model.*``), for ``load_state_dict(strict=False)``."""
    return {k: v for k, v in policy_state.items() if k.startswith("model.")}


def load_backbone_from_checkpoint(critic: LlamaForValue, cfg) -> None:
    """Stream the policy checkpoint at ``cfg.path`` into the critic's backbone (``model.*``), each
    rank only its FSDP x TP block, like the policy itself (``rltpu.models.hf.load``); the head stays at zero."""
    from rltpu.models.hf.load import stream_into
    from rltpu.models.hf.weights import CheckpointDir

    params = {k: v for k, v in critic.named_parameters() if k.startswith("model.")}
    stream_into(params, CheckpointDir(cfg.path))
    with torch.no_grad():
        head = critic.score.weight
        (head.to_local() if hasattr(head, "to_local") else head).zero_()
