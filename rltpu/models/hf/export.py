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
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from rltpu.config import ModelConfig
from rltpu.models.hf.config import to_hf_config
from rltpu.models.hf.shards import ShardedPart
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


def export_checkpoint(checkpoint_dir: str | Path, out_dir: str | Path, shard_mb: float = 4096) -> dict:
    """Write the HF directory; returns a summary (architecture, tensors, files)."""
    ckpt = Path(checkpoint_dir)
    state_path = ckpt / "trainer_state.json"
    if not state_path.is_file():
        raise CheckpointError(f"{ckpt} is not a run checkpoint (no trainer_state.json; give RUN_DIR/checkpoint)")
    try:
        meta = json.loads(state_path.read_text())
        run_cfg = meta["config"]
    except (json.JSONDecodeError, KeyError):
        raise CheckpointError(f"{state_path}: corrupt (not JSON with a 'config')") from None
    model_dict = dict(run_cfg["model"])
    source_path = model_dict.pop("path", None)
    # every architecture field is in the saved config already: validate without re-reading model.path
    cfg = ModelConfig.model_validate(model_dict)
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
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tok_src = run_cfg.get("task", {}).get("tokenizer") or source_path
    if tok_src:
        ids = _copy_tokenizer(Path(tok_src), out)
    else:
        from rltpu.data.char_tokenizer import DEFAULT_ALPHABET

        ids = write_char_tokenizer(out, DEFAULT_ALPHABET)
    hf = to_hf_config(cfg, vocab, ids.get("bos"), ids.get("eos"), ids.get("pad"))
    (out / "config.json").write_text(json.dumps(hf, indent=1))
    spec = [(name, tuple(shape), weights.dtype(name)) for name, shape in want.items()]
    _write_weights(out, spec, weights.read, int(shard_mb * 2**20))
    return {"out_dir": str(out), "architecture": hf["architectures"][0], "tensors": len(spec),
            "step": meta.get("step"), "files": sorted(f.name for f in out.iterdir())}


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
