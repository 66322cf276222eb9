"""An RLHF reward model: a Hugging Face ``*ForSequenceClassification`` checkpoint (one label) scoring
prompt + completion.

The network is the policy's decoder with a ``score`` head (``learner.critic.LlamaForValue``, the same
``model.*`` + ``score.weight`` names HF uses), loaded by name from the directory's safetensors.
The score of a row is the head's output at its last real token (where HF pools too: the rightmost
non-pad token). Testable without Ray; ``actors/reward_model_actor.py`` only forwards to it.
"""

from __future__ import annotations

import numpy as np
import torch

from learner.critic import LlamaForValue
from rltpu.config import ModelConfig
from rltpu.models.hf.config import read_checkpoint_config
from rltpu.models.hf.weights import CheckpointDir, CheckpointError


class RewardModelEngine:
    def __init__(self, path: str, device: str = "cpu"):
        fields = read_checkpoint_config(path, classifier=True)
        self.cfg = ModelConfig(**fields)
        self.vocab_size = int(fields["vocab_size"])
        self.device = device
        with torch.device("meta"):
            model = LlamaForValue(self.cfg, self.vocab_size)
        model.to_empty(device=device)
        ckpt = CheckpointDir(path)
        params = dict(model.named_parameters())
        with torch.no_grad():
            for name, p in params.items():
                if name not in ckpt.where:
                    raise CheckpointError(f"{ckpt.dir}: tensor {name} is missing (a reward model needs the "
                                          f"backbone and a one-label score head)")
                if name == "score.weight" and ckpt.shape(name)[0] != 1:
                    raise CheckpointError(f"{ckpt.where[name]}: score.weight has {ckpt.shape(name)[0]} labels; a "
                                          f"reward model has one (save it with num_labels=1)")
                if tuple(ckpt.shape(name)) != tuple(p.shape):
                    raise CheckpointError(f"{ckpt.where[name]}: tensor {name} has shape {list(ckpt.shape(name))} "
                                          f"but config.json implies {list(p.shape)}")
                p.copy_(ckpt.read(name))
        extra = sorted(set(ckpt.where) - set(params) - {"lm_head.weight"})
        if extra:
            raise CheckpointError(f"{ckpt.where[extra[0]]}: unexpected tensor {extra[0]} for a reward model")
        self.model = model.eval().requires_grad_(False)

    @torch.no_grad()
    def score(self, tokens, position_ids, attention_mask) -> np.ndarray:
        """(R, L) layout (any padding, given by ``attention_mask``) -> (R,) fp32 scores."""
        t = lambda x: torch.as_tensor(np.array(x), device=self.device)  # noqa: E731  (Ray arrays are read-only)
        tokens, mask = t(tokens), t(attention_mask)
        if int(tokens.max()) >= self.vocab_size:
            raise ValueError(f"token id {int(tokens.max())} is outside the reward model's vocabulary "
                             f"({self.vocab_size}); the reward model must share the policy's tokenizer")
        values = self.model(tokens, t(position_ids), mask)  # (R, L)
        cols = torch.arange(mask.shape[1], device=mask.device)
        last = (cols * (mask > 0)).argmax(-1)  # rightmost real token
        return values[torch.arange(len(last)), last].float().cpu().numpy()


def combine_rewards(rule: np.ndarray, model: np.ndarray | None, rule_weight: float, rm_cfg) -> np.ndarray:
    """``rule_weight * rule + weight * f(model)``, f = optional batch standardisation then clipping."""
    out = rule_weight * np.asarray(rule, np.float32)
    if model is None:
        return out
    s = np.asarray(model, np.float32)
    if rm_cfg.normalize:
        s = (s - s.mean()) / (s.std() + 1e-6)
    if rm_cfg.clip is not None:
        s = np.clip(s, -rm_cfg.clip, rm_cfg.clip)
    return (out + rm_cfg.weight * s).astype(np.float32)
