"""A tiny random checkpoint of any supported family, written by ``transformers`` itself.

    rltpu tiny-checkpoint OUT_DIR --arch qwen2 [--tied] [--dtype bfloat16] [--sliding-window 8]
                                 [--llama3-rope] [--shard-kb 64] [--seed 0]

``--arch``: llama, qwen2, qwen3, mistral, or gemma3 / qwen3_moe (only ``trainer.model_impl=hf`` trains those).

Writes config.json + safetensors (sharded with an index when ``--shard-kb`` is given) with
``save_pretrained``, plus a local tokenizer (a byte-level BPE with a ChatML chat template, from
``rltpu.data.chat_example.make_tiny_tokenizer``) in the same directory. Used by the tests, and by
anyone who wants to dry-run a ``model.path`` config without a real model. Nothing is downloaded.

Why ``transformers`` writes it: the file layout, names and config keys are then exactly what a
real checkpoint has, so loading it tests our reader and not our own writer. Norm weights and
biases are randomised too (HF initialises them to ones/zeros, which would hide a missing bias or
q/k norm in a logits comparison).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ARCHS = ("llama", "qwen2", "qwen3", "mistral")
# families only transformers' modeling code runs here (trainer.model_impl=hf; sampler.backend=vllm)
HF_ONLY_ARCHS = ("gemma3", "qwen3_moe")


def _transformers():
    import os

    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
    try:
        import transformers
    except ImportError:
        raise SystemExit("rltpu: error: writing a tiny checkpoint needs transformers: pip install 'rltpu[hf]' "
                         "(or run make setup)") from None
    return transformers


def tokenizer_corpus() -> list[str]:
    """Text the tiny tokenizer is trained on: the chat example's prompts plus role names."""
    from rltpu.data.chat_example import repeat_rows

    rows = repeat_rows(64)
    return [m["content"] for r in rows for m in r["messages"]] + [r["answer"] for r in rows] + \
        ["user assistant system", "The quick brown fox jumps over the lazy dog."]


def write_tiny_checkpoint(out_dir: str | Path, arch: str = "qwen2", *, tied: bool = False, dtype: str = "float32",
                          seed: int = 0, hidden_size: int = 64, intermediate_size: int = 128, num_layers: int = 2,
                          num_heads: int = 4, num_kv_heads: int = 2, head_dim: int | None = None,
                          sliding_window: int | None = None, llama3_rope: bool = False, attention_bias: bool = False,
                          max_position_embeddings: int = 256, init_std: float = 0.1, shard_bytes: int | None = None,
                          with_tokenizer: bool = True, vocab_size: int | None = None, tokenizer: str = "bpe") -> Path:
    """Write a random ``arch`` checkpoint (+ tokenizer) to ``out_dir`` with ``save_pretrained``.

    ``sliding_window`` on qwen2/qwen3 makes every layer after the first slide (``layer_types``
    mixes both kinds); on mistral every layer slides. ``llama3_rope`` uses Llama 3 RoPE scaling
    with a small original context (16) so the scaling changes the angles of short sequences.
    ``vocab_size`` defaults to the tokenizer's size (or 128 without one).
    """
    if arch not in ARCHS + HF_ONLY_ARCHS:
        raise ValueError(f"arch {arch!r} is not supported (supported: {', '.join(ARCHS + HF_ONLY_ARCHS)})")
    if tokenizer in ("words", "arith") and arch != "llama":
        # transformers 5 loads a qwen2/qwen3/mistral directory with its family's BPE tokenizer class,
        # rebuilt from the vocabulary: whole-word ids without merges would silently vanish from prompts
        raise ValueError(f"--tokenizer words needs --arch llama (transformers loads {arch} tokenizers as BPE, "
                         f"which drops word-level ids)")
    T = _transformers()
    import torch

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    special: dict = {}
    if with_tokenizer:
        from tokenizers import Tokenizer

        from rltpu.data.chat_example import make_tiny_tokenizer

        if tokenizer == "arith":  # the words of rltpu.data.arithmetic's GSM8K-format sums
            from rltpu.data.arithmetic import corpus

            make_tiny_tokenizer(out, corpus(), kind="words")
        else:
            make_tiny_tokenizer(out, tokenizer_corpus(), vocab_size=512, kind=tokenizer)
        tok = Tokenizer.from_file(str(out / "tokenizer.json"))
        n_tok = tok.get_vocab_size(with_added_tokens=True)
        special = {"eos_token_id": tok.token_to_id("<|im_end|>"), "pad_token_id": tok.token_to_id("<|endoftext|>"),
                   "bos_token_id": None}
        vocab_size = vocab_size or n_tok
        if vocab_size < n_tok:
            raise ValueError(f"vocab_size={vocab_size} is smaller than the tokenizer's {n_tok} ids")
    vocab_size = vocab_size or 128
    common = dict(vocab_size=vocab_size, hidden_size=hidden_size, intermediate_size=intermediate_size,
                  num_hidden_layers=num_layers, num_attention_heads=num_heads, num_key_value_heads=num_kv_heads,
                  max_position_embeddings=max_position_embeddings, tie_word_embeddings=tied,
                  initializer_range=init_std, rms_norm_eps=1e-6, **special)
    if head_dim is not None:
        common["head_dim"] = head_dim
    if arch == "llama":
        rope = {"rope_type": "default", "rope_theta": 10000.0}
        if llama3_rope:
            rope = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
                    "high_freq_factor": 4.0, "original_max_position_embeddings": 16}
        config = T.LlamaConfig(rope_parameters=rope, attention_bias=attention_bias, **common)
    elif arch == "mistral":
        config = T.MistralConfig(sliding_window=sliding_window, **common)
    elif arch == "gemma3":  # text-only Gemma 3 (Gemma3ForCausalLM): every other layer slides
        config = T.Gemma3TextConfig(head_dim=head_dim or hidden_size // num_heads, sliding_window=sliding_window or 8,
                                    layer_types=["sliding_attention" if i % 2 == 0 else "full_attention"
                                                 for i in range(num_layers)], **common)
    elif arch == "qwen3_moe":  # 4 experts, 2 routed per token, every layer sparse
        config = T.Qwen3MoeConfig(head_dim=head_dim or hidden_size // num_heads, num_experts=4, num_experts_per_tok=2,
                                  moe_intermediate_size=intermediate_size // 2, decoder_sparse_step=1,
                                  attention_bias=attention_bias, **common)
    else:
        cls = T.Qwen2Config if arch == "qwen2" else T.Qwen3Config
        extra = {} if arch == "qwen2" else {"attention_bias": attention_bias}
        window = {"use_sliding_window": True, "sliding_window": sliding_window, "max_window_layers": 1} \
            if sliding_window else {}
        config = cls(**window, **extra, **common)
    torch.manual_seed(seed)
    model = T.AutoModelForCausalLM.from_config(config)
    gen = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for p in model.parameters():
            if p.ndim == 1:  # norms (ones) and biases (zeros) get random values too
                p.add_(torch.randn(p.shape, generator=gen) * 0.2)
    model = model.to(getattr(torch, dtype))
    kwargs = {"max_shard_size": shard_bytes} if shard_bytes else {}
    model.save_pretrained(out, **kwargs)
    if with_tokenizer:  # save_pretrained wrote its own generation_config.json: the tokenizer's wins
        gen_cfg = json.loads((out / "generation_config.json").read_text())
        gen_cfg.update(eos_token_id=[special["eos_token_id"], special["pad_token_id"]],
                       pad_token_id=special["pad_token_id"])
        gen_cfg.pop("bos_token_id", None)
        (out / "generation_config.json").write_text(json.dumps(gen_cfg, indent=1))
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="rltpu tiny-checkpoint", description=__doc__.splitlines()[0])
    add_arguments(p)
    return run(p.parse_args(argv))


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("out_dir", help="directory to write (config.json, safetensors, tokenizer)")
    p.add_argument("--arch", choices=ARCHS + HF_ONLY_ARCHS, default="qwen2",
                   help="gemma3 / qwen3_moe: trained only with trainer.model_impl=hf, sampled with sampler.backend=vllm")
    p.add_argument("--tied", action="store_true", help="tie lm_head to the embeddings")
    p.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32")
    p.add_argument("--sliding-window", type=int, default=None, help="mistral/qwen2/qwen3 sliding window")
    p.add_argument("--llama3-rope", action="store_true", help="llama: Llama 3 RoPE scaling")
    p.add_argument("--hidden-size", type=int, default=64)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--init-std", type=float, default=0.1,
                   help="weights' normal std (0.1 makes logits differences visible in tests; 0.02 is HF's default)")
    p.add_argument("--shard-kb", type=int, default=None, help="shard the weights (writes an index)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--tokenizer", choices=("bpe", "words", "arith"), default="bpe",
                   help="bpe: a 512-id byte-level BPE; words: one id per word of the chat example (33 ids); "
                        "arith: one id per word of rltpu.data.arithmetic's sums")


def run(args) -> int:
    out = write_tiny_checkpoint(args.out_dir, args.arch, tied=args.tied, dtype=args.dtype, seed=args.seed,
                                hidden_size=args.hidden_size, num_layers=args.layers,
                                sliding_window=args.sliding_window, llama3_rope=args.llama3_rope,
                                tokenizer=args.tokenizer, init_std=args.init_std,
                                shard_bytes=args.shard_kb * 1024 if args.shard_kb else None)
    print(json.dumps({"path": str(out), "files": sorted(f.name for f in out.iterdir())}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
