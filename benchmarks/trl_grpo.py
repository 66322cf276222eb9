"""TRL's ``GRPOTrainer`` beside ``rltpu train`` at equal work, on the same checkpoints, in one run.

    .venv/bin/python benchmarks/trl_grpo.py [--workloads 0.8M:8x32,0.8M:128x64,25M:32x64] [--steps 6]
                                            [--trl-threads N] [--out FILE]

Needs the ``bench`` extra (``pip install -e '.[bench]'``: TRL 1.16). Everything is built here, offline:
the random Qwen2-shaped checkpoints of ``benchmarks/sampler.py --vs-vllm`` (``VS_MODELS``: 0.8M and 25M
parameters, written by ``transformers``, 68-token vocabulary, 256 positions, fp32), a character
tokenizer of exactly those 68 ids (pad 0, EOS 1, one id per character) and a JSONL copy task
(``c<digits>=`` -> the digits; prompts of 8-32 tokens), scored by ``rltpu.data.rewards:partial_credit``.

A workload ``MODEL:ROWSxTOKENS`` is ROWS completions a step (ROWS / 8 prompts x 8 samples) of at most
TOKENS new tokens (EOS may end a row earlier; the mean length is recorded for both). Both systems run
GRPO with the same settings: KL coefficient 0 (no reference model), one update per batch, constant lr
1e-5, AdamW betas (0.9, 0.99) and no weight decay, clip 0.2, grad-norm clip 1, token-mean loss (TRL's
``dapo``), group-std scaled advantages, temperature 1, top-k/top-p off, fp32. Each in a fresh process:

* TRL: ``GRPOTrainer`` (generation by ``transformers``' ``generate``, CPU, every core of the machine as
  torch threads unless ``--trl-threads``); ``trl_step_s`` is one optimizer step (generation + scoring + update), timed by a
  callback, ``trl_generate_s`` the generation-and-scoring part of it. TRL imports vLLM at import time
  whenever it is installed (here: rltpu's ``vllm`` extra), about 10 s, though it never calls it without
  ``use_vllm``; the child hides it, as ``pip install trl`` would have it (``--trl-with-vllm``: not);
* rltpu: ``rltpu train`` with 1 sampler + 1 trainer chip, disaggregated (emulated chips: one core each,
  so each phase runs on one of the two cores while the other role waits), and (``rltpu_colocated``) on 2
  colocated chips, each process a sampler and an FSDP2 trainer rank, so every phase uses both cores as
  TRL's process does; ``step_s`` / ``sample_s`` / ``train_s`` from its ``metrics.jsonl``,
  ``trainer_busy_s`` the trainer's own ``train_step`` seconds;
* time to first step: from the process's launch to the end of the first step (TRL: the callback; rltpu:
  the first ``metrics.jsonl`` line), so imports, Ray, compilation and loading are all in it; rltpu's
  ``startup_s`` splits it by phase (its ``trace.json``) and ``compiling`` says how many sampler programs
  came from the persistent compile cache (the user's own, shared by runs: a rerun is warm).

Step figures are medians over steps 2..N. The load average is recorded before and after each system
(the machine may be shared: compare runs only at similar load). Prints one JSON document and writes
it to ``--out`` (default ``benchmarks/results/single/trl_grpo-<machine>-<date>.json``).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

# before any torch import: an autoloaded torch_tpu writes TORCH_DEVICE_BACKEND_AUTOLOAD=1 into this
# process's environment, which the children below inherit (the rltpu driver paid 3-4 s of torch_tpu
# imports for it in the results files before 2026-12-03d; TRL's child always set 0)
os.environ.setdefault("TORCH_DEVICE_BACKEND_AUTOLOAD", "0")

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "benchmarks"))

GROUP = 8
LR = 1e-5
PROMPT_BUCKET = 32
# 68 ids: pad, EOS, then one per character (the vocabulary of VS_MODELS' checkpoints)
CHARS = "0123456789abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ=+-*"
WORKLOADS = "0.8M:8x32,0.8M:128x64,25M:32x64"


def write_tokenizer(directory: Path) -> Path:
    """A character tokenizer of the checkpoints' 68 ids, as a Hugging Face tokenizer directory."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers

    from sampler import VS_EOS, VS_PAD, VS_VOCAB

    vocab = {"<pad>": VS_PAD, "<eos>": VS_EOS} | {c: i + 2 for i, c in enumerate(CHARS)}
    assert len(vocab) == VS_VOCAB and sorted(vocab.values()) == list(range(VS_VOCAB))
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<pad>"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    tok.decoder = decoders.Fuse()
    directory.mkdir(parents=True, exist_ok=True)
    tok.save(str(directory / "tokenizer.json"))
    named = {"eos_token": "<eos>", "pad_token": "<pad>"}
    (directory / "tokenizer_config.json").write_text(json.dumps(
        {"tokenizer_class": "PreTrainedTokenizerFast", "model_max_length": 256, **named}))
    (directory / "special_tokens_map.json").write_text(json.dumps(named))
    return directory


def write_dataset(path: Path, n: int = 4096, seed: int = 0) -> Path:
    """The copy task with prompts of 8-32 tokens: ``c<6-30 digits>=`` -> the digits."""
    import numpy as np

    rng = np.random.default_rng(seed)
    with open(path, "w") as f:
        for _ in range(n):
            digits = "".join(map(str, rng.integers(0, 10, int(rng.integers(6, 31)))))
            f.write(json.dumps({"prompt": f"c{digits}=", "answer": digits}) + "\n")
    return path


def write_checkpoint(directory: Path, name: str) -> Path:
    from rltpu.models.hf.tiny import write_tiny_checkpoint
    from sampler import VS_MODELS, VS_VOCAB

    return write_tiny_checkpoint(directory, "qwen2", vocab_size=VS_VOCAB, with_tokenizer=False,
                                 max_position_embeddings=256, init_std=0.02, seed=0, **VS_MODELS[name])


# ---------------------------------------------------------------------------------------------
# TRL, in a child process (``--trl-child``): its imports and model load count toward the first step


def trl_child(args) -> int:
    t_launch = float(args.t_launch)
    import torch

    if args.trl_threads:
        torch.set_num_threads(args.trl_threads)
    if not args.trl_with_vllm:
        # TRL imports vLLM at import time whenever it is installed (here: rltpu's `vllm` extra), about 10 s on
        # this machine, though its GRPO with use_vllm=False never calls it; a user of `pip install trl` does not
        # pay that, so the baseline does not either (find_spec sees None and TRL takes vLLM as absent)
        sys.modules["vllm"] = None
    from datasets import load_dataset
    from transformers import AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from rltpu.data.rewards import partial_credit

    def reward(prompts, completions, answer, **_):
        return [partial_credit(c, {"answer": a}) for c, a in zip(completions, answer)]

    times: dict = {"steps": [], "generate": []}

    class Timer(TrainerCallback):
        def on_step_begin(self, *a, **k):
            self.t0 = time.perf_counter()

        def on_step_end(self, *a, **k):
            times["steps"].append(time.perf_counter() - self.t0)
            times.setdefault("first_step_end_wall", time.time())

    cfg = GRPOConfig(
        output_dir=args.work, use_cpu=True, bf16=False, report_to=[], save_strategy="no", logging_steps=1,
        disable_tqdm=True, max_steps=args.steps, seed=0, learning_rate=LR, lr_scheduler_type="constant",
        warmup_steps=0, weight_decay=0.0, adam_beta1=0.9, adam_beta2=0.99, max_grad_norm=1.0,
        per_device_train_batch_size=args.rows, gradient_accumulation_steps=1, num_generations=GROUP,
        steps_per_generation=1, num_iterations=1, max_completion_length=args.tokens, temperature=1.0, top_p=1.0,
        top_k=0, beta=0.0, epsilon=0.2, loss_type="dapo", scale_rewards="group", log_completions=False,
        dataloader_num_workers=0, model_init_kwargs={"dtype": "float32"},
    )
    tok = AutoTokenizer.from_pretrained(args.tokenizer, local_files_only=True)
    data = load_dataset("json", data_files=args.dataset, split="train")
    trainer = GRPOTrainer(model=args.ckpt, reward_funcs=reward, args=cfg, train_dataset=data, processing_class=tok,
                          callbacks=[Timer()])
    inner = trainer._generate_and_score_completions
    lengths = []

    def timed(*a, **k):
        t0 = time.perf_counter()
        out = inner(*a, **k)
        times["generate"].append(time.perf_counter() - t0)
        lengths.append(float(out["completion_mask"].sum(1).float().mean()))
        return out

    trainer._generate_and_score_completions = timed
    trainer.train()
    doc = {"threads": torch.get_num_threads(), "vllm_imported": sys.modules.get("vllm") is not None,
           "step_s": times["steps"], "generate_s": times["generate"],
           "mean_completion_len": lengths, "first_step_s": times["first_step_end_wall"] - t_launch}
    Path(args.json_out).write_text(json.dumps(doc))
    return 0


def run_trl(ckpt: Path, tokdir: Path, dataset: Path, rows: int, tokens: int, steps: int, work: Path,
            threads: int, with_vllm: bool = False) -> dict:
    out = work / "trl.json"
    env = dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", HF_DATASETS_OFFLINE="1",
               TORCH_DEVICE_BACKEND_AUTOLOAD="0", TOKENIZERS_PARALLELISM="false",
               # TRL imports vLLM when it is installed (the `vllm` extra), and vLLM refuses to pick between its
               # CPU platform and the TPU plugin libtpu brings unless told; TRL's generation here is its own
               VLLM_TARGET_DEVICE="cpu")
    t = time.time()
    cmd = [sys.executable, str(Path(__file__).resolve()), "--trl-child", "--t-launch", repr(t), "--ckpt", str(ckpt),
           "--tokenizer", str(tokdir), "--dataset", str(dataset), "--rows", str(rows), "--tokens", str(tokens),
           "--steps", str(steps), "--work", str(work / "trl"), "--json-out", str(out), "--trl-threads", str(threads),
           *(["--trl-with-vllm"] if with_vllm else [])]
    res = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=3600)
    if res.returncode:
        raise RuntimeError(f"TRL run failed: {res.stderr.strip().splitlines()[-10:]}")
    return json.loads(out.read_text())


# ---------------------------------------------------------------------------------------------
# rltpu train, in a child process


def rltpu_config(ckpt: Path, tokdir: Path, dataset: Path, rows: int, tokens: int, steps: int,
                 colocated: bool = False) -> dict:
    """disaggregated: 1 sampler + 1 trainer chip (one core each; the phases alternate, so each uses one
    of the two cores). colocated: 2 chips, each process both a sampler and an FSDP2 trainer rank, so
    every phase runs on both cores, as TRL's one process does."""
    placement = ({"mode": "colocated", "sampler_chips": 2, "trainer_chips": 2} if colocated
                 else {"sampler_chips": 1, "trainer_chips": 1})
    return {
        "name": "trl-grpo-bench", "seed": 0, "progress": False,
        "cluster": {"generation": "v5e", "topology": "2x2", "slices": 1},
        "placement": placement,
        "model": {"path": str(ckpt)},
        "task": {"dataset": str(dataset), "tokenizer": str(tokdir), "reward_fn": "rltpu.data.rewards:partial_credit"},
        "sampler": {"group_size": GROUP, "temperature": 1.0, "max_new_tokens": tokens,
                    "batch_buckets": [rows // 2 if colocated else rows], "prompt_buckets": [PROMPT_BUCKET]},
        "trainer": {"steps": steps, "prompts_per_step": rows // GROUP, "lr": LR, "betas": [0.9, 0.99],
                    "weight_decay": 0.0, "warmup_steps": 0, "kl_coef": 0.0, "grad_clip": 1.0, "clip_eps": 0.2,
                    "ppo_epochs": 1, "algorithm": "grpo", "loss_agg_mode": "token-mean"},
        "sync": {"verify_every": 0},
    }


def run_rltpu(cfg: dict, work: Path) -> dict:
    import yaml

    path = work / "rltpu.yaml"
    path.write_text(yaml.safe_dump(cfg))
    run_dir = work / "rltpu-run"
    env = dict(os.environ, RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER="0", RAY_USAGE_STATS_ENABLED="0")
    metrics = run_dir / "metrics.jsonl"
    t0 = time.perf_counter()
    p = subprocess.Popen([sys.executable, "-m", "rltpu.cli", "train", str(path), "--run-dir", str(run_dir)], cwd=REPO,
                         env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    first = None
    while p.poll() is None:
        if first is None and metrics.exists() and metrics.read_text().strip():
            first = time.perf_counter() - t0
        time.sleep(0.05)
    out, err = p.communicate()
    wall = time.perf_counter() - t0
    if p.returncode:
        raise RuntimeError(f"rltpu train failed ({p.returncode}): {err.strip().splitlines()[-10:]}")
    recs = [json.loads(line) for line in metrics.read_text().splitlines() if line.strip()]
    keep = ("step_s", "sample_s", "train_s", "sync_s", "trainer_busy_s", "sampler_busy_s", "response_len",
            "micro_batches", "train_padding_frac")
    return {"first_step_s": first, "wall_s": wall, "steps": [{k: r.get(k) for k in keep} for r in recs],
            "startup_s": startup_phases(run_dir / "trace.json"), "compiling": compiling(run_dir / "placement.json"),
            "summary": [line for line in (out + err).splitlines() if "step" in line.lower()][-3:]}


def compiling(placement: Path) -> dict:
    """The samplers' programs built at start-up and how many came from the persistent compile cache
    (the user's cache is shared by runs: a rerun of the same shapes loads instead of compiling)."""
    try:
        return json.loads(placement.read_text()).get("compiling", {})
    except (OSError, ValueError):
        return {}


def startup_phases(trace: Path) -> dict:
    """The driver's start-up spans of ``trace.json`` (``rltpu.observe.startup.STARTUP``) and the first
    step's phases, in seconds from the launch; {} when the run wrote none."""
    from rltpu.observe.startup import STARTUP

    try:
        events = json.loads(trace.read_text())["traceEvents"]
    except (OSError, ValueError, KeyError):
        return {}
    pid = next((e["pid"] for e in events if e["ph"] == "M" and e["args"]["name"].startswith("controller")), None)
    out: dict = {}
    for e in events:
        if e["ph"] == "X" and e["pid"] == pid and (e["name"] in STARTUP or e["args"].get("step") == 1):
            key = e["name"] if e["name"] in STARTUP else f"step1_{e['name']}"
            out[key] = round(out.get(key, 0.0) + e["dur"] / 1e6, 2)
    return out


# ---------------------------------------------------------------------------------------------


def med(xs):
    return round(statistics.median(xs), 4) if xs else None


def workload(spec: str) -> tuple[str, int, int]:
    name, shape = spec.split(":")
    rows, tokens = shape.lower().split("x")
    return name, int(rows), int(tokens)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--workloads", default=WORKLOADS)
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--systems", default="trl,rltpu,rltpu_colocated")
    ap.add_argument("--out", default=None)
    ap.add_argument("--trl-threads", type=int, default=0, help="torch threads in TRL's process (0: torch's default, "
                    "one per core); a loaded machine slows multi-threaded torch far more than one thread")
    ap.add_argument("--trl-with-vllm", action="store_true", help="let TRL import vLLM when installed (it does so at "
                    "import even with use_vllm=False; off by default: `pip install trl` has no vLLM)")
    ap.add_argument("--trl-child", action="store_true", help=argparse.SUPPRESS)
    for a in ("t-launch", "ckpt", "tokenizer", "dataset", "work", "json-out"):
        ap.add_argument(f"--{a}", help=argparse.SUPPRESS)
    ap.add_argument("--rows", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--tokens", type=int, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.trl_child:
        return trl_child(args)
    import datetime as dt

    import torch
    import transformers
    import trl

    from all import commit_info, machine, machine_slug

    systems = args.systems.split(",")
    work = Path(tempfile.mkdtemp(prefix="rltpu-trl-bench-"))
    tokdir = write_tokenizer(work / "tokenizer")
    dataset = write_dataset(work / "copy.jsonl")
    env = {"python": platform.python_version(), "torch": torch.__version__, "transformers": transformers.__version__,
           "trl": trl.__version__, "trl_threads": args.trl_threads or "torch default (one per core)",
           "trl_imports_vllm": args.trl_with_vllm,
           "affinity": len(os.sched_getaffinity(0)), "loadavg_start": list(os.getloadavg())}
    ckpts, results = {}, {}
    t_start = time.perf_counter()
    for spec in args.workloads.split(","):
        name, rows, tokens = workload(spec)
        if rows % GROUP:
            raise SystemExit(f"workload {spec}: rows must be a multiple of the group size {GROUP}")
        if name not in ckpts:
            ckpts[name] = write_checkpoint(work / f"ckpt-{name}", name)
        wdir = work / spec.replace(":", "-")
        wdir.mkdir()
        res: dict = {"model": name, "rows": rows, "max_new_tokens": tokens, "group_size": GROUP}
        if "trl" in systems:
            load0 = list(os.getloadavg())
            t = run_trl(ckpts[name], tokdir, dataset, rows, tokens, args.steps, wdir, args.trl_threads,
                        args.trl_with_vllm)
            res["trl"] = {"step_s": med(t["step_s"][1:]), "generate_s": med(t["generate_s"][1:]),
                          "update_s": med([s - g for s, g in zip(t["step_s"][1:], t["generate_s"][1:])]),
                          "first_step_s": round(t["first_step_s"], 2), "threads": t["threads"],
                          "mean_completion_len": round(statistics.fmean(t["mean_completion_len"]), 1),
                          "raw": t, "loadavg_before": load0, "loadavg_after": list(os.getloadavg())}
            print(f"{spec} TRL: step {res['trl']['step_s']} s, first step {res['trl']['first_step_s']} s",
                  file=sys.stderr)
        for system in [s for s in ("rltpu", "rltpu_colocated") if s in systems]:
            colocated = system == "rltpu_colocated"
            if colocated and rows // GROUP < 2:
                continue  # one prompt a step cannot be split over two processes
            load0 = list(os.getloadavg())
            cfg = rltpu_config(ckpts[name], tokdir, dataset, rows, tokens, args.steps, colocated)
            sdir = wdir / system
            sdir.mkdir()
            r = run_rltpu(cfg, sdir)
            st = r["steps"][1:]
            res[system] = {k: med([s[k] for s in st]) for k in ("step_s", "sample_s", "train_s", "sync_s",
                                                                 "trainer_busy_s")}
            res[system] |= {"first_step_s": round(r["first_step_s"], 2), "startup_s": r["startup_s"],
                             "compiling": r["compiling"],
                             "wall_s": round(r["wall_s"], 1),
                             "mean_completion_len": round(statistics.fmean(s["response_len"] for s in r["steps"]), 1),
                             "config": cfg, "raw_steps": r["steps"], "loadavg_before": load0,
                             "loadavg_after": list(os.getloadavg())}
            rl = res[system]
            print(f"{spec} {system}: step {rl['step_s']} s (sample {rl['sample_s']}, train {rl['train_s']}), "
                  f"first step {rl['first_step_s']} s", file=sys.stderr)
        for system in ("rltpu", "rltpu_colocated"):
            if "trl" in res and system in res:
                tr, rl = res["trl"], res[system]
                res.setdefault("ratios", {})[system] = {
                    "train_over_trl_step": round(rl["train_s"] / tr["step_s"], 3),
                    "step_over_trl_step": round(rl["step_s"] / tr["step_s"], 3),
                    "first_step_over_trl": round(rl["first_step_s"] / tr["first_step_s"], 3)}
        results[spec] = res
    env["loadavg_end"] = list(os.getloadavg())
    table = ["| workload | TRL step (generation + update) | rltpu layout | rltpu step | rltpu sample / train | "
             "time to first step TRL / rltpu |", "|---|---|---|---|---|---|"]
    for res in results.values():
        tr = res.get("trl", {})
        for system, layout in (("rltpu", "1 sampler + 1 trainer"), ("rltpu_colocated", "2 colocated")):
            if system not in res:
                continue
            rl = res[system]
            table.append(f"| {res['model']}, {res['rows']} rows x {res['max_new_tokens']} tokens | {tr.get('step_s')} s | "
                         f"{layout} | {rl.get('step_s')} s | {rl.get('sample_s')} / {rl.get('train_s')} s | "
                         f"{tr.get('first_step_s')} s / {rl.get('first_step_s')} s |")
    m = machine()
    doc = {"benchmark": "TRL GRPOTrainer vs rltpu train (1 sampler + 1 trainer chip; 2 colocated chips), equal work",
           "machine": m, "date": dt.date.today().isoformat(), **commit_info(),
           "command": " ".join([".venv/bin/python", "benchmarks/trl_grpo.py", *sys.argv[1:]]),
           "steps": args.steps, "env": env, "workloads": results, "table": table,
           "elapsed_s": round(time.perf_counter() - t_start, 1)}
    text = json.dumps(doc, indent=1)
    out = Path(args.out) if args.out else REPO / "benchmarks/results/single" / f"trl_grpo-{machine_slug(m)}-{doc['date']}.json"
    out.write_text(text + "\n")
    print(text)
    print("\n".join(table), file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
