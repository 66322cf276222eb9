"""A run checkpoint -> a Hugging Face directory that ``AutoModelForCausalLM.from_pretrained`` loads.

    rltpu export RUN_DIR/checkpoint OUT_DIR [--shard-mb 4096]

Reads ``trainer_state.json`` (the run's config) and the policy's weights, HF names already: the
sharded layout (``model.index.json`` + each trainer rank's ``model-rank<r>.safetensors``,
``rltpu.models.hf.shards``) or the earlier single ``model.safetensors``. Writes
``OUT_DIR/config.json`` (the family's ``architectures`` class, sizes, RoPE, special ids), the
weights tensor by tensor (each assembled from the ranks' chunks, written, dropped: one tensor in
memory, never the model) as ``model.safetensors`` or, past ``--shard-mb``, as
``model-0000i-of-0000n.safetensors`` with ``model.safetensors.index.json`` (tagged ``format: pt``),
and the tokenizer: the files of the run's tokenizer directory (``task.tokenizer`` or
``model.path``) copied verbatim, or, for runs on the built-in character tokenizer, an equivalent
``tokenizers`` tokenizer built here (same ids). The export needs neither ``transformers`` nor the
source model directory's weights; only its tokenizer files, when the run used one.

A LoRA run's checkpoint holds only the adapters (``adapters.index.json``); its base is ``model.path``
or the seeded init (rebuilt from the seed and vocabulary in ``trainer_state.json``). Then the export
writes either the merged model (``W + (alpha / rank) B A`` per adapted projection, same HF layout) or,
with ``adapters=True`` (``rltpu export --adapters``), PEFT's ``adapter_config.json`` +
``adapter_model.safetensors`` (and, for a seeded base, the base as an HF directory in ``base/``).
"""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

from rltpu.config import ModelConfig
from rltpu.models.hf.config import to_hf_config
from rltpu.models.hf.shards import ShardedPart, verify_checkpoint
from rltpu.models.hf.weights import CheckpointError, SafetensorsFile, write_safetensors

# the tokenizer files of a HF directory (the data side's HFTokenizer.save copies the same set)
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja",
                   "chat_template.json", "tokenizer.model", "vocab.json", "merges.txt", "added_tokens.json",
                   "generation_config.json")


def write_char_tokenizer(out: Path, alphabet: str) -> dict:
    """``rltpu.data.char_tokenizer.CharTokenizer`` as a ``tokenizers`` WordLevel tokenizer (same ids: pad 0,
    bos 1, eos 2, then one id per character), with BOS prepended like ``encode(add_bos=True)``."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, processors

    from rltpu.data.char_tokenizer import CharTokenizer

    ct = CharTokenizer(alphabet)
    vocab = {ct.PAD: ct.pad_id, ct.BOS: ct.bos_id, ct.EOS: ct.eos_id, **{c: i + 3 for i, c in enumerate(alphabet)}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token=None))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
    tok.decoder = decoders.Fuse()
    tok.add_special_tokens([ct.PAD, ct.BOS, ct.EOS])
    tok.post_processor = processors.TemplateProcessing(single=f"{ct.BOS} $A", pair=f"{ct.BOS} $A $B",
                                                       special_tokens=[(ct.BOS, ct.bos_id)])
    tok.save(str(out / "tokenizer.json"))
    named = {"bos_token": ct.BOS, "eos_token": ct.EOS, "pad_token": ct.PAD}
    (out / "tokenizer_config.json").write_text(json.dumps(
        {"tokenizer_class": "PreTrainedTokenizerFast", "model_max_length": 4096, **named}, indent=1))
    (out / "special_tokens_map.json").write_text(json.dumps(named, indent=1))
    (out / "generation_config.json").write_text(json.dumps(
        {"bos_token_id": ct.bos_id, "eos_token_id": ct.eos_id, "pad_token_id": ct.pad_id}, indent=1))
    return {"bos": ct.bos_id, "eos": ct.eos_id, "pad": ct.pad_id}


def _copy_tokenizer(src: Path, out: Path) -> dict:
    """Copy a tokenizer directory's files; special ids from its generation/tokenizer config."""
    if not src.is_dir() or not any((src / f).is_file() for f in ("tokenizer.json", "tokenizer_config.json")):
        raise CheckpointError(f"tokenizer '{src}' (the run's task.tokenizer / model.path) has no tokenizer.json "
                              f"or tokenizer_config.json; restore it to export the tokenizer")
    for name in TOKENIZER_FILES:
        if (src / name).is_file():
            shutil.copyfile(src / name, out / name)
    ids: dict = {}
    gen = src / "generation_config.json"
    if gen.is_file():
        g = json.loads(gen.read_text())
        eos = g.get("eos_token_id")
        ids = {"bos": g.get("bos_token_id"), "eos": eos[0] if isinstance(eos, list) and eos else eos,
               "pad": g.get("pad_token_id")}
    src_cfg = src / "config.json"
    if src_cfg.is_file():  # the source model's own ids win where it sets them
        c = json.loads(src_cfg.read_text())
        for k in ("bos", "eos", "pad"):
            if c.get(f"{k}_token_id") is not None:
                ids[k] = c[f"{k}_token_id"]
    return ids


def export_checkpoint(checkpoint_dir: str | Path, out_dir: str | Path, shard_mb: float = 4096,
                      adapters: bool = False) -> dict:
    """Write the HF directory; returns a summary (architecture, tensors, files). ``adapters``: a LoRA
    run's adapters in the PEFT format instead of the merged model."""
    ckpt = Path(checkpoint_dir)
    state_path = ckpt / "trainer_state.json"
    if not state_path.is_file():
        raise CheckpointError(f"{ckpt} is not a run checkpoint (no trainer_state.json; give RUN_DIR/checkpoint)")
    try:  # every file against its sha256, as a resume does: a corrupt checkpoint is never exported
        meta = verify_checkpoint(ckpt)
    except ValueError as err:
        raise CheckpointError(f"{err}; export another checkpoint (e.g. {ckpt.name}.prev)") from None
    run_cfg = meta.get("config")
    if not isinstance(run_cfg, dict) or not isinstance(run_cfg.get("model"), dict):
        raise CheckpointError(f"{state_path}: corrupt (no 'config' with a 'model' section)")
    model_dict = dict(run_cfg["model"])
    source_path = model_dict.pop("path", None)
    if (run_cfg.get("trainer") or {}).get("model_impl") == "hf":
        return export_transformers(ckpt, meta, Path(out_dir), shard_mb, adapters)
    # every architecture field is in the saved config already: validate without re-reading model.path
    cfg = ModelConfig.model_validate(model_dict)
    if (ckpt / "adapters.index.json").is_file():
        return _export_lora(ckpt, meta, cfg, source_path, run_cfg, Path(out_dir), shard_mb, adapters)
    if adapters:
        raise CheckpointError(f"{ckpt} is a full-parameter checkpoint (no adapters.index.json): export it without "
                              f"--adapters")
    weights, vocab, spec = _full_spec(ckpt, cfg)
    hf = _write_model_dir(Path(out_dir), cfg, vocab, run_cfg, source_path, spec, weights.read, shard_mb)
    return {"out_dir": str(out_dir), "architecture": hf["architectures"][0], "tensors": len(spec),
            "step": meta.get("step"), "files": sorted(f.name for f in Path(out_dir).iterdir())}


def _full_spec(ckpt: Path, cfg):
    """The policy's weights in a full-parameter checkpoint, checked against the run's model config:
    ``(reader, vocab, [(HF name, shape, dtype)])`` in the model's parameter order."""
    weights = ShardedPart(ckpt, "model") if (ckpt / "model.index.json").is_file() else \
        SafetensorsFile(ckpt / "model.safetensors")
    if "model.embed_tokens.weight" not in weights.entries:
        raise CheckpointError(f"{weights.path}: tensor model.embed_tokens.weight is missing")
    vocab = weights.shape("model.embed_tokens.weight")[0]
    from rltpu.models.spec import param_shapes

    want = param_shapes(cfg, vocab)
    for name, shape in want.items():
        if name not in weights.entries:
            raise CheckpointError(f"{weights.path}: tensor {name} is missing")
        if tuple(weights.shape(name)) != tuple(shape):
            raise CheckpointError(f"{weights.path}: tensor {name} has shape {list(weights.shape(name))} but the "
                                  f"run's model config implies {list(shape)}")
    return weights, vocab, [(name, tuple(shape), weights.dtype(name)) for name, shape in want.items()]


def export_transformers(ckpt: Path, meta: dict, out: Path, shard_mb: float = 4096, adapters: bool = False) -> dict:
    """A ``trainer.model_impl=hf`` run's checkpoint: transformers rebuilds the model from ``model.path``
    (its config.json and base weights), takes the checkpoint's tensors (or merges a LoRA run's adapters,
    ``W + (alpha / rank) B A``) and writes it with ``save_pretrained``, which also turns its in-memory
    layout back into the checkpoint one (e.g. Qwen3-MoE's fused experts into per-expert tensors).
    Holds the whole model in this process (the native export streams tensor by tensor)."""
    import os

    import torch

    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    try:
        import transformers
    except ImportError:
        raise CheckpointError("exporting a trainer.model_impl=hf run needs transformers: pip install 'rltpu[hf]'") \
            from None
    run_cfg = meta["config"]
    source = run_cfg["model"].get("path")
    if not source or not (Path(source) / "config.json").is_file():
        raise CheckpointError(f"the run's model.path {source!r} (its config.json and base weights) is needed to "
                              f"export a trainer.model_impl=hf checkpoint; restore it")
    dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16}[run_cfg["model"].get("dtype") or "float32"]
    model = transformers.AutoModelForCausalLM.from_pretrained(source, dtype=dtype)
    params = model.state_dict()
    lora = (ckpt / "adapters.index.json").is_file()
    if adapters:
        raise CheckpointError("--adapters is not supported for a trainer.model_impl=hf run; export the merged model "
                              "(drop --adapters)")
    part = ShardedPart(ckpt, "adapters" if lora else "model") if (ckpt / f"{'adapters' if lora else 'model'}"
                                                                  ".index.json").is_file() \
        else SafetensorsFile(ckpt / "model.safetensors")
    with torch.no_grad():
        if lora:
            info = meta.get("lora") or {}
            scale = float(info["alpha"]) / int(info["rank"])
            for name in part.entries:
                if name.endswith(".lora_A.weight"):
                    w = params[name[: -len(".lora_A.weight")] + ".weight"]
                    a, b = part.read(name).float(), part.read(name.replace(".lora_A.", ".lora_B.")).float()
                    w.copy_((w.float() + scale * (b @ a)).to(w.dtype))
        else:
            missing = [n for n in params if n not in part.entries and not _tied(model, n)]
            if missing:
                raise CheckpointError(f"{part.path}: tensor {missing[0]} is missing (the run's model.path "
                                      f"{source} builds a model that has it)")
            for name in part.entries:
                if name not in params or tuple(part.shape(name)) != tuple(params[name].shape):
                    raise CheckpointError(f"{part.path}: tensor {name} does not fit the model {source} builds")
                params[name].copy_(part.read(name).to(params[name].dtype))
    out.mkdir(parents=True, exist_ok=True)
    for stale in [*out.glob("model*.safetensors"), out / "model.safetensors.index.json"]:
        stale.unlink(missing_ok=True)
    model.save_pretrained(out, max_shard_size=int(shard_mb * 2**20))
    tok_src = run_cfg.get("task", {}).get("tokenizer") or source
    _copy_tokenizer(Path(tok_src), out)
    return {"out_dir": str(out), "architecture": type(model).__name__, "tensors": len(params), "merged_lora": lora,
            "step": meta.get("step"), "files": sorted(f.name for f in out.iterdir())}


def _tied(model, name: str) -> bool:
    """``name`` is the output embedding tied to the input one (one tensor, saved once)."""
    out = model.get_output_embeddings()
    return bool(getattr(model.config, "tie_word_embeddings", False)) and out is not None and \
        name.startswith("lm_head.") and out.weight is model.get_input_embeddings().weight


HF_DIR = "hf"  # checkpoint.hf_export: <checkpoint>/hf, moved with its checkpoint when checkpoints rotate


def hf_shares(spec: list, world: int) -> list[list]:
    """``spec`` cut into at most ``world`` contiguous runs of about equal bytes (empty ones dropped):
    run i is file ``model-<i+1>-of-<n>``; rank r writes run r."""
    from rltpu.models.hf.weights import _ST_DTYPES, _ST_OF

    sizes = [math.prod(s[1]) * _ST_DTYPES[_ST_OF[s[2]]][1] for s in spec]
    total, shares, acc = sum(sizes), [[] for _ in range(world)], 0
    for s, n in zip(spec, sizes):
        shares[min(world - 1, acc * world // max(total, 1))].append(s)  # by the bytes before this tensor
        acc += n
    return [sh for sh in shares if sh]


def write_hf_share(ckpt: Path, meta: dict, rank: int, world: int) -> None:
    """``checkpoint.hf_export``, run by every trainer rank after the checkpoint's parts are written:
    rank r writes its run of whole tensors (``hf_shares``), each assembled from the ranks' chunks on
    disk one at a time (never the model in one process); rank 0 adds config.json, the tokenizer and
    the index. The directory is complete when the checkpoint is renamed into place."""
    run_cfg = meta.get("config")
    if not isinstance(run_cfg, dict) or not isinstance(run_cfg.get("model"), dict):
        raise CheckpointError("checkpoint.hf_export: the checkpoint's metadata has no run config")
    if (run_cfg.get("trainer") or {}).get("model_impl") == "hf":  # transformers writes it, on rank 0
        if rank == 0:
            export_transformers(Path(ckpt), meta, Path(ckpt) / HF_DIR)
        return
    model_dict = dict(run_cfg["model"])
    source_path = model_dict.pop("path", None)
    cfg = ModelConfig.model_validate(model_dict)
    weights, vocab, spec = _full_spec(Path(ckpt), cfg)
    out = Path(ckpt) / HF_DIR
    out.mkdir(parents=True, exist_ok=True)
    shares = hf_shares(spec, world)
    names = ["model.safetensors"] if len(shares) == 1 else \
        [f"model-{i + 1:05d}-of-{len(shares):05d}.safetensors" for i in range(len(shares))]
    if rank < len(shares):
        write_safetensors(out / names[rank], shares[rank], weights.read, metadata={"format": "pt"})
    if rank == 0:
        _write_model_dir(out, cfg, vocab, run_cfg, source_path, [], None, 0)
        if len(shares) > 1:
            from rltpu.models.hf.weights import _ST_DTYPES, _ST_OF

            total = sum(math.prod(s[1]) * _ST_DTYPES[_ST_OF[s[2]]][1] for s in spec)
            (out / "model.safetensors.index.json").write_text(json.dumps(
                {"metadata": {"total_size": total},
                 "weight_map": {n: names[i] for i, share in enumerate(shares) for n, _, _ in share}}, indent=1))


def _write_model_dir(out: Path, cfg, vocab: int, run_cfg: dict, source_path, spec, read, shard_mb: float) -> dict:
    """config.json, the tokenizer and the weights ``spec`` (each fetched by ``read``): an HF directory."""
    out.mkdir(parents=True, exist_ok=True)
    tok_src = run_cfg.get("task", {}).get("tokenizer") or source_path
    if tok_src:
        ids = _copy_tokenizer(Path(tok_src), out)
    else:
        from rltpu.data.char_tokenizer import DEFAULT_ALPHABET

        ids = write_char_tokenizer(out, DEFAULT_ALPHABET)
    hf = to_hf_config(cfg, vocab, ids.get("bos"), ids.get("eos"), ids.get("pad"))
    (out / "config.json").write_text(json.dumps(hf, indent=1))
    if spec:  # write_hf_share writes the weights rank by rank itself
        _write_weights(out, spec, read, int(shard_mb * 2**20))
    return hf


def _export_lora(ckpt: Path, meta: dict, cfg, source_path, run_cfg: dict, out: Path, shard_mb: float,
                 adapters_only: bool) -> dict:
    """A LoRA checkpoint: merged model, or PEFT adapters (+ ``base/`` when the base is the seeded init)."""
    from rltpu.models.spec import lora_shapes, param_shapes

    info = meta.get("lora") or {}
    if not info:
        raise CheckpointError(f"{ckpt}/trainer_state.json: adapters without a 'lora' entry; corrupt checkpoint")
    lora = _LoraView(info)
    vocab = int(info["vocab_size"])
    part = ShardedPart(ckpt, "adapters")
    want = lora_shapes(cfg, lora, vocab)
    for name, shape in want.items():
        if name not in part.entries or tuple(part.shape(name)) != tuple(shape):
            raise CheckpointError(f"{part.path}: adapter {name} is missing or not {list(shape)}; the run's lora "
                                  f"config implies it")
    if source_path:  # the base: the model directory the run loaded
        from rltpu.models.hf.weights import CheckpointDir

        src = CheckpointDir(source_path)
        base_read = src.read
    else:  # the seeded init, rebuilt (identical to what the trainer built)
        from rltpu.models.torch_llama import init_state_dict

        state = init_state_dict(cfg, vocab, int(info["base_seed"]))
        base_read = state.__getitem__
    shapes = param_shapes(cfg, vocab)
    if adapters_only:
        out.mkdir(parents=True, exist_ok=True)
        base_dir = source_path
        if not source_path:
            spec = [(n, tuple(s), cfg.dtype) for n, s in shapes.items()]
            _write_model_dir(out / "base", cfg, vocab, run_cfg, None, spec, base_read, shard_mb)
            base_dir = str((out / "base").resolve())
        targets = sorted({n.rsplit(".", 3)[-3] for n in want})
        (out / "adapter_config.json").write_text(json.dumps({
            "peft_type": "LORA", "task_type": "CAUSAL_LM", "base_model_name_or_path": base_dir,
            "r": lora.rank, "lora_alpha": lora.alpha, "lora_dropout": lora.dropout, "target_modules": targets,
            "bias": "none", "fan_in_fan_out": False, "inference_mode": True, "init_lora_weights": True,
            "use_rslora": False, "use_dora": False, "modules_to_save": None, "layers_to_transform": None}, indent=1))
        spec = [("base_model.model." + n, tuple(s), part.dtype(n)) for n, s in want.items()]
        (out / "adapter_model.safetensors").unlink(missing_ok=True)
        write_safetensors(out / "adapter_model.safetensors", spec,
                          lambda n: part.read(n.removeprefix("base_model.model.")), metadata={"format": "pt"})
        return {"out_dir": str(out), "format": "peft", "base": base_dir, "tensors": len(spec),
                "step": meta.get("step"), "files": sorted(f.name for f in out.iterdir())}

    def merged(name: str):
        w = base_read(name)
        a_name = name[: -len(".weight")] + ".lora_A.weight"
        if a_name not in want:
            return w
        a, b = part.read(a_name).float(), part.read(a_name.replace(".lora_A.", ".lora_B.")).float()
        return (w.float() + lora.scale * (b @ a)).to(w.dtype)  # the same sum learner.lora.merge_into forms

    spec = [(n, tuple(s), cfg.dtype) for n, s in shapes.items()]
    hf = _write_model_dir(out, cfg, vocab, run_cfg, source_path, spec, merged, shard_mb)
    return {"out_dir": str(out), "architecture": hf["architectures"][0], "tensors": len(spec), "merged_lora": True,
            "step": meta.get("step"), "files": sorted(f.name for f in out.iterdir())}


class _LoraView:
    """The ``lora`` entry of ``trainer_state.json`` with ``LoraConfig``'s attribute names."""

    def __init__(self, info: dict):
        self.rank, self.alpha = int(info["rank"]), float(info["alpha"])
        self.dropout, self.target_modules = float(info.get("dropout", 0.0)), tuple(info["target_modules"])
        self.scale = self.alpha / self.rank


def _write_weights(out: Path, spec: list, read, shard_bytes: int) -> None:
    """``model.safetensors``, or shards of at most ``shard_bytes`` (a larger tensor alone) + the index."""
    import math

    from rltpu.models.hf.weights import _ST_DTYPES, _ST_OF

    size = lambda s: math.prod(s[1]) * _ST_DTYPES[_ST_OF[s[2]]][1]  # noqa: E731
    shards, cur, cur_bytes = [], [], 0
    for s in spec:
        if cur and cur_bytes + size(s) > shard_bytes:
            shards.append(cur)
            cur, cur_bytes = [], 0
        cur.append(s)
        cur_bytes += size(s)
    shards.append(cur)
    for stale in [*out.glob("model*.safetensors"), out / "model.safetensors.index.json"]:
        stale.unlink(missing_ok=True)  # a previous export into the same directory
    if len(shards) == 1:
        write_safetensors(out / "model.safetensors", spec, read, metadata={"format": "pt"})
        return
    weight_map = {}
    for i, part in enumerate(shards):
        fname = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        write_safetensors(out / fname, part, read, metadata={"format": "pt"})
        weight_map.update({name: fname for name, _, _ in part})
    (out / "model.safetensors.index.json").write_text(json.dumps(
        {"metadata": {"total_size": sum(size(s) for s in spec)}, "weight_map": weight_map}, indent=1))
