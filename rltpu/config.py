"""One validated config tree for a whole RL job.

Loaded from YAML, overridden by dotted ``key=value`` pairs from the command line, frozen after
validation. Each component receives only its own section (the sampler gets ``cfg.sampler``...).
Every problem is raised as :class:`ConfigError` with one line naming the key, the bad value and
what is allowed; the CLI turns it into exit code 2 without a traceback.
"""

from __future__ import annotations

import functools
import json
import math
import re
from pathlib import Path
from typing import Annotated, Any, Literal

import yaml
from pydantic import (AfterValidator, BaseModel, ConfigDict, Field, ValidationError, field_serializer, field_validator,
                      model_validator)

# a function named as module:function (task.reward_fn, task.rewards[].fn, environment paths)
FN_PATH = re.compile(r"[A-Za-z_][\w.]*:[A-Za-z_]\w*")


class ConfigError(ValueError):
    """A user error in the config or the command line: one line, names the key and the fix."""


class _Section(BaseModel):
    # inf and NaN are never a setting: a deadline of inf never fires, an lr of NaN trains nothing
    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False)


DAY_S = 86_400.0  # the longest timeout or deadline a config may set (longer overflowed in the actors)


def _betas(v: tuple[float, float]) -> tuple[float, float]:
    if not all(0 <= b < 1 for b in v):
        raise ValueError(f"AdamW betas must each be in [0, 1), got {list(v)} (e.g. [0.9, 0.99])")
    return v


GENERATIONS = ("v4", "v5e", "v5p", "v6e", "7x")
MAX_CHIPS = 65_536  # chips in one job (all slices)
# the largest slice of each generation (the planner's figures, rltpu/plan/hardware.py; a test keeps them equal)
MAX_SLICE_CHIPS = {"v4": 4096, "v5e": 256, "v5p": 6144, "v6e": 256, "7x": 9216}


def _prod(topology: str) -> int:
    n = 1
    for d in topology.split("x"):
        n *= int(d)
    return n


def is_loopback(host: str) -> bool:
    """127.0.0.0/8, ::1 or localhost: reachable from this machine only."""
    import ipaddress

    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


class ClusterConfig(_Section):
    """Which chips exist. On a CPU machine they are emulated Ray ``TPU`` resources."""

    # TPU generation of the slice (decides 2D/3D topology and the planner's figures)
    generation: Literal["v4", "v5e", "v5p", "v6e", "7x"] = "v5e"
    topology: str = "2x2"  # chips per slice as AxB (2D: v5e/v6e) or AxBxC (3D: v4/v5p/7x)
    slices: int = Field(1, ge=1, le=1024)  # slices of that topology (multi-slice: DCN between them)
    emulated: bool | None = None  # None: emulate when no real TPU is found on this host
    address: str | None = None  # join an existing Ray cluster ("auto" or host:port)
    ray_temp_dir: str | None = None  # embedded Ray's temp dir; default a fresh /tmp/rltpu-ray-* (short socket paths)
    bind_host: str = "127.0.0.1"  # address the embedded Ray cluster and the sync fabric listen on
    allow_remote: bool = False  # a non-loopback bind_host opens the cluster to the network: say so explicitly

    @field_validator("topology")
    @classmethod
    def _topology(cls, v: str) -> str:
        if not re.fullmatch(r"[1-9]\d*(x[1-9]\d*){1,2}", v):
            raise ValueError(f"must look like 2x4 or 2x2x1, got {v!r}")
        return v

    @model_validator(mode="after")
    def _dims(self) -> "ClusterConfig":
        ndim = len(self.topology.split("x"))
        want = 2 if self.generation in ("v5e", "v6e") else 3
        if ndim != want:
            raise ValueError(
                f"topology {self.topology!r} has {ndim} dims but {self.generation} slices are {want}D "
                f"(e.g. {'2x4' if want == 2 else '2x2x1'})"
            )
        # arithmetic on the string, before anything builds a chip table (1024x1024 took 5.5 s and 442 MB)
        chips, largest = _prod(self.topology), MAX_SLICE_CHIPS[self.generation]
        if chips > largest:
            raise ValueError(f"topology {self.topology!r} is not a {self.generation} slice shape: {chips} chips, but "
                             f"the largest {self.generation} slice has {largest}; use a smaller topology (or more "
                             f"cluster.slices)")
        if chips * self.slices > MAX_CHIPS:
            raise ValueError(f"{self.slices} slices of {self.topology} are {chips * self.slices} chips, more than "
                             f"rltpu handles ({MAX_CHIPS}); lower cluster.slices")
        if not self.allow_remote and not is_loopback(self.bind_host):
            raise ValueError(f"bind_host={self.bind_host!r} is not a loopback address: other hosts could reach the "
                             f"embedded Ray cluster; set cluster.allow_remote=true to mean it (or bind 127.0.0.1)")
        return self


class PlacementConfig(_Section):
    """How many chips each role gets; one actor (one process) per ``chips_per_*`` chips.

    ``mode``: ``disaggregated`` gives samplers and trainers disjoint chips (weights go over the
    sync fabric); ``colocated`` runs both engines in one process per trainer chip and alternates
    phases (weights pass in-process; both footprints stay resident: TPUs have no sleep mode).
    ``staleness``: how many weight versions a rollout may lag the policy it trains (0 = on-policy;
    s > 0 lets samplers generate step k+1..k+s while the trainers train step k).
    """

    # disaggregated: samplers and trainers on disjoint chips; colocated: both in one process
    mode: Literal["disaggregated", "colocated"] = "disaggregated"
    staleness: int = Field(0, ge=0, le=8)  # weight versions a rollout may lag the policy it trains (0: on-policy)
    sampler_chips: int = Field(2, ge=1)  # chips for the JAX samplers
    trainer_chips: int = Field(2, ge=1)  # chips for the FSDP2 trainers
    chips_per_sampler: Literal[1, 2, 4, 8] = 1  # chips per sampler process (tensor parallel above 1)
    chips_per_trainer: Literal[1, 2, 4, 8] = 1  # chips per trainer process (tensor parallel above 1)
    reward_chips: int = Field(0, ge=0)  # an RLHF reward-model group (needs the reward_model section)
    chips_per_reward: Literal[1, 2, 4, 8] = 1  # chips per reward-model process
    # optional pinning to global chip ids (chip table order); None = first free chips
    sampler_chip_ids: tuple[int, ...] | None = None
    trainer_chip_ids: tuple[int, ...] | None = None  # pin the trainers to these global chip ids
    reward_chip_ids: tuple[int, ...] | None = None  # pin the reward models to these global chip ids

    @model_validator(mode="after")
    def _divisible(self) -> "PlacementConfig":
        if self.mode == "colocated":
            if self.staleness:
                raise ValueError(f"staleness={self.staleness} needs samplers on their own chips: a colocated process "
                                 f"alternates sampling and training; use mode=disaggregated or staleness=0")
            if (self.sampler_chips, self.chips_per_sampler) != (self.trainer_chips, self.chips_per_trainer):
                raise ValueError(f"mode=colocated runs a sampler in every trainer process: set sampler_chips="
                                 f"trainer_chips (now {self.sampler_chips} vs {self.trainer_chips}) and "
                                 f"chips_per_sampler=chips_per_trainer")
            if self.sampler_chip_ids is not None:
                raise ValueError("mode=colocated: samplers live on the trainer chips; drop sampler_chip_ids "
                                 "(pin trainer_chip_ids instead)")
        for role in ("sampler", "trainer", "reward"):
            chips, per = getattr(self, f"{role}_chips"), getattr(self, f"chips_per_{role}")
            if chips % per:
                raise ValueError(f"{role}_chips={chips} is not a multiple of chips_per_{role}={per}")
            ids = getattr(self, f"{role}_chip_ids")
            if ids is not None:
                if len(ids) != chips:
                    raise ValueError(f"{role}_chip_ids lists {len(ids)} chips but {role}_chips={chips}")
                if len(set(ids)) != len(ids):
                    raise ValueError(f"{role}_chip_ids {list(ids)} repeats a chip")
        roles = ("sampler", "trainer", "reward")
        for i, a in enumerate(roles):
            for b in roles[i + 1:]:
                both = set(getattr(self, f"{a}_chip_ids") or ()) & set(getattr(self, f"{b}_chip_ids") or ())
                if both:
                    raise ValueError(
                        f"{a}_chip_ids and {b}_chip_ids both list chip {min(both)}; "
                        f"a chip belongs to exactly one process, give the roles disjoint chips"
                    )
        return self


class RopeScaling(_Section):
    """RoPE frequency scaling as a checkpoint's config.json gives it (HF ``rope_scaling``)."""

    rope_type: Literal["linear", "llama3"]
    factor: float = Field(gt=0)
    low_freq_factor: float = Field(1.0, gt=0)  # llama3 only
    high_freq_factor: float = Field(4.0, gt=0)  # llama3 only
    original_max_position_embeddings: int | None = Field(None, ge=1)  # llama3 only

    @model_validator(mode="after")
    def _llama3(self) -> "RopeScaling":
        if self.rope_type == "llama3" and self.original_max_position_embeddings is None:
            raise ValueError("rope_scaling of type llama3 needs original_max_position_embeddings")
        return self


ARCHITECTURES = ("llama", "qwen2", "qwen3", "mistral")
ARCH_FIELDS = (  # the fields a checkpoint's config.json decides when model.path is set
    "architecture", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
    "num_key_value_heads", "head_dim", "rope_theta", "rope_scaling", "rms_norm_eps", "max_position_embeddings",
    "tie_word_embeddings", "vocab_size", "attention_bias", "attention_out_bias", "qk_norm", "sliding_window",
    "layer_types",
)


class ModelConfig(_Section):
    """A Llama-family decoder; names and shapes follow Hugging Face ``LlamaConfig`` / ``Qwen2Config``...

    With ``path`` (a local Hugging Face directory) every field in ``ARCH_FIELDS`` comes from its
    config.json (``rltpu.models.hf.config``); the same field also set in the YAML must agree with it.
    A Hub id there is replaced by its local snapshot directory before validation (``rltpu.data.hub``).
    """

    # a local HF model dir (config.json + safetensors), or a Hugging Face Hub id (org/name) that rltpu train/plan
    # resolve once, in the driver, to its snapshot in the HF cache (HF_HOME; HF_HUB_OFFLINE=1: cache only)
    path: str | None = None
    revision: str | None = None  # Hub branch, tag or commit of a path given as a Hub id (None: main)
    # HF family (for export); "other": a model.path of any other causal LM (Gemma 3, Qwen3-MoE...), which only
    # trainer.model_impl=hf trains (the sizes below are then read from its config.json for checks only)
    architecture: Literal["llama", "qwen2", "qwen3", "mistral", "other"] = "llama"
    hidden_size: int = Field(128, ge=8)
    intermediate_size: int = Field(256, ge=8)
    num_hidden_layers: int = Field(2, ge=1)
    num_attention_heads: int = Field(4, ge=1)
    num_key_value_heads: int = Field(2, ge=1)
    head_dim: int | None = Field(None, ge=2)  # None: hidden_size / num_attention_heads (Qwen3 sets it)
    rope_theta: float = Field(10000.0, gt=0)
    rope_scaling: RopeScaling | None = None
    rms_norm_eps: float = Field(1e-5, gt=0)
    max_position_embeddings: int = Field(256, ge=8)
    tie_word_embeddings: bool = False
    attention_bias: bool = False  # q/k/v projections carry a bias (Qwen2)
    attention_out_bias: bool = False  # o_proj carries a bias (Llama/Qwen3 attention_bias=true)
    qk_norm: bool = False  # per-head RMSNorm on q and k before RoPE (Qwen3)
    sliding_window: int | None = Field(None, ge=1)  # a query sees the last W positions (Mistral)
    layer_types: tuple[Literal["full_attention", "sliding_attention"], ...] | None = None  # None: all slide if W set
    vocab_size: int | None = None  # None: taken from the tokenizer
    dtype: Literal["float32", "bfloat16"] = "float32"
    init_std: float = Field(0.02, gt=0)

    @model_validator(mode="before")
    @classmethod
    def _resolve(cls, data: Any) -> Any:
        if not isinstance(data, dict):
            return data
        data = dict(data)
        if data.get("path") is not None and not isinstance(data["path"], str):
            raise ValueError(f"path must be a directory name (a string), got {type(data['path']).__name__} "
                             f"{str(data['path'])[:40]!r}")
        if data.get("path") is not None:
            from rltpu.models.hf.config import merge_checkpoint_config

            data = merge_checkpoint_config(data, ARCH_FIELDS)  # ValueError (one line) on disagreement or a bad file
        if data.get("head_dim") is None:
            hidden = data.get("hidden_size", cls.model_fields["hidden_size"].default)
            heads = data.get("num_attention_heads", cls.model_fields["num_attention_heads"].default)
            if isinstance(hidden, int) and isinstance(heads, int) and heads > 0 and hidden % heads == 0:
                data["head_dim"] = hidden // heads
        return data

    @model_validator(mode="after")
    def _heads(self) -> "ModelConfig":
        if self.head_dim is None:
            raise ValueError(
                f"hidden_size={self.hidden_size} is not divisible by num_attention_heads={self.num_attention_heads}"
            )
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(
                f"num_attention_heads={self.num_attention_heads} is not divisible by "
                f"num_key_value_heads={self.num_key_value_heads}"
            )
        if self.head_dim % 2:
            raise ValueError(f"head_dim={self.head_dim} must be even for RoPE")
        if self.layer_types is not None and len(self.layer_types) != self.num_hidden_layers:
            raise ValueError(f"layer_types lists {len(self.layer_types)} layers but num_hidden_layers="
                             f"{self.num_hidden_layers}")
        if self.layer_types and "sliding_attention" in self.layer_types and self.sliding_window is None:
            raise ValueError("layer_types has sliding_attention layers but sliding_window is not set")
        return self

    @field_serializer("head_dim")
    def _ser_head_dim(self, v: int | None) -> int | None:
        # the derived value is not written out, so a dumped config stays correct if sizes change
        return None if v == self.hidden_size // self.num_attention_heads else v

    def layer_window(self, i: int) -> int | None:
        """The sliding window of layer ``i`` (None: full causal attention)."""
        if self.sliding_window is None or (self.layer_types is not None and self.layer_types[i] != "sliding_attention"):
            return None
        return self.sliding_window


DATASET_SUFFIXES = (".jsonl", ".json", ".parquet", ".csv")
HUB_ID = re.compile(r"[A-Za-z0-9][\w.-]*/[A-Za-z0-9][\w.-]*")  # org/name (rltpu.data.hub resolves it)
PROMPT_FORMAT_KEYS = ("system_prompt", "prompt_template", "chat_template", "chat_template_kwargs")  # eval inherits
WEIGHTED_SUM = "rltpu.data.rewards:weighted_sum"  # what task.rewards runs as


def check_dataset_name(value: str) -> str:
    """A dataset's shape (its existence is checked where it is read, in the driver): a file with a known
    suffix, a glob, a directory or a Hub id; ValueError (one line) otherwise."""
    last = value.rstrip("/").rpartition("/")[2]
    if value.lower().endswith(DATASET_SUFFIXES) or any(c in value for c in "*?[") or HUB_ID.fullmatch(value) \
            or "." not in last.lstrip("."):
        return value
    raise ValueError(f"dataset {value!r} must be a {', '.join(DATASET_SUFFIXES)} file, a glob of them, a directory "
                     f"or a Hugging Face Hub dataset id (org/name)")


class RewardTerm(_Section):
    """One function of ``task.rewards``: ``weight * fn(completion, example, **kwargs)``."""

    fn: str  # module:function, as task.reward_fn
    weight: float = 1.0
    kwargs: dict[str, Any] = {}  # keyword arguments bound to fn

    @field_validator("fn")
    @classmethod
    def _path(cls, v: str) -> str:
        if not FN_PATH.fullmatch(v):
            raise ValueError(f"fn must be 'module:function', got {v!r}")
        return v


class TaskConfig(_Section):
    """The prompt source and the reward.

    Without ``dataset`` a built-in synthetic task (``name``) is used: no download, char tokenizer.
    With ``dataset`` prompts come from a JSONL/JSON/Parquet file, or through ``datasets.load_dataset``
    from a CSV file, a glob, a directory or a Hub id (``rltpu.data.sources``): a text column
    ``prompt_key`` or chat messages ``messages_key`` (rendered with the tokenizer's chat template);
    every other column reaches the reward function in ``example``. ``chat_template: true`` renders text
    prompts (through ``prompt_template``) as a user turn after ``system_prompt``.

    ``rewards`` (several functions, weighted) runs as ``reward_fn = rltpu.data.rewards:weighted_sum``
    with ``reward_kwargs = {terms: [...]}``: every consumer of ``reward_fn`` sees the sum.
    """

    name: Literal["copy", "reverse", "sort", "calc", "guess", "lookup"] = "copy"  # calc, guess, lookup: through env
    alphabet: str | None = None  # the char tokenizer's characters; None: the task's own (rltpu.data.synthetic)
    min_digits: int = Field(3, ge=1)
    max_digits: int = Field(5, ge=1)
    reward_fn: str = "rltpu.data.rewards:partial_credit"  # any importable ``module:function``
    # several reward functions, weighted: [{fn, weight, kwargs}, ...] (TRL's reward_funcs + reward_weights);
    # the reward is sum(weight * fn(completion, example)); instead of reward_fn
    rewards: tuple[RewardTerm, ...] | None = None
    reward_weight: float = Field(1.0, ge=0)  # weight of reward_fn beside a reward model (0: model only)
    reward_kwargs: dict[str, Any] = {}  # keyword arguments bound to reward_fn (e.g. {column: answer})
    # reward_fn runs in CPU-only Ray workers (no chips), each call under a deadline; a call that raises,
    # returns a non-finite value or times out scores reward_default and is counted per step
    reward_workers: int = Field(2, ge=1)
    reward_concurrency: int = Field(128, ge=1)  # calls in flight per worker (threads; 1 = one at a time)
    reward_timeout_s: float = Field(30.0, gt=0, le=DAY_S)
    reward_default: float = 0.0
    reward_max_failure_frac: float = Field(0.1, ge=0, le=1)  # more failed calls in a step stop the job
    num_prompts: int = Field(100_000, ge=1)  # size of the synthetic dataset (cycled by epoch)
    # prompts: a .jsonl/.json/.parquet/.csv file, a glob, a directory or a Hub dataset id (org/name); None: synthetic
    dataset: str | None = None
    subset: str | None = None  # the dataset's configuration (datasets' name), e.g. openai/gsm8k's "main"
    split: str = "train"  # the split read from a Hub id or a directory (files and globs are one split)
    revision: str | None = None  # Hub branch, tag or commit of a dataset id (None: main)
    prompt_key: str = "prompt"  # text prompt column
    messages_key: str = "messages"  # chat column: a list of {role, content}; used when a row has it
    shuffle: bool = True  # reshuffle the file every epoch (by seed and epoch); False = file order
    tokenizer: str | None = None  # local HF tokenizer dir; None = model.path if set, else the char tokenizer
    # the prompt text of a row: prompt_template.format(**row) (e.g. "{question}\nEnd with: #### <answer>"),
    # else its prompt_key column
    prompt_template: str | None = None
    chat_template: bool = False  # render text prompts as a user turn with the tokenizer's chat template
    system_prompt: str | None = None  # a system turn before each chat prompt (rows with their own system turn keep it)
    chat_template_kwargs: dict[str, Any] = {}  # extra chat-template variables, e.g. {enable_thinking: false} (Qwen3)

    @model_validator(mode="after")
    def _range(self) -> "TaskConfig":
        if self.min_digits > self.max_digits:
            raise ValueError(f"min_digits={self.min_digits} > max_digits={self.max_digits}")
        if not FN_PATH.fullmatch(self.reward_fn):
            raise ValueError(f"reward_fn must be 'module:function', got {self.reward_fn!r}")
        if self.dataset is not None:
            check_dataset_name(self.dataset)
        if self.prompt_key == self.messages_key:
            raise ValueError(f"prompt_key and messages_key are both {self.prompt_key!r}; they name different columns")
        if self.system_prompt is not None and not self.chat_template:
            raise ValueError("system_prompt is a turn of the chat template: set task.chat_template=true too")
        if self.rewards is not None:
            if not self.rewards:
                raise ValueError("rewards is empty; list at least one {fn, weight} or use reward_fn")
            terms = {"terms": [t.model_dump() for t in self.rewards]}
            mine = self.reward_fn == WEIGHTED_SUM and self.reward_kwargs == terms  # a saved config read back
            if not mine and ({"reward_fn", "reward_kwargs"} & self.model_fields_set):
                raise ValueError("set rewards (several weighted functions) or reward_fn / reward_kwargs, not both")
            object.__setattr__(self, "reward_fn", WEIGHTED_SUM)  # frozen: set once, here, while validating
            object.__setattr__(self, "reward_kwargs", terms)
        return self


class EnvConfig(_Section):
    """Multi-turn rollouts (``rltpu.data.envs``): each sample is an episode of up to ``max_turns`` policy
    turns; after each, the environment's ``step`` returns an observation (appended to the sequence,
    masked out of the loss), a reward (summed into the episode's) and whether the episode is done.
    Environment calls run in CPU-only Ray workers under ``task.reward_timeout_s``; a failed call
    ends its episode scored ``task.reward_default`` and counts like a failed reward call.
    """

    path: str  # ``module:Class``; a new instance per episode, built with ``kwargs``
    kwargs: dict[str, Any] = {}  # keyword arguments for the environment class
    max_turns: int = Field(4, ge=1)  # policy turns per episode at most
    max_tokens: int = Field(32, ge=2)  # the response region: every turn's completion and observation
    # episode: every policy token gets the episode's advantage; turn: a turn's tokens get the group-relative
    # advantage of its return-to-go (its own and later turns' rewards), so a reward earned by an earlier
    # turn (a tool call) does not also reward whatever a later turn wrote (learner.losses.turn_advantages)
    credit: Literal["episode", "turn"] = "episode"

    @model_validator(mode="after")
    def _check(self) -> "EnvConfig":
        if not FN_PATH.fullmatch(self.path):
            raise ValueError(f"path must be 'module:Class', got {self.path!r}")
        return self


class EvalConfig(_Section):
    """Held-out evaluation (``rltpu.control.evaluation``): the samplers generate for a fixed file of
    prompts every ``every_steps`` steps and at the end; the rows never enter training or the ledger.

    Greedy (temperature 0) gives ``eval/accuracy``; ``samples`` completions per prompt at the
    sampler's own temperature give ``eval/pass@k`` (unbiased: 1 - C(n-c, k) / C(n, k)) and
    ``eval/mean@k`` (c / n). A completion is correct when ``task.reward_fn`` scores it at least
    ``correct_threshold``.
    """

    dataset: str  # the same kinds and row format as task.dataset (a file, glob, directory or Hub id)
    subset: str | None = None  # the dataset's configuration, as task.subset
    split: str = "test"  # the split read from a Hub id or a directory
    revision: str | None = None  # Hub branch, tag or commit of a dataset id
    prompt_key: str = "prompt"
    messages_key: str = "messages"
    # the prompt format; unset: the task's (task.prompt_template, chat_template, system_prompt, chat_template_kwargs)
    prompt_template: str | None = None
    chat_template: bool = False  # as task.chat_template (unset: the task's)
    system_prompt: str | None = None  # as task.system_prompt (unset: the task's)
    chat_template_kwargs: dict[str, Any] = {}  # as task.chat_template_kwargs (unset: the task's)
    every_steps: int = Field(0, ge=0)  # 0: only at the end
    at_end: bool = True
    greedy: bool = True
    samples: int = Field(4, ge=0)  # n sampled completions per prompt (0: greedy only)
    k: int = Field(1, ge=1)
    max_prompts: int | None = Field(None, ge=1)  # the file's first N rows
    correct_threshold: float = 1.0

    @model_validator(mode="after")
    def _check(self) -> "EvalConfig":
        check_dataset_name(self.dataset)
        if self.system_prompt is not None and not self.chat_template:
            raise ValueError("system_prompt is a turn of the chat template: set eval.chat_template=true too")
        if self.samples and self.k > self.samples:
            raise ValueError(f"k={self.k} is larger than samples={self.samples}: pass@k needs at least k samples per "
                             f"prompt; raise eval.samples or lower eval.k")
        if not self.greedy and not self.samples:
            raise ValueError("greedy=false and samples=0 leave nothing to evaluate; set one of them")
        return self


class SamplerConfig(_Section):
    """The compiled JAX generation engine: sampling knobs and the static shape grid.

    The grid is batch_buckets x prompt_buckets x new_token_buckets; every cell is one compiled
    program. Defaults are powers of two; a request is padded into the smallest cell that fits.
    """

    # the rollout backend (docs/backends.md): "jax" = the compiled JAX engine (logprob parity with the
    # trainer, zero steady compiles); "vllm" = vLLM's LLM from model.path (any architecture vLLM runs; its own
    # kernels, the sampler-vs-trainer gap measured per step as logp_gap); needs pip install -e '.[vllm]'
    backend: Literal["jax", "vllm"] = "jax"
    group_size: int = Field(8, ge=2)  # G completions per prompt (GRPO needs >= 2)
    temperature: float = Field(1.0, ge=0)  # 0 = greedy (argmax); logprobs are then those at T=1
    # nucleus sampling: keep the smallest set of tokens with this much mass (1: off)
    top_p: float = Field(1.0, gt=0, le=1)
    top_k: int = Field(0, ge=0)  # 0 = off
    stop_token_ids: tuple[Annotated[int, Field(ge=0)], ...] = ()  # extra stop tokens besides the tokenizer's EOS
    max_new_tokens: int = Field(8, ge=1)  # completion length limit per turn (tokens)
    batch_buckets: tuple[int, ...] = (16, 32, 64)  # rows (prompts x G) per compiled program
    prompt_buckets: tuple[int, ...] = (8, 16)  # prompt length (tokens) per compiled program
    new_token_buckets: tuple[int, ...] | None = None  # None: (max_new_tokens,)
    truncate_prompts: bool = False  # too-long prompts: False = error, True = keep their last tokens
    microbatch_rows: int = Field(0, ge=0)  # static engine: >0 runs a request as sequential micro-batches
    # "continuous" (rltpu/sampling/continuous.py): one prefill per prompt shared by its G samples, a
    # fixed grid of decode slots refilled between chunks, a paged KV cache; "static": one compiled
    # program per (rows, prompt, new tokens) cell that decodes until its longest row stops
    engine: Literal["continuous", "static"] = "continuous"
    slots: int = Field(0, ge=0)  # continuous: decode slots (0 = max(batch_buckets))
    decode_chunk: int = Field(8, ge=1)  # continuous: decode steps per compiled call (host admits between)
    kv_page_size: int = Field(16, ge=1)  # continuous: tokens per KV page (capped at max new tokens)
    kv_pages: int = Field(0, ge=0)  # continuous: pages in the KV pool (0 = auto, 40% of a dense cache)
    precompile: bool = True  # compile every bucket at actor start
    # JAX persistent compilation cache: your own ~/.cache/rltpu/jax/<cpu> (made 0700; off when others can
    # write it), so a rerun loads its programs; else <run_dir>/jax_cache
    compile_cache: bool = True
    # another directory for it, shared by runs (programs are keyed by their HLO, devices and flags,
    # so runs of other shapes only add entries); env RLTPU_COMPILE_CACHE_DIR sets it for every run
    compile_cache_dir: str | None = None

    @field_validator("batch_buckets", "prompt_buckets", "new_token_buckets")
    @classmethod
    def _sorted(cls, v: tuple[int, ...] | None) -> tuple[int, ...] | None:
        if v is None:
            return v
        if not v or any(b < 1 for b in v) or list(v) != sorted(set(v)):
            raise ValueError(f"must be a non-empty strictly increasing list of positive ints, got {list(v)}")
        return v

    @model_validator(mode="after")
    def _new_tokens(self) -> "SamplerConfig":
        if self.new_token_buckets is not None and self.max_new_tokens > max(self.new_token_buckets):
            raise ValueError(
                f"max_new_tokens={self.max_new_tokens} exceeds the largest new_token_buckets entry "
                f"{max(self.new_token_buckets)}"
            )
        return self

    @model_validator(mode="after")
    def _engine_knobs(self) -> "SamplerConfig":
        if self.engine == "continuous" and self.microbatch_rows:
            raise ValueError(
                f"microbatch_rows={self.microbatch_rows} applies to sampler.engine=static (continuous batching "
                f"already ends each row on its own); set sampler.engine=static or sampler.microbatch_rows=0"
            )
        return self

    @property
    def new_tokens_grid(self) -> tuple[int, ...]:
        return self.new_token_buckets or (self.max_new_tokens,)


LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
# the LM head too, by default: where it is untied it adapts like a projection (a frozen random head, as in the
# seeded quickstart, caps how confident the policy can get); tied to the embeddings it has no module of its own
LORA_DEFAULT_TARGETS = (*LORA_TARGETS, "lm_head")


class LoraConfig(_Section):
    """Low-rank adapters (``learner/lora.py``): W x + (alpha / rank) B A x on the named projections,
    the base frozen. Only A and B train, sync (after the first full sync) and checkpoint."""

    rank: int = 8  # adapter rank r (B is out x r, A is r x in)
    alpha: float = 16.0  # the update is scaled by alpha / rank (the PEFT convention)
    dropout: float = Field(0.0, ge=0, lt=1)  # on the adapter's input, training only
    target_modules: tuple[str, ...] = LORA_DEFAULT_TARGETS  # HF names; default: all seven projections + lm_head
    # how the sampler applies the adapters: "merged" = W + s B A computed once per sync (decode runs
    # the base program); "lowrank" = x W^T + s (x A^T) B^T inside the compiled program
    sampler_apply: Literal["merged", "lowrank"] = "merged"

    @model_validator(mode="after")
    def _check(self) -> "LoraConfig":
        if self.rank <= 0:
            raise ValueError(f"lora.rank={self.rank} must be a positive integer (e.g. trainer.lora.rank=8)")
        if self.alpha <= 0:
            raise ValueError(f"lora.alpha={self.alpha} must be > 0 (the update is scaled by alpha / rank)")
        bad = [m for m in self.target_modules if m not in LORA_DEFAULT_TARGETS]
        if bad or not self.target_modules:
            raise ValueError(f"lora.target_modules has {bad[0]!r}, not a projection of this model family; "
                             f"use some of {', '.join(LORA_DEFAULT_TARGETS)}" if bad else
                             f"lora.target_modules is empty; use some of {', '.join(LORA_DEFAULT_TARGETS)}")
        return self

    @property
    def scale(self) -> float:
        return self.alpha / self.rank


class TrainerConfig(_Section):
    """The policy update on the FSDP2-wrapped policy: algorithm, optimizer, loss options."""

    steps: int = Field(60, ge=1)  # training steps (one sample -> reward -> update -> sync round each)
    # stop early (a normal finish, final checkpoint) once the mean reward of the last
    # ``target_window`` steps reaches this; None: run all ``steps``
    target_reward: float | None = None
    target_window: int = Field(5, ge=1)  # steps averaged for target_reward
    prompts_per_step: int = Field(16, ge=1)  # prompts drawn per step (rows = prompts_per_step x sampler.group_size)
    lr: float = Field(3e-3, gt=0)  # AdamW learning rate (peak, after warmup)
    betas: Annotated[tuple[float, float], AfterValidator(_betas)] = (0.9, 0.99)  # AdamW betas [beta1, beta2]
    weight_decay: float = Field(0.0, ge=0)  # AdamW decoupled weight decay
    grad_clip: float = Field(1.0, gt=0)  # clip the global gradient norm to this
    warmup_steps: int = Field(0, ge=0)  # linear learning-rate warmup from 0 over this many steps
    clip_eps: float = Field(0.2, gt=0)  # PPO ratio clip: 1 - clip_eps .. 1 + clip_eps
    kl_coef: float = Field(0.0, ge=0)  # > 0 keeps a frozen reference copy of the initial policy
    entropy_coef: float = Field(0.0, ge=0)  # entropy bonus per token (exploration from random init)
    ppo_epochs: int = Field(1, ge=1)  # optimizer steps on each batch
    scale_rewards: bool = True  # divide advantages by the group std (GRPO); False = Dr.GRPO style
    # the algorithm (learner/losses.py): advantage estimator, loss aggregation, clipping, KL.
    # algorithm: a name registered in learner.losses.ESTIMATORS (grpo, drgrpo, rloo, reinforce_pp,
    # reinforce_pp_baseline, ppo, or your own); an unknown one fails before Ray starts (check_algorithm)
    algorithm: str = Field("grpo", min_length=1)
    # a name in learner.losses.LOSS_AGG_MODES (token-mean, seq-mean-token-sum, seq-mean-token-mean,
    # seq-mean-token-sum-norm, or your own); None: seq-mean-token-sum-norm for drgrpo, token-mean otherwise
    loss_agg_mode: str | None = Field(None, min_length=1)
    clip_eps_high: float | None = Field(None, gt=0)  # DAPO clip-higher (e.g. 0.28); None = clip_eps
    dual_clip_c: float | None = Field(None, gt=1)  # cap a negative-advantage token's loss at -c*A
    # KL estimator against the reference: k1 log-ratio, k2 squared, k3 low-variance
    kl_estimator: Literal["k1", "k2", "k3"] = "k3"
    kl_in_reward: bool = False  # False: kl_coef * KL in the loss; True: subtracted from the reward
    gamma: float = Field(1.0, gt=0, le=1)  # discount for per-token returns (REINFORCE++)
    dynamic_sampling: bool = False  # DAPO: drop zero-variance groups, sample more to refill the batch
    max_sample_rounds: int = Field(4, ge=1)  # dynamic sampling: sampler calls per step at most
    recompute_old_logprobs: bool = False  # trust the trainer, not the sampler, for the ratio's old logp
    # stale rollouts (placement.staleness > 0): "tis" = truncated importance sampling. The PPO ratio is
    # taken against the trainer's recomputed logprobs and each token is weighted by
    # min(pi_old / pi_behaviour, tis_cap), pi_behaviour being the sampler's (older) weights
    off_policy_correction: Literal["none", "tis"] = "none"
    tis_cap: float = Field(2.0, ge=1.0)  # truncated importance sampling: the largest per-token weight
    # efficiency (learner/microbatch.py, learner/fsdp.py)
    micro_batch_tokens: int = Field(0, ge=0)  # padded tokens per micro-batch (grad accumulation); 0 = one pass
    length_grouping: bool = True  # micro-batches of similar lengths, padding columns cut
    seq_bucket: int = Field(16, ge=1)  # micro-batch widths rounded up to a multiple (few shapes on XLA)
    activation_checkpointing: bool = False  # recompute each layer's activations in backward
    mixed_precision: Literal["fp32", "bf16"] = "fp32"  # bf16 compute, fp32 master weights and AdamW states
    # per-token logprobs/entropy this many tokens at a time (LM head + fp32 log-softmax per chunk,
    # recomputed in backward): extra memory ~ chunk x vocab x 4 B x ~3, not sequence x vocab; 0 = whole
    # micro-batch at once. 512 at Qwen's 152k vocab: ~0.9 GB transient instead of ~600 KB x 3 per token
    logprob_chunk_tokens: int = Field(512, ge=0)
    lora: LoraConfig | None = None  # train low-rank adapters on a frozen base (None: every parameter)
    # the policy's modeling code: "native" = rltpu's own Llama-family decoder (rltpu/models/torch_llama.py,
    # packed micro-batches); "hf" = transformers' AutoModelForCausalLM built from model.path's config.json
    # (any architecture transformers runs; padded micro-batches, no tensor parallelism: learner/hf_model.py)
    model_impl: Literal["native", "hf"] = "native"

    @model_validator(mode="after")
    def _algorithm(self) -> "TrainerConfig":
        if self.micro_batch_tokens and self.micro_batch_tokens < self.seq_bucket:
            raise ValueError(f"micro_batch_tokens={self.micro_batch_tokens} is below seq_bucket={self.seq_bucket}: "
                             f"no row fits; raise micro_batch_tokens (0 = one pass)")
        if self.kl_in_reward and self.kl_coef == 0:
            raise ValueError("kl_in_reward=true needs kl_coef > 0 (the penalty's weight); set trainer.kl_coef")
        return self

    @property
    def resolved_loss_agg_mode(self) -> str:
        if self.loss_agg_mode is not None:
            return self.loss_agg_mode
        return "seq-mean-token-sum-norm" if self.algorithm == "drgrpo" else "token-mean"


class RewardModelConfig(_Section):
    """An RLHF reward model: a local HF ``*ForSequenceClassification`` directory (one label), run on
    its own chips (``placement.reward_chips``). It scores prompt + completion with the policy's
    tokenizer; its score is added to ``task.reward_weight * reward_fn``."""

    path: str  # a local directory or a Hub id (org/name), as model.path
    revision: str | None = None  # Hub branch, tag or commit of a path given as a Hub id
    weight: float = Field(1.0, ge=0)
    normalize: bool = False  # standardise the model's scores over each step's batch
    clip: float | None = Field(None, gt=0)  # clip the (normalised) score to +- this


class CriticConfig(_Section):
    """PPO's value model: the policy's architecture with a scalar head (``score``), initialised from
    the policy's starting weights, trained in the trainer group beside the policy."""

    lr: float = Field(1e-3, gt=0)  # critic AdamW learning rate
    betas: Annotated[tuple[float, float], AfterValidator(_betas)] = (0.9, 0.99)  # critic AdamW betas
    weight_decay: float = Field(0.0, ge=0)  # critic AdamW weight decay
    warmup_steps: int = Field(0, ge=0)  # critic learning-rate warmup steps
    grad_clip: float = Field(1.0, gt=0)  # critic gradient-norm clip
    value_clip: float | None = Field(0.2, gt=0)  # clip new values to old +- this (None: off)
    gae_lambda: float = Field(1.0, ge=0, le=1)  # GAE lambda (1: Monte Carlo returns)


class SyncConfig(_Section):
    """Trainer -> sampler weight broadcast over a torch.distributed (gloo on CPU) group."""

    bucket_mb: float = Field(16.0, gt=0)  # flat bucket size per trainer stream (trainer peak extra <= 2 buckets)
    timeout_s: float = Field(120.0, gt=0, le=DAY_S)  # every sync collective and rendezvous: a dead peer fails within it
    wire_dtype: Literal["auto", "float32", "bfloat16", "float16"] = "auto"  # auto: the sampler's dtype (model.dtype)
    verify_every: int = Field(10, ge=0)  # compare sampler vs trainer logits on a probe every N syncs (0: never)


class BackendConfig(_Section):
    """Device, threads and matmul precision, applied in every actor by ``rltpu.chips.backend``."""

    device: Literal["auto", "tpu", "cuda", "cpu"] = "auto"  # auto: TPU when the chip is real, else CPU
    # float32 matmul precision (torch set_float32_matmul_precision / JAX's)
    matmul_precision: Literal["medium", "high", "highest"] = "highest"
    threads: int = Field(1, ge=1)  # torch/XLA intra-op threads per actor (Ray sets OMP to 1)
    # TorchTPU eager mode on real chips: fuse (DeferAndFuse, default), strict (async per op), debug
    # (synchronous per op: slow, localises errors). Ignored on emulated chips.
    eager_mode: Literal["fuse", "strict", "debug"] = "fuse"


class CheckpointConfig(_Section):
    """Periodic checkpoints in ``<run_dir>/checkpoint`` (``rltpu.control.checkpoints``): after a step when
    ``every_steps`` steps or ``every_minutes`` minutes have passed since the last one, whichever comes first,
    and always at the end and on Ctrl-C/SIGTERM. A trainer restart or ``--resume`` loses at most that much."""

    every_steps: int = Field(10, ge=0)  # a checkpoint every N steps (0: off; every_minutes may still save)
    every_minutes: float = Field(30.0, ge=0, le=DAY_S / 60)  # and one when this long has passed since the last (0: off)
    keep_last: int = Field(2, ge=1, le=100)  # checkpoint/, checkpoint.prev/, checkpoint.prev2/ ...: a corrupt latest falls back
    # also write a Hugging Face directory (config.json, safetensors, tokenizer) as <checkpoint>/hf, each trainer
    # rank writing its share of the tensors: transformers' from_pretrained loads it, no `rltpu export` needed
    hf_export: bool = False


class PhaseDeadlines(_Section):
    """Seconds an actor may stay in one phase before it is declared hung, fenced and replaced."""

    compiling: float = Field(1800.0, gt=0, le=DAY_S)  # sampler program compilation (all buckets)
    loading: float = Field(1800.0, gt=0, le=DAY_S)  # building engines, loading weights or a checkpoint
    sampling: float = Field(600.0, gt=0, le=DAY_S)  # one generate call
    scoring: float = Field(600.0, gt=0, le=DAY_S)  # one reward or reward-model call batch
    training: float = Field(600.0, gt=0, le=DAY_S)  # one update
    syncing: float = Field(120.0, gt=0, le=DAY_S)  # one weight sync
    checkpointing: float = Field(600.0, gt=0, le=DAY_S)  # one checkpoint save
    # start-up and supervision steps: each remote call waits at most this long, and an actor
    # reporting the phase longer than this is fenced (none of them runs as the deadline-free "idle")
    identity: float = Field(300.0, gt=0, le=DAY_S)  # includes starting the process (imports)
    claim: float = Field(300.0, gt=0, le=DAY_S)  # an actor claiming its chips
    rendezvous: float = Field(300.0, gt=0, le=DAY_S)  # forming the process groups
    join_sync: float = Field(300.0, gt=0, le=DAY_S)  # joining the weight-sync fabric
    probe: float = Field(300.0, gt=0, le=DAY_S)  # layout, memory and logit probes


class HealthConfig(_Section):
    """Heartbeats, deadlines and restarts (``rltpu.observe.health``)."""

    enabled: bool = True  # heartbeats, phase deadlines, fencing and restarts (false: a failure ends the job)
    heartbeat_s: float = Field(1.0, gt=0, le=DAY_S)  # each actor reports this often, from its own thread
    heartbeat_timeout_s: float = Field(60.0, gt=0, le=DAY_S)  # silence longer than this (e.g. SIGSTOP): hung
    deadlines: PhaseDeadlines = PhaseDeadlines()
    max_restarts: int = Field(3, ge=0, le=1000)  # per actor slot; one more failure stops the job with a report
    poll_s: float = Field(1.0, gt=0, le=DAY_S)  # the controller's watchdog: health.json and verdicts this often
    # bounded driver memory: the files are the record (metrics.jsonl, ledger.jsonl); in memory and in
    # trace.json only the newest spans/events are kept
    trace_max_spans: int = Field(20_000, ge=0)  # actor + controller phase spans kept for trace.json
    max_events: int = Field(200, ge=1)  # fenced/replaced/restarted events kept (health.json, status)
    trace_every_s: float = Field(10.0, ge=0, le=DAY_S)  # trace.json is rewritten at most this often (and at the end)


class DashboardConfig(_Section):
    enabled: bool = False  # `rltpu train` serves the live page while it runs
    host: str = "127.0.0.1"  # bind address of the live page
    port: int = Field(8266, ge=0, le=65535)  # 0: any free port (printed at start)
    allow_remote: bool = False  # a non-loopback host serves the run to the network: say so explicitly

    @model_validator(mode="after")
    def _loopback(self) -> "DashboardConfig":
        if not self.allow_remote and not is_loopback(self.host):
            raise ValueError(f"host={self.host!r} is not a loopback address: anyone on the network could read the "
                             f"run; set dashboard.allow_remote=true to mean it (or use 127.0.0.1)")
        return self


class LoggersConfig(_Section):
    """metrics.jsonl is always written; these add the optional loggers (the `loggers` extra)."""

    tensorboard: bool = False  # event files in run_dir/tensorboard (`tensorboard` extra)
    wandb: bool = False  # Weights & Biases (`wandb` extra); files under run_dir/wandb
    # None: WANDB_MODE, else offline (nothing sent; `wandb sync run_dir/wandb/offline-run-*` uploads later)
    wandb_mode: Literal["online", "offline", "disabled"] | None = None
    wandb_project: str | None = None  # None: WANDB_PROJECT, else "rltpu"
    wandb_entity: str | None = None  # None: WANDB_ENTITY, else the account's default team
    wandb_name: str | None = None  # run name; None: WANDB_NAME, else the config's name
    wandb_tags: tuple[str, ...] | None = None  # None: WANDB_TAGS (comma-separated), else none
    # the W&B run to continue; None: WANDB_RUN_ID, else the id this run dir saved (--resume continues its curve)
    wandb_id: str | None = None
    wandb_resume: Literal["allow", "must", "never"] | None = None  # None: WANDB_RESUME, else "allow"
    mlflow: bool = False  # MLflow (`mlflow` extra)
    # None: MLFLOW_TRACKING_URI, else a SQLite store in run_dir/mlflow.db (mlflow ui --backend-store-uri sqlite:///...)
    mlflow_tracking_uri: str | None = None
    mlflow_experiment: str | None = None  # None: MLFLOW_EXPERIMENT_NAME, else "rltpu"
    samples: int = Field(0, ge=0)  # rows per step written as text to run_dir/samples.jsonl (one per prompt group)


class PlannerConfig(_Section):
    """Hints for ``rltpu plan`` only; ``rltpu train`` carries them but never reads them."""

    hardware: Literal["auto", "cpu", "v4", "v5e", "v5p", "v6e", "7x"] = "auto"  # auto: cluster.generation
    hf_config: str | None = None  # a Hugging Face config.json: model sizes to plan for (no weights needed)
    prompt_len: int | None = Field(None, ge=1)  # default: the largest sampler.prompt_buckets entry
    response_len: int | None = Field(None, ge=1)  # default: sampler.max_new_tokens
    # mean generated tokens per row (long tails: well below response_len); the continuous engine's waves and
    # the tokens/s headline use it. Default: response_len (every row runs to the limit)
    mean_response_len: int | None = Field(None, ge=1)
    critic: bool = False  # plan room and time for a value model as large as the policy
    reward_model_params: float = Field(0.0, ge=0)  # a separate reward model's parameter count (0: rule-based)


class RunConfig(_Section):
    """The whole job."""

    name: str = "rltpu"  # default run_dir runs/<name>: a plain name, never a path
    run_dir: str | None = None  # default: runs/<name>
    seed: int = Field(0, ge=0, le=2**31 - 1)  # seeds derived from it (seed * 1000003 + ...) stay in int64

    @field_validator("name")
    @classmethod
    def _plain_name(cls, v: str) -> str:
        if not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}", v) or ".." in v:
            raise ValueError(f"must be a plain name (letters, digits, '.', '_', '-'; no '/' or '..'), got {v!r}; "
                             f"set run_dir for another directory")
        return v
    cluster: ClusterConfig = Field(default_factory=ClusterConfig)  # built on use: its check imports rltpu.plan
    placement: PlacementConfig = PlacementConfig()
    model: ModelConfig = ModelConfig()
    task: TaskConfig = TaskConfig()
    sampler: SamplerConfig = SamplerConfig()
    trainer: TrainerConfig = TrainerConfig()
    critic: CriticConfig | None = None  # PPO's value model; required by trainer.algorithm=ppo
    reward_model: RewardModelConfig | None = None  # RLHF: a reward-model group on placement.reward_chips
    eval: EvalConfig | None = None  # held-out evaluation during training (rltpu.control.evaluation)
    env: EnvConfig | None = None  # multi-turn environment rollouts (rltpu.data.envs); None: one completion per sample
    sync: SyncConfig = SyncConfig()
    backend: BackendConfig = BackendConfig()
    checkpoint: CheckpointConfig = CheckpointConfig()
    health: HealthConfig = HealthConfig()
    dashboard: DashboardConfig = DashboardConfig()
    loggers: LoggersConfig = LoggersConfig()
    planner: PlannerConfig = PlannerConfig()
    progress: bool = True  # a progress bar on stderr while training (false for logs and CI)

    @model_validator(mode="before")
    @classmethod
    def _eval_prompt_format(cls, data: Any) -> Any:
        """eval: takes the task's prompt format for every format key it does not set itself."""
        if not isinstance(data, dict) or not isinstance(data.get("eval"), dict):
            return data
        task = data.get("task") or {}
        get = task.get if isinstance(task, dict) else (lambda k: getattr(task, k, None))
        inherited = {k: get(k) for k in PROMPT_FORMAT_KEYS if k not in data["eval"] and get(k) is not None}
        return {**data, "eval": {**inherited, **data["eval"]}} if inherited else data

    @model_validator(mode="after")
    def _cross(self) -> "RunConfig":
        # whether trainer.algorithm needs the critic section is its estimator's declaration
        # (learner.losses.register_estimator), checked with the registry by control.controller.check_algorithm
        if self.reward_model is not None and self.placement.reward_chips == 0:
            raise ValueError("reward_model needs chips of its own: set placement.reward_chips >= 1")
        if self.reward_model is None and self.placement.reward_chips:
            raise ValueError(f"placement.reward_chips={self.placement.reward_chips} but there is no reward_model "
                             f"section; add reward_model.path or set placement.reward_chips=0")
        if self.trainer.lora is not None:
            _check_lora(self)
        _check_model_impl(self)
        _check_sampler_backend(self)
        if self.env is not None:
            _check_env(self)
        elif self.task.name in ("calc", "guess", "lookup") and self.task.dataset is None:
            env = {"calc": "calculator:Calculator", "guess": "guess:GuessNumber", "lookup": "lookup:Lookup"}[self.task.name]
            raise ValueError(f"task.name={self.task.name} is played through an environment: add env.path "
                             f"(rltpu.data.envs.{env}) "
                             f"or pick copy/reverse/sort")
        if self.placement.staleness and self.trainer.dynamic_sampling:
            raise ValueError("placement.staleness > 0 with trainer.dynamic_sampling is not supported (a refill "
                             "round needs the step's own rewards); set one of them off")
        need = max(self.sampler.prompt_buckets) + (self.env.max_tokens if self.env is not None
                                                     else max(self.sampler.new_tokens_grid))
        if self.model.max_position_embeddings < need:
            raise ValueError(f"model.max_position_embeddings={self.model.max_position_embeddings} is shorter than the "
                             f"longest sequence ({max(self.sampler.prompt_buckets)} prompt + "
                             f"{need - max(self.sampler.prompt_buckets)} new tokens = {need}); raise it or lower "
                             f"sampler.prompt_buckets / max_new_tokens")
        rows = self.trainer.prompts_per_step * self.sampler.group_size
        n_samplers = self.placement.sampler_chips // self.placement.chips_per_sampler
        n_trainers = self.placement.trainer_chips // self.placement.chips_per_trainer
        if self.trainer.prompts_per_step % n_samplers:
            raise ValueError(
                f"trainer.prompts_per_step={self.trainer.prompts_per_step} must be divisible by the "
                f"{n_samplers} sampler actors"
            )
        if rows % n_trainers:
            raise ValueError(f"rows per step ({rows}) must be divisible by the {n_trainers} trainer actors")
        per_trainer_tokens = rows // n_trainers * (max(self.sampler.prompt_buckets) + self.sampler.max_new_tokens)
        if self.trainer.micro_batch_tokens > per_trainer_tokens:
            raise ValueError(
                f"trainer.micro_batch_tokens={self.trainer.micro_batch_tokens} is larger than a trainer rank's whole "
                f"batch ({rows // n_trainers} rows x {per_trainer_tokens * n_trainers // rows} tokens = "
                f"{per_trainer_tokens}); lower it, or 0 for one pass")
        if self.eval is not None and self.eval.samples > max(self.sampler.batch_buckets):
            raise ValueError(f"eval.samples={self.eval.samples} rows per prompt do not fit the largest "
                             f"sampler.batch_buckets entry {max(self.sampler.batch_buckets)}; lower eval.samples")
        per_sampler = rows // n_samplers
        if per_sampler > max(self.sampler.batch_buckets):
            raise ValueError(
                f"each sampler gets {per_sampler} rows per step but the largest sampler.batch_buckets "
                f"entry is {max(self.sampler.batch_buckets)}; add a bucket >= {per_sampler}"
            )
        return self

    @property
    def resolved_run_dir(self) -> Path:
        return Path(self.run_dir or f"runs/{self.name}")

    def to_dict(self) -> dict[str, Any]:
        return json.loads(self.model_dump_json())


def _check_env(cfg: "RunConfig") -> None:
    """What multi-turn rollouts do not run with, each refused in one line before Ray starts."""
    if cfg.placement.mode == "colocated":
        raise ValueError("env with placement.mode=colocated is not supported yet; use disaggregated")
    if cfg.env.credit == "turn":
        if cfg.trainer.algorithm not in ("grpo", "drgrpo"):
            raise ValueError(f"env.credit=turn works with trainer.algorithm grpo or drgrpo, not "
                             f"{cfg.trainer.algorithm!r}; set env.credit=episode or change the algorithm")
        if cfg.trainer.kl_in_reward or cfg.reward_model is not None:
            raise ValueError("env.credit=turn takes each turn's reward from the environment alone: it does not "
                             "combine with trainer.kl_in_reward or a reward_model; set env.credit=episode")
    if cfg.env.max_tokens < cfg.sampler.max_new_tokens:
        raise ValueError(f"env.max_tokens={cfg.env.max_tokens} is smaller than one turn's "
                         f"sampler.max_new_tokens={cfg.sampler.max_new_tokens}; raise env.max_tokens")


def _check_model_impl(cfg: "RunConfig") -> None:
    """What ``trainer.model_impl=hf`` needs, and the architectures only it trains, in one line each."""
    if cfg.trainer.model_impl == "native":
        if cfg.model.architecture == "other":
            raise ValueError(f"model.path {cfg.model.path} holds an architecture the native trainer does not "
                             f"implement (it has llama, qwen2, qwen3, mistral); set trainer.model_impl=hf")
        return
    if cfg.model.path is None:
        raise ValueError("trainer.model_impl=hf builds the model from a checkpoint's config.json: set model.path "
                         "(a local Hugging Face directory, e.g. one from `rltpu tiny-checkpoint`)")
    if cfg.placement.chips_per_trainer > 1:
        raise ValueError("trainer.model_impl=hf with placement.chips_per_trainer > 1 is not supported (no tensor "
                         "parallelism for transformers' models yet); set chips_per_trainer=1 or model_impl=native")


def _check_sampler_backend(cfg: "RunConfig") -> None:
    """What ``sampler.backend=vllm`` needs and does not run with, one line each, before Ray starts."""
    s = cfg.sampler
    if s.backend == "jax":
        if cfg.model.architecture == "other":
            raise ValueError(f"model.path {cfg.model.path} holds an architecture the JAX sampler does not implement "
                             f"(it has llama, qwen2, qwen3, mistral); set sampler.backend=vllm")
        return
    import importlib.util

    if importlib.util.find_spec("vllm") is None:
        raise ValueError("sampler.backend=vllm but vLLM is not installed: pip install -e '.[vllm]' (vLLM's CPU "
                         "build; on TPUs vLLM's TPU build, docs/backends.md) or set sampler.backend=jax")
    if cfg.model.path is None:
        raise ValueError("sampler.backend=vllm builds its model from model.path (a Hugging Face checkpoint "
                         "directory, e.g. one from `rltpu tiny-checkpoint`); set model.path or sampler.backend=jax")
    if cfg.placement.mode == "colocated":
        raise ValueError("sampler.backend=vllm with placement.mode=colocated is not supported (vLLM's CPU build has "
                         "no sleep mode to free its memory between phases); use placement.mode=disaggregated or "
                         "sampler.backend=jax")
    if cfg.trainer.lora is not None:
        raise ValueError("sampler.backend=vllm takes full weights only (no adapter sync yet); remove trainer.lora "
                         "or set sampler.backend=jax")
    if s.temperature not in (0.0, 1.0) and (s.top_k or s.top_p < 1):
        raise ValueError(f"sampler.backend=vllm returns logprobs before temperature or after top-k/top-p, never "
                         f"softmax(logits/T) before them as the trainer scores: with temperature={s.temperature} "
                         f"set top_k=0 and top_p=1 (or temperature=1)")


def _check_lora(cfg: "RunConfig") -> None:
    """What LoRA does not run with yet, each refused in one line before Ray starts."""
    lora = cfg.trainer.lora
    if cfg.checkpoint.hf_export:
        raise ValueError("checkpoint.hf_export with trainer.lora is not supported (a LoRA checkpoint holds only the "
                         "adapters); export one with `rltpu export RUN_DIR/checkpoint OUT [--adapters]`")
    if "lm_head" in lora.target_modules and "target_modules" in lora.model_fields_set and cfg.model.tie_word_embeddings:
        raise ValueError("trainer.lora.target_modules has 'lm_head', but this model ties it to the embeddings "
                         "(tie_word_embeddings); remove lm_head from the list")
    if cfg.critic is not None:
        raise ValueError("trainer.lora with PPO's critic is not supported (the critic would train a full copy "
                         "of the base); use a critic-free algorithm (grpo, rloo, ...) or remove trainer.lora")
    if cfg.placement.chips_per_trainer > 1 or cfg.placement.chips_per_sampler > 1:
        raise ValueError("trainer.lora with tensor parallelism (placement.chips_per_trainer/chips_per_sampler > 1) "
                         "is not supported; set both to 1 or remove trainer.lora")
    if cfg.placement.mode == "colocated":
        raise ValueError("trainer.lora with placement.mode=colocated is not supported (the in-process handoff "
                         "copies full weights); use placement.mode=disaggregated or remove trainer.lora")


# ---------------------------------------------------------------------------------------------
# Loading, overrides and one-line errors


def _format_error(err: ValidationError) -> str:
    e = err.errors()[0]
    key = ".".join(str(p) for p in e["loc"]) or "<root>"
    kind = e["type"]
    value = e.get("input")
    if kind == "extra_forbidden":
        return f"unknown config key '{key}'{_did_you_mean(e['loc'], value)}"
    msg = e["msg"].removeprefix("Value error, ")
    if isinstance(value, dict) and kind == "value_error":
        return f"config section '{key}': {msg}" if e["loc"] else f"config: {msg}"
    shown = repr(value) if not isinstance(value, dict) else "{...}"
    if kind == "literal_error":
        return f"config key '{key}' has bad value {shown}: {msg}"
    if kind.startswith("missing"):
        return f"config key '{key}' is required"
    return f"config key '{key}' has bad value {shown}: {msg}"


def _did_you_mean(loc: tuple, value: Any = None) -> str:
    """``; did you mean 'trainer.lr'?`` for a misspelt key: the rltpu key of a TRL or verl name (the
    unknown key, or a key under it), else the closest key of its section (difflib), else of the whole
    schema; empty when nothing is close."""
    import difflib

    dotted = ".".join(str(p) for p in loc)
    for k in [dotted, *(f"{dotted}.{sub}" for sub in _flat_keys(value))]:
        hit = foreign_name(k)
        if hit:
            theirs = k.rsplit(".", 1)[-1] if hit[0] == "TRL" else k
            return f"; did you mean '{hit[1]}'? ({hit[0]}'s {theirs}; docs/config.md lists every key)"
    model, parents = RunConfig, []
    for part in loc[:-1]:
        field = model.model_fields.get(str(part)) if isinstance(model, type) else None
        sub = _section_type(field.annotation) if field is not None else None
        if sub is None:
            break
        model, parents = sub, [*parents, str(part)]
    else:
        names = list(model.model_fields)
        close = difflib.get_close_matches(str(loc[-1]), names, n=1, cutoff=0.6)
        if close:
            return f"; did you mean '{'.'.join([*parents, close[0]])}'? (docs/config.md lists every key)"
    keys = [k for k, _f, _m in walk_fields(RunConfig)]
    close = difflib.get_close_matches(dotted, keys, n=1, cutoff=0.6)
    return f"; did you mean '{close[0]}'? (docs/config.md lists every key)" if close else \
        " (docs/config.md lists every key)"


def _flat_keys(value: Any, prefix: str = "") -> list[str]:
    if not isinstance(value, dict):
        return []
    out = []
    for k, v in value.items():
        out += [f"{prefix}{k}", *_flat_keys(v, f"{prefix}{k}.")]
    return out


def _section_type(annotation: Any) -> type[BaseModel] | None:
    """The config section class inside an annotation (``LoraConfig | None`` -> LoraConfig), or None."""
    import typing

    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation
    for arg in typing.get_args(annotation):
        if isinstance(arg, type) and issubclass(arg, BaseModel):
            return arg
    return None


def walk_fields(model: type[BaseModel], prefix: str = ""):
    """Every leaf key of a section, depth first in declaration order: ``(dotted key, FieldInfo, owner class)``."""
    for name, field in model.model_fields.items():
        sub = _section_type(field.annotation)
        if sub is not None:
            yield from walk_fields(sub, f"{prefix}{name}.")
        else:
            yield f"{prefix}{name}", field, model


def _parse_scalar(text: str) -> Any:
    """Parse an override value with YAML rules (``3e-6`` -> float, ``[1,2]`` -> list, ``x`` -> str)."""
    try:
        value = yaml.safe_load(text)
    except yaml.YAMLError:
        return text
    # YAML 1.1 reads "3e-6" as a string; numbers in scientific notation are what users mean
    if isinstance(value, str):
        try:
            return float(value)
        except ValueError:
            return value
    return value


def apply_overrides(data: dict[str, Any], overrides: list[str]) -> dict[str, Any]:
    """Apply ``a.b.c=value`` overrides to a nested dict (new keys are caught by the schema)."""
    for item in overrides:
        if "=" not in item:
            raise ConfigError(f"override {item!r} is not key=value (e.g. trainer.lr=3e-6)")
        key, _, raw = item.partition("=")
        parts = key.strip().split(".")
        if not all(parts):
            raise ConfigError(f"override key {key!r} is malformed (e.g. trainer.lr=3e-6)")
        node = data
        for p in parts[:-1]:
            child = node.setdefault(p, {})
            if not isinstance(child, dict):
                raise ConfigError(f"override '{key}': '{p}' is a value, not a section")
            node = child
        node[parts[-1]] = _parse_scalar(raw)
    return data


def _coerce_yaml_floats(node: Any) -> Any:
    if isinstance(node, dict):
        return {k: _coerce_yaml_floats(v) for k, v in node.items()}
    if isinstance(node, list):
        return [_coerce_yaml_floats(v) for v in node]
    if isinstance(node, str) and re.fullmatch(r"[-+]?\d+(\.\d*)?[eE][-+]?\d+", node):
        return float(node)
    return node


def _check_finite(node: Any, key: str = "") -> None:
    """No inf or NaN anywhere in the tree, free-form sections (reward_kwargs, env kwargs) included;
    deeper than any config nests is refused too (a deep YAML would otherwise end in RecursionError)."""
    if key.count(".") > 32:
        raise ConfigError(f"config key '{key[:80]}...' is nested more than 32 levels deep; flatten it")
    if isinstance(node, float) and not math.isfinite(node):
        raise ConfigError(f"config key '{key or '<root>'}' has bad value {node}: inf and NaN are not allowed; "
                          f"give a finite number")
    if isinstance(node, dict):
        for k, v in node.items():
            _check_finite(v, f"{key}.{k}" if key else str(k))
    elif isinstance(node, (list, tuple)):
        for i, v in enumerate(node):
            _check_finite(v, f"{key}.{i}" if key else str(i))


def build_config(data: dict[str, Any]) -> RunConfig:
    try:
        data = _coerce_yaml_floats(data)
    except RecursionError:
        raise ConfigError("config nests too deeply to be a config; flatten it") from None
    _check_finite(data)
    try:
        return RunConfig.model_validate(data)
    except ValidationError as err:
        raise ConfigError(_format_error(err)) from None


def load_config(path: str | Path | None, overrides: list[str] | None = None, prepare=None) -> RunConfig:
    """The YAML file (or defaults) with ``overrides`` applied, validated. ``prepare(data) -> data`` runs on
    the raw tree first (the CLI passes ``rltpu.data.hub.resolve_ids``: Hub ids -> local directories)."""
    data: dict[str, Any] = {}
    if path is not None:
        p = Path(path)
        if not p.is_file():
            raise ConfigError(f"config file '{p}' does not exist (try configs/quickstart.yaml)")
        try:
            loaded = yaml.safe_load(p.read_text(encoding="utf-8"))
        except yaml.YAMLError as err:
            mark = getattr(err, "problem_mark", None)
            where = f" at line {mark.line + 1}" if mark else ""
            raise ConfigError(f"config file '{p}' is not valid YAML{where}") from None
        except UnicodeDecodeError as err:
            raise ConfigError(f"config file '{p}' is not UTF-8 (byte {err.start}); save it as UTF-8") from None
        except RecursionError:
            raise ConfigError(f"config file '{p}' nests too deeply to be a config; flatten it") from None
        if loaded is None:
            loaded = {}
        if not isinstance(loaded, dict):
            raise ConfigError(f"config file '{p}' must hold a mapping of sections, got {type(loaded).__name__}")
        data = loaded
    apply_overrides(data, list(overrides or []))
    if prepare is not None:
        data = prepare(data)
    return build_config(data)


def save_config(cfg: RunConfig, path: Path) -> None:
    path.write_text(yaml.safe_dump(cfg.to_dict(), sort_keys=False))


# ---------------------------------------------------------------------------------------------
# What one process is sent: the parts of the config it reads, never the whole tree


def sections_of(cfg: RunConfig, paths: tuple[str, ...]) -> dict[str, Any]:
    """The parts of ``cfg`` at ``paths`` (``"sampler"``, ``"trainer.lora"``) as JSON data: what an actor's
    constructor is sent (Ray carries plain data as msgpack, never pickle). A path under another listed
    path travels inside it."""
    full, out = cfg.to_dict(), {}
    for path in paths:
        if any(path.startswith(f"{other}.") for other in paths):
            continue
        node = full
        for key in path.split("."):
            node = node[key]
        out[path] = node
    return out


class Sections:
    """Parts of a run config, shaped like it (``cfg.sampler.temperature``) and holding only the parts a
    process was sent; reading another part names the list that leaves it out (``owner``)."""

    def __init__(self, parts: dict[str, Any], owner: str, prefix: str = ""):
        self._parts, self._owner, self._prefix = parts, owner, prefix

    def __getattr__(self, name: str) -> Any:
        if name.startswith("_"):
            raise AttributeError(name)
        try:
            return self._parts[name]
        except KeyError:
            raise AttributeError(f"config {self._prefix}{name} is not sent to this process; "
                                 f"add it to {self._owner}") from None

    @classmethod
    def read(cls, data: dict[str, Any], owner: str) -> "Sections":
        """``sections_of``'s output, each part rebuilt as its schema type (sections as their models,
        tuples as tuples); the checks across sections ran once, in the driver."""
        from pydantic import TypeAdapter

        class Node(dict):  # a section only partly sent (a leaf value may itself be a dict)
            pass

        tree = Node()
        for path, value in data.items():
            model, node, keys = RunConfig, tree, path.split(".")
            for key in keys[:-1]:
                model = _section_type(model.model_fields[key].annotation)
                node = node.setdefault(key, Node())
            node[keys[-1]] = TypeAdapter(model.model_fields[keys[-1]].annotation).validate_python(value)

        def build(parts: Node, prefix: str) -> "Sections":
            return cls({k: build(v, f"{prefix}{k}.") if isinstance(v, Node) else v for k, v in parts.items()},
                       owner, prefix)

        return build(tree, "")


# ---------------------------------------------------------------------------------------------
# Reference: docs/config.md is generated from this schema (python -m rltpu.config --markdown > docs/config.md)

# What a TRL (GRPOConfig) or verl (ppo_trainer.yaml) user knows a setting as -> the rltpu key. The unknown-key
# error suggests the rltpu key when one of these names is typed, and docs/config.md prints the table.
FOREIGN_NAMES: tuple[tuple[str, str, str, str], ...] = (
    # (library, their name, rltpu key, note)
    ("TRL", "model_name_or_path", "model.path", ""),
    ("TRL", "dataset_name", "task.dataset", ""),
    ("TRL", "num_generations", "sampler.group_size", "completions per prompt"),
    ("TRL", "beta", "trainer.kl_coef", "0 drops the reference model"),
    ("TRL", "epsilon", "trainer.clip_eps", ""),
    ("TRL", "epsilon_high", "trainer.clip_eps_high", "DAPO clip-higher"),
    ("TRL", "learning_rate", "trainer.lr", ""),
    ("TRL", "max_grad_norm", "trainer.grad_clip", ""),
    ("TRL", "adam_beta1", "trainer.betas", "[beta1, beta2]"),
    ("TRL", "weight_decay", "trainer.weight_decay", ""),
    ("TRL", "warmup_steps", "trainer.warmup_steps", ""),
    ("TRL", "num_iterations", "trainer.ppo_epochs", "updates per batch"),
    ("TRL", "loss_type", "trainer.algorithm", "grpo, dr_grpo -> drgrpo; the aggregation is trainer.loss_agg_mode"),
    ("TRL", "scale_rewards", "trainer.scale_rewards", ""),
    ("TRL", "max_prompt_length", "sampler.prompt_buckets", "the largest bucket"),
    ("TRL", "max_completion_length", "sampler.max_new_tokens", ""),
    ("TRL", "temperature", "sampler.temperature", ""),
    ("TRL", "reward_funcs", "task.rewards", "[{fn, weight, kwargs}, ...]; one function: task.reward_fn"),
    ("TRL", "reward_weights", "task.rewards", "each term's weight"),
    ("TRL", "max_steps", "trainer.steps", ""),
    ("TRL", "gradient_checkpointing", "trainer.activation_checkpointing", ""),
    ("TRL", "bf16", "trainer.mixed_precision", "bf16"),
    ("TRL", "output_dir", "run_dir", ""),
    ("TRL", "run_name", "name", "also loggers.wandb_name"),
    ("TRL", "save_steps", "checkpoint.every_steps", ""),
    ("TRL", "save_total_limit", "checkpoint.keep_last", ""),
    ("TRL", "eval_steps", "eval.every_steps", ""),
    ("TRL", "report_to", "loggers.wandb", "loggers.wandb / mlflow / tensorboard = true"),
    ("TRL", "resume_from_checkpoint", "--resume [PATH]", "a flag of `rltpu train`"),
    ("verl", "actor_rollout_ref.model.path", "model.path", ""),
    ("verl", "data.train_files", "task.dataset", ""),
    ("verl", "data.val_files", "eval.dataset", ""),
    ("verl", "data.train_batch_size", "trainer.prompts_per_step", "prompts per step"),
    ("verl", "data.max_prompt_length", "sampler.prompt_buckets", "the largest bucket"),
    ("verl", "data.max_response_length", "sampler.max_new_tokens", ""),
    ("verl", "actor_rollout_ref.rollout.n", "sampler.group_size", ""),
    ("verl", "actor_rollout_ref.rollout.temperature", "sampler.temperature", ""),
    ("verl", "actor_rollout_ref.rollout.top_p", "sampler.top_p", ""),
    ("verl", "actor_rollout_ref.actor.optim.lr", "trainer.lr", ""),
    ("verl", "actor_rollout_ref.actor.grad_clip", "trainer.grad_clip", ""),
    ("verl", "actor_rollout_ref.actor.ppo_epochs", "trainer.ppo_epochs", ""),
    ("verl", "actor_rollout_ref.actor.ppo_max_token_len_per_gpu", "trainer.micro_batch_tokens", "per trainer rank"),
    ("verl", "actor_rollout_ref.actor.clip_ratio", "trainer.clip_eps", ""),
    ("verl", "actor_rollout_ref.actor.clip_ratio_high", "trainer.clip_eps_high", ""),
    ("verl", "actor_rollout_ref.actor.clip_ratio_c", "trainer.dual_clip_c", ""),
    ("verl", "actor_rollout_ref.actor.kl_loss_coef", "trainer.kl_coef", "use_kl_loss: kl_coef > 0"),
    ("verl", "actor_rollout_ref.actor.kl_loss_type", "trainer.kl_estimator", "kl -> k1, mse -> k2, low_var_kl -> k3"),
    ("verl", "actor_rollout_ref.actor.entropy_coeff", "trainer.entropy_coef", ""),
    ("verl", "actor_rollout_ref.actor.loss_agg_mode", "trainer.loss_agg_mode", "same names"),
    ("verl", "actor_rollout_ref.model.enable_gradient_checkpointing", "trainer.activation_checkpointing", ""),
    ("verl", "algorithm.adv_estimator", "trainer.algorithm", "reinforce_plus_plus -> reinforce_pp, gae -> ppo"),
    ("verl", "algorithm.norm_adv_by_std_in_grpo", "trainer.scale_rewards", ""),
    ("verl", "algorithm.use_kl_in_reward", "trainer.kl_in_reward", ""),
    ("verl", "algorithm.kl_ctrl.kl_coef", "trainer.kl_coef", "with trainer.kl_in_reward=true"),
    ("verl", "algorithm.gamma", "trainer.gamma", ""),
    ("verl", "algorithm.lam", "critic.gae_lambda", ""),
    ("verl", "algorithm.filter_groups.enable", "trainer.dynamic_sampling", "DAPO"),
    ("verl", "algorithm.filter_groups.max_num_gen_batches", "trainer.max_sample_rounds", ""),
    ("verl", "critic.optim.lr", "critic.lr", ""),
    ("verl", "critic.cliprange_value", "critic.value_clip", ""),
    ("verl", "custom_reward_function.path", "task.reward_fn", "rltpu.data.rewards:verl_score with reward_kwargs "
     "{fn: module:compute_score} runs verl's signature"),
    ("verl", "trainer.total_training_steps", "trainer.steps", ""),
    ("verl", "trainer.save_freq", "checkpoint.every_steps", ""),
    ("verl", "trainer.max_actor_ckpt_to_keep", "checkpoint.keep_last", ""),
    ("verl", "trainer.test_freq", "eval.every_steps", ""),
    ("verl", "trainer.default_local_dir", "run_dir", ""),
    ("verl", "trainer.project_name", "loggers.wandb_project", "MLflow: loggers.mlflow_experiment"),
    ("verl", "trainer.experiment_name", "loggers.wandb_name", "or name"),
    ("verl", "trainer.logger", "loggers.wandb", "loggers.wandb / mlflow / tensorboard = true"),
    ("verl", "trainer.resume_from_path", "--resume [PATH]", "a flag of `rltpu train`; resume_mode=auto is --resume"),
)


# Meanings of keys whose class has no comment on them (sections other work is changing); a comment or a
# Field(description=...) in the class wins over these.
_MEANINGS = {
    "model.hidden_size": "model width (HF hidden_size)",
    "model.intermediate_size": "MLP inner width",
    "model.num_hidden_layers": "decoder layers",
    "model.num_attention_heads": "query heads",
    "model.num_key_value_heads": "key/value heads (grouped-query attention; divides num_attention_heads)",
    "model.rope_theta": "RoPE base frequency",
    "model.rms_norm_eps": "RMSNorm epsilon",
    "model.max_position_embeddings": "longest sequence (prompt + completion) the model takes",
    "model.tie_word_embeddings": "the LM head shares the embedding matrix",
    "model.dtype": "weights' dtype in the sampler (trainers keep fp32 masters; see trainer.mixed_precision)",
    "model.init_std": "std of the random init (no model.path)",
    "model.rope_scaling.rope_type": "linear or llama3 frequency scaling",
    "model.rope_scaling.factor": "context extension factor",
    "task.min_digits": "synthetic tasks: shortest digit string",
    "task.max_digits": "synthetic tasks: longest digit string",
    "task.reward_timeout_s": "seconds one reward_fn call may take (then it scores reward_default)",
    "task.reward_default": "the reward of a call that failed, timed out or returned a non-finite value",
    "reward_model.path": "a HF *ForSequenceClassification directory with one label",
    "reward_model.weight": "the score's weight in the total reward",
    "eval.prompt_key": "text prompt column of eval.dataset",
    "eval.messages_key": "chat column of eval.dataset",
    "eval.at_end": "also evaluate after the last step",
    "eval.greedy": "greedy completions for eval/accuracy",
    "eval.k": "k of pass@k and mean@k",
    "eval.correct_threshold": "a completion is correct when its reward is at least this",
}


def key_meaning(key: str, owner: type, name: str) -> str:
    """A key's meaning for docs/config.md: Field(description), the class's comment on it, or _MEANINGS."""
    field = owner.model_fields[name]
    return field.description or source_comments(owner).get(name) or _MEANINGS.get(key, "")


def foreign_name(key: str) -> tuple[str, str] | None:
    """``(library, rltpu key)`` when ``key`` (dotted, any prefix of sections) is a TRL or verl name."""
    for lib, theirs, ours, _note in FOREIGN_NAMES:
        if key == theirs or key.endswith("." + theirs) or (lib == "TRL" and key.rsplit(".", 1)[-1] == theirs):
            return lib, ours
    return None


def _annotation_text(annotation: Any) -> str:
    import typing

    origin, args = typing.get_origin(annotation), typing.get_args(annotation)
    if origin is Literal:
        return " | ".join(json.dumps(a) for a in args)
    if origin is Annotated:
        return _annotation_text(args[0])
    if origin in (typing.Union, __import__("types").UnionType):
        return " | ".join(_annotation_text(a) for a in args)
    if origin in (tuple, list):
        inner = _annotation_text(args[0]) if args else "any"
        return f"list[{inner}]" if (len(args) != 2 or args[1] is Ellipsis) else f"[{inner}, {_annotation_text(args[1])}]"
    if origin is dict:
        return "mapping"
    if annotation is type(None):
        return "null"
    return getattr(annotation, "__name__", str(annotation))


def _bounds(field) -> str:
    out = []
    for m in field.metadata:
        for attr, sym in (("ge", ">="), ("gt", ">"), ("le", "<="), ("lt", "<")):
            if getattr(m, attr, None) is not None:
                out.append(f"{sym} {getattr(m, attr):g}")
    return ", ".join(out)


def _default_text(field) -> str:
    from pydantic_core import PydanticUndefined

    if field.is_required():
        return "required"
    value = field.default_factory() if field.default_factory is not None else field.default
    if value is PydanticUndefined:
        return "required"
    if isinstance(value, BaseModel):
        return "(section)"
    return json.dumps(list(value) if isinstance(value, tuple) else value)


@functools.lru_cache(maxsize=None)
def source_comments(cls: type) -> dict[str, str]:
    """Each field's comment in the class source: the comment lines right above it and its trailing one."""
    import ast
    import inspect
    import io
    import textwrap
    import tokenize

    src = textwrap.dedent(inspect.getsource(cls))
    comments = {tok.start[0]: tok.string.lstrip("#").strip()
                for tok in tokenize.generate_tokens(io.StringIO(src).readline) if tok.type == tokenize.COMMENT}
    lines = src.splitlines()
    out = {}
    for node in ast.parse(src).body[0].body:
        if not isinstance(node, ast.AnnAssign) or not isinstance(node.target, ast.Name):
            continue
        above, n = [], node.lineno - 1
        while n >= 1 and lines[n - 1].strip().startswith("#"):
            above.insert(0, comments.get(n, ""))
            n -= 1
        trailing = [comments[i] for i in range(node.lineno, node.end_lineno + 1) if i in comments
                    and not lines[i - 1].strip().startswith("#")]
        out[node.target.id] = " ".join(t for t in (*above, *trailing) if t)
    return out


def markdown() -> str:
    """docs/config.md: every key of the schema with its type, default and meaning, section by section,
    then the TRL / verl names table. Kept current by tests/test_config_docs.py."""
    cell = lambda s: str(s).replace("|", "\\|").replace("\n", " ")  # noqa: E731
    out = ["# Config reference", "",
           "Generated from the schema in `rltpu/config.py` by `python -m rltpu.config --markdown > docs/config.md`",
           "(tests/test_config_docs.py fails when this file is stale). Keys are dotted paths: in YAML, nest them",
           "(`trainer: {lr: 3e-3}`); on the command line, `rltpu train CONFIG trainer.lr=3e-3`. Sections marked",
           "*optional* are absent unless the config has them. A misspelt key is refused with the closest one;",
           "a TRL or verl name gets the rltpu key (table at the end).", ""]
    sections: dict[str, tuple[type, list[str]]] = {"": (RunConfig, [])}
    for key, _field, owner in walk_fields(RunConfig):
        prefix = key.rpartition(".")[0]
        sections.setdefault(prefix, (owner, []))[1].append(key)
    for prefix, (owner, keys) in sections.items():
        title = f"`{prefix}`" if prefix else "Top level"
        out.append(f"## {title}")
        out.append("")
        parent, _, last = prefix.rpartition(".")
        if prefix:
            holder = RunConfig
            for part in parent.split(".") if parent else []:
                holder = _section_type(holder.model_fields[part].annotation)
            f = holder.model_fields[last]
            if not f.is_required() and f.default is None:
                out += ["*Optional section* (absent by default).", ""]
        doc = (owner.__doc__ or "").strip()
        if doc and owner is not RunConfig:
            out += [" ".join(doc.split()), ""]
        out += ["| key | type | default | meaning |", "|---|---|---|---|"]
        for key in keys:
            name = key.rpartition(".")[2]
            field = owner.model_fields[name]
            kind = _annotation_text(field.annotation)
            bounds = _bounds(field)
            meaning = key_meaning(key, owner, name)
            out.append(f"| `{key}` | {cell(kind)}{cell(f' ({bounds})') if bounds else ''} | "
                       f"`{cell(_default_text(field))}` | {cell(meaning)} |")
        out.append("")
    out += ["## TRL and verl names", "",
            "What a setting is called in TRL's `GRPOConfig` / verl's `ppo_trainer.yaml`, and its rltpu key.", "",
            "| library | their name | rltpu key | note |", "|---|---|---|---|"]
    for lib, theirs, ours, note in FOREIGN_NAMES:
        out.append(f"| {lib} | `{theirs}` | `{ours}` | {cell(note)} |")
    return "\n".join(out) + "\n"


if __name__ == "__main__":
    import sys

    if sys.argv[1:] != ["--markdown"]:
        sys.exit("usage: python -m rltpu.config --markdown > docs/config.md")
    sys.stdout.write(markdown())
