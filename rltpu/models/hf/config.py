"""A checkpoint's config.json <-> the ``ModelConfig`` fields that decide the architecture.

Pure Python (no ``transformers``): the fields are read with each family's defaults for keys an
older config.json leaves out. Both RoPE layouts are understood: ``rope_theta`` + ``rope_scaling``
(transformers 4.x) and ``rope_parameters`` (5.x). Every problem is a one-line ``ValueError``
naming the file and the key, which the config loader reports as a config error.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

# HF ``architectures`` entry -> (our family name, config.json ``model_type``)
SUPPORTED = {
    "LlamaForCausalLM": "llama",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
    "MistralForCausalLM": "mistral",
}
CLASS_OF = {v: k for k, v in SUPPORTED.items()}
# sequence-classification heads of the same families (reward models: ``score.weight``, one label)
CLASSIFIERS = {k.replace("ForCausalLM", "ForSequenceClassification"): v for k, v in SUPPORTED.items()}
# defaults of each family's HF config class, for keys a config.json may omit
_DEFAULTS = {
    "llama": {"rms_norm_eps": 1e-6, "rope_theta": 10000.0, "tie_word_embeddings": False, "max_position_embeddings": 2048},
    "qwen2": {"rms_norm_eps": 1e-6, "rope_theta": 10000.0, "tie_word_embeddings": False, "max_position_embeddings": 32768},
    "qwen3": {"rms_norm_eps": 1e-6, "rope_theta": 10000.0, "tie_word_embeddings": False, "max_position_embeddings": 32768},
    "mistral": {"rms_norm_eps": 1e-6, "rope_theta": 10000.0, "tie_word_embeddings": False, "max_position_embeddings": 32768},
}
_REQUIRED = ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads", "vocab_size")
_DTYPES = {"float32": "float32", "bfloat16": "bfloat16", "float16": None}


def _load_json(path: Path) -> dict:
    if not path.is_file():
        raise ValueError(f"{path} does not exist (model.path must be a local Hugging Face model directory)")
    try:
        data = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
        raise ValueError(f"{path} is not valid JSON ({str(err).splitlines()[0]})") from None
    if not isinstance(data, dict):
        raise ValueError(f"{path} must hold a JSON object, got {type(data).__name__}")
    return data


def _rope(hf: dict, where: Path) -> tuple[float | None, dict | None]:
    """(rope_theta, rope_scaling fields or None) from either RoPE layout."""
    params = hf.get("rope_parameters") or {}
    if isinstance(params, dict) and "full_attention" in params:  # per-layer-type layout
        params = params["full_attention"]
    scaling = hf.get("rope_scaling") or {}
    theta = params.get("rope_theta", hf.get("rope_theta"))
    merged = {**scaling, **params}
    kind = merged.get("rope_type", merged.get("type", "default"))
    if kind in (None, "default"):
        return theta, None
    if kind not in ("linear", "llama3"):
        raise ValueError(f"{where}: rope type {kind!r} is not supported (supported: default, linear, llama3)")
    out = {"rope_type": kind, "factor": float(merged["factor"])}
    if kind == "llama3":
        for key in ("low_freq_factor", "high_freq_factor", "original_max_position_embeddings"):
            if key not in merged:
                raise ValueError(f"{where}: llama3 rope scaling lacks {key!r}")
            out[key] = merged[key]
    return theta, out


def read_checkpoint_config(directory: str | Path, classifier: bool = False) -> dict[str, Any]:
    """config.json of a local HF directory -> ``ModelConfig`` field values (``ARCH_FIELDS`` + dtype).

    ``classifier``: the directory holds a one-label ``*ForSequenceClassification`` (a reward model).
    """
    d = Path(directory)
    if not d.is_dir():
        raise ValueError(f"model.path '{d}' is not a directory (give a local Hugging Face model directory; "
                         f"nothing is downloaded)")
    where = d / "config.json"
    hf = _load_json(where)
    archs = hf.get("architectures") or []
    table = CLASSIFIERS if classifier else SUPPORTED
    arch = next((table[a] for a in archs if a in table), None)
    if arch is None and not classifier and any(str(a).endswith("ForCausalLM") for a in archs):
        return _other(hf, where)
    if arch is None:
        raise ValueError(f"{where}: architectures {archs} is not supported (supported: {', '.join(table)})")
    if classifier and len(hf.get("id2label") or {0: 0}) != 1:
        raise ValueError(f"{where}: a reward model has one label, this one has {len(hf['id2label'])} "
                         f"(id2label); export it with num_labels=1")
    missing = [k for k in _REQUIRED if k not in hf]
    if missing:
        raise ValueError(f"{where}: lacks {missing[0]!r}")
    if hf.get("hidden_act", "silu") != "silu":
        raise ValueError(f"{where}: hidden_act={hf['hidden_act']!r} is not supported (only silu)")
    if hf.get("mlp_bias"):
        raise ValueError(f"{where}: mlp_bias=true is not supported")
    if hf.get("partial_rotary_factor", 1.0) != 1.0:
        raise ValueError(f"{where}: partial_rotary_factor is not supported")
    defaults = _DEFAULTS[arch]
    theta, scaling = _rope(hf, where)
    n_layers = int(hf["num_hidden_layers"])
    heads = int(hf["num_attention_heads"])
    bias = bool(hf.get("attention_bias", False))
    window = hf.get("sliding_window")
    layer_types = hf.get("layer_types")
    if arch == "llama":
        window = None
    elif arch in ("qwen2", "qwen3"):
        # Qwen2Config: no window unless use_sliding_window; then layers >= max_window_layers slide
        if not hf.get("use_sliding_window", False) or window is None:
            window, layer_types = None, None
        elif layer_types is None:
            first = int(hf.get("max_window_layers", 28))
            layer_types = ["sliding_attention" if i >= first else "full_attention" for i in range(n_layers)]
    if layer_types is not None:
        unknown = sorted(set(layer_types) - {"full_attention", "sliding_attention"})
        if unknown:
            raise ValueError(f"{where}: layer type {unknown[0]!r} is not supported")
        if "sliding_attention" not in layer_types:
            window, layer_types = None, None
        elif window is None:
            layer_types = None
        else:
            layer_types = tuple(layer_types)
    dtype = _DTYPES.get(str(hf.get("dtype", hf.get("torch_dtype", "float32"))), "float32") or "float32"
    return {
        "architecture": arch,
        "hidden_size": int(hf["hidden_size"]),
        "intermediate_size": int(hf["intermediate_size"]),
        "num_hidden_layers": n_layers,
        "num_attention_heads": heads,
        "num_key_value_heads": int(hf.get("num_key_value_heads") or heads),
        "head_dim": int(hf.get("head_dim") or int(hf["hidden_size"]) // heads),
        "rope_theta": float(theta if theta is not None else defaults["rope_theta"]),
        "rope_scaling": scaling,
        "rms_norm_eps": float(hf.get("rms_norm_eps", defaults["rms_norm_eps"])),
        "max_position_embeddings": int(hf.get("max_position_embeddings", defaults["max_position_embeddings"])),
        "tie_word_embeddings": bool(hf.get("tie_word_embeddings", defaults["tie_word_embeddings"])),
        "vocab_size": int(hf["vocab_size"]),
        "attention_bias": True if arch == "qwen2" else bias,
        "attention_out_bias": False if arch in ("qwen2", "mistral") else bias,
        "qk_norm": arch == "qwen3",
        "sliding_window": None if window is None else int(window),
        "layer_types": layer_types,
        "dtype": dtype,
    }


def _other(hf: dict, where: Path) -> dict[str, Any]:
    """A causal LM of a family the native decoder does not implement (Gemma 3, Qwen3-MoE...):
    ``architecture: other``, sizes read as far as the config.json gives them (for the config's length
    checks and memory estimates); only ``trainer.model_impl: hf`` trains it (the model itself is built
    by ``transformers`` from the same file). The Llama-only switches stay off."""
    text = hf.get("text_config") if isinstance(hf.get("text_config"), dict) else {}
    get = lambda k, d=None: hf.get(k, text.get(k, d))  # noqa: E731
    missing = [k for k in _REQUIRED if get(k) is None and k != "intermediate_size"]
    if missing:
        raise ValueError(f"{where}: lacks {missing[0]!r}")
    heads = int(get("num_attention_heads"))
    params = get("rope_parameters") or {}
    if isinstance(params, dict) and "full_attention" in params:
        params = params["full_attention"]
    theta = (params.get("rope_theta") if isinstance(params, dict) else None) or get("rope_theta") or 10000.0
    dtype = _DTYPES.get(str(get("dtype", get("torch_dtype", "float32"))), "float32") or "float32"
    return {
        "architecture": "other",
        "hidden_size": int(get("hidden_size")),
        "intermediate_size": int(get("intermediate_size") or get("moe_intermediate_size") or 4 * int(get("hidden_size"))),
        "num_hidden_layers": int(get("num_hidden_layers")),
        "num_attention_heads": heads,
        "num_key_value_heads": int(get("num_key_value_heads") or heads),
        "head_dim": int(get("head_dim") or int(get("hidden_size")) // heads),
        "rope_theta": float(theta),
        "rope_scaling": None,
        "rms_norm_eps": float(get("rms_norm_eps", 1e-6)),
        "max_position_embeddings": int(get("max_position_embeddings", 2048)),
        # PretrainedConfig's default (a config.json written by transformers leaves the default out)
        "tie_word_embeddings": bool(get("tie_word_embeddings", True)),
        "vocab_size": int(get("vocab_size")),
        "attention_bias": False,
        "attention_out_bias": False,
        "qk_norm": False,
        "sliding_window": None,
        "layer_types": None,
        "dtype": dtype,
    }


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, bool) or isinstance(b, bool):
        return a is b or a == b
    if isinstance(a, (int, float)) and isinstance(b, (int, float)):
        return math.isclose(float(a), float(b), rel_tol=1e-9, abs_tol=0.0)
    return a == b


def merge_checkpoint_config(data: dict, fields: tuple[str, ...]) -> dict:
    """The raw ``model`` section with ``path`` set -> the same with the checkpoint's fields filled in.

    A field the YAML sets (not None) must agree with config.json: one line names both values.
    ``dtype`` is the user's choice (the weights are cast on load); unset, it is the checkpoint's.
    """
    ckpt = read_checkpoint_config(data["path"])
    out = dict(data)
    for key in fields:  # the config's ARCH_FIELDS (passed in: this module imports nothing of rltpu)
        mine = data.get(key)
        if mine is not None and hasattr(mine, "model_dump"):
            mine = mine.model_dump()
        if mine is not None and not _same(mine, ckpt[key]):
            raise ValueError(f"model.{key}={mine!r} disagrees with {Path(data['path']) / 'config.json'} "
                             f"({key}={ckpt[key]!r}); drop it from the config (model.path sets it)")
        out[key] = ckpt[key]
    if data.get("dtype") is None:
        out["dtype"] = ckpt["dtype"]
    return out


def to_hf_config(cfg, vocab_size: int, bos_id: int | None = None, eos_id: int | None = None,
                 pad_id: int | None = None) -> dict:
    """``ModelConfig`` -> a config.json dict for ``transformers`` (the ``cfg.architecture`` class).

    Features the family cannot express (e.g. q/k norm on Llama) are a one-line ``ValueError``.
    """
    arch = cfg.architecture
    problems = {
        "llama": [("qk_norm", cfg.qk_norm), ("sliding_window", cfg.sliding_window is not None),
                  ("q/k/v bias without o_proj bias", cfg.attention_bias != cfg.attention_out_bias)],
        "qwen2": [("qk_norm", cfg.qk_norm), ("o_proj bias", cfg.attention_out_bias),
                  ("no q/k/v bias", not cfg.attention_bias)],
        "qwen3": [("no qk_norm", not cfg.qk_norm), ("q/k/v bias without o_proj bias",
                                                     cfg.attention_bias != cfg.attention_out_bias)],
        "mistral": [("qk_norm", cfg.qk_norm), ("attention bias", cfg.attention_bias or cfg.attention_out_bias)],
    }[arch]
    bad = [name for name, present in problems if present]
    if bad:
        raise ValueError(f"model.architecture={arch} cannot express {bad[0]}; set model.architecture to the family "
                         f"these weights follow")
    rope: dict[str, Any] = {"rope_type": "default"}
    if cfg.rope_scaling is not None:
        rope = {k: v for k, v in cfg.rope_scaling.model_dump().items() if v is not None}
    out: dict[str, Any] = {
        "architectures": [CLASS_OF[arch]],
        "model_type": arch,
        "hidden_act": "silu",
        "hidden_size": cfg.hidden_size,
        "intermediate_size": cfg.intermediate_size,
        "num_hidden_layers": cfg.num_hidden_layers,
        "num_attention_heads": cfg.num_attention_heads,
        "num_key_value_heads": cfg.num_key_value_heads,
        "head_dim": cfg.head_dim,
        "max_position_embeddings": cfg.max_position_embeddings,
        "rms_norm_eps": cfg.rms_norm_eps,
        "rope_theta": cfg.rope_theta,
        "rope_parameters": {**rope, "rope_theta": cfg.rope_theta},
        "tie_word_embeddings": cfg.tie_word_embeddings,
        "vocab_size": vocab_size,
        "dtype": cfg.dtype,
        "bos_token_id": bos_id,
        "eos_token_id": eos_id,
        "pad_token_id": pad_id,
        "use_cache": True,
    }
    if arch in ("llama", "qwen3"):
        out["attention_bias"] = cfg.attention_bias
    if arch == "llama":
        out["mlp_bias"] = False
    if arch == "mistral":
        out["sliding_window"] = cfg.sliding_window
    if arch in ("qwen2", "qwen3"):
        types = cfg.layer_types or (("sliding_attention",) * cfg.num_hidden_layers if cfg.sliding_window else None)
        out["use_sliding_window"] = types is not None
        out["sliding_window"] = cfg.sliding_window
        out["max_window_layers"] = types.index("sliding_attention") if types else cfg.num_hidden_layers
        out["layer_types"] = list(types) if types else ["full_attention"] * cfg.num_hidden_layers
    elif cfg.sliding_window is not None and cfg.layer_types is not None and arch == "mistral":
        raise ValueError("model.architecture=mistral cannot express per-layer sliding windows (layer_types)")
    return out
