"""A Hugging Face checkpoint (``model.path``) loads into an FSDP x TP trainer (issue 16): on gloo ranks
as a 2 x 2 and a 1 x 2 ("dp", "tp") mesh, every rank's policy and PPO-critic parameters equal its
slice of the file's tensors (exact), each tensor is read once per model and only that slice's bytes,
and the sharded policy's logits equal transformers' on the same checkpoint.

The expected slices are worked out here from the plan's rule (``rltpu.models.tp_plan.split_dim``:
TP's ``1/tp`` of a colwise weight's rows or a rowwise weight's columns, then FSDP's ``torch.chunk``
piece of the rows), not from the DTensor layout the loader reads, so a loader that read the wrong
block fails.
"""

from __future__ import annotations

import os

os.environ.setdefault("TORCH_DEVICE_BACKEND_AUTOLOAD", "0")

import numpy as np  # noqa: E402
import pytest  # noqa: E402
import torch  # noqa: E402

transformers = pytest.importorskip("transformers")

from rltpu.config import ModelConfig  # noqa: E402
from rltpu.models.hf.tiny import write_tiny_checkpoint  # noqa: E402
from rltpu.models.hf.weights import CheckpointDir  # noqa: E402
from rltpu.models.tp_plan import split_dim  # noqa: E402
from procs import join_gloo, spawn_ranks  # noqa: E402

torch.set_float32_matmul_precision("highest")
TOL = 1e-4
L = 24
TIMEOUT_S = 300.0  # a hang guard: under a loaded 2-core machine the 2x2 load took 103 s (36 s quiet)


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    root = tmp_path_factory.mktemp("hf_tp")
    return {  # q/k/v biases split with their rows; several shards + index; Qwen3's whole q/k norms, tied head
        "qwen2": write_tiny_checkpoint(root / "qwen2", "qwen2", shard_bytes=40_000, with_tokenizer=False,
                                       vocab_size=96),
        "qwen3": write_tiny_checkpoint(root / "qwen3", "qwen3", tied=True, attention_bias=True, seed=1,
                                       with_tokenizer=False, vocab_size=97),  # odd vocab: uneven FSDP rows
    }


def _ids(vocab: int) -> np.ndarray:
    return np.random.default_rng(0).integers(0, vocab, (2, L))


def _load_worker(rank: int, world: int, port: int, tp: int, paths: dict, q) -> None:
    import torch.distributed as dist

    from learner.fsdp import trainer_mesh
    from learner.trainer import TrainerEngine
    from rltpu.chips.runtime import mesh_groups
    from rltpu.config import CriticConfig, TrainerConfig
    from rltpu.models.hf import weights

    reads = []
    orig = weights.SafetensorsFile.read

    def counted(self, name, rows=None, cols=None):  # every byte any model load takes from a file
        t = orig(self, name, rows, cols)
        reads.append((name, tuple(t.shape), t.numel() * t.element_size()))
        return t

    weights.SafetensorsFile.read = counted
    try:
        join_gloo(rank, world, port)
        mesh = trainer_mesh(dist.group.WORLD, "cpu", tp=tp, groups=mesh_groups(world, tp, rank))
        out = {}
        for arch, path in paths.items():
            reads.clear()
            cfg = ModelConfig(path=path)
            eng = TrainerEngine(cfg, TrainerConfig(), cfg.vocab_size, 0, mesh=mesh, critic_cfg=CriticConfig())
            # before the forward: FSDP2 leaves the root's parameters unsharded after it
            local = {f"policy/{k}": v.detach().to_local().numpy().copy() for k, v in eng.model.named_parameters()}
            local |= {f"critic/{k}": v.detach().to_local().numpy().copy() for k, v in eng.critic.named_parameters()}
            ids = torch.as_tensor(_ids(cfg.vocab_size))
            pos = torch.arange(L).expand(2, L)
            with torch.no_grad():
                logits = eng.model(ids, pos, torch.ones_like(ids)).numpy()
            out[arch] = {"local": local, "reads": list(reads), "logits": logits,
                         "heads": eng.model.model.layers[0].self_attn.n_heads}
        q.put((rank, out))
    except Exception as e:  # noqa: BLE001 - reported to the parent
        import traceback

        q.put((rank, {"error": f"{type(e).__name__}: {e}\n{traceback.format_exc()}"}))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def expected_block(name: str, shape: tuple, rank: int, dp: int, tp: int) -> tuple:
    """Rank (d, t)'s [lo, hi) per dim: a split tensor's TP piece t (rows or columns), then FSDP's
    ``torch.chunk`` piece d of the rows it has; a whole tensor only the latter."""
    d, t = divmod(rank, tp)
    box = [(0, n) for n in shape]
    dim = split_dim(name)
    if dim is not None:
        w = shape[dim] // tp
        box[dim] = (t * w, (t + 1) * w)
    lo, hi = box[0]
    c = -(-(hi - lo) // dp)
    box[0] = (min(lo + d * c, hi), min(lo + (d + 1) * c, hi))
    return tuple(box)


def check_ranks(out: dict, paths: dict, dp: int, tp: int) -> None:
    for rank, r in out.items():
        assert "error" not in r, f"rank {rank}: {r['error']}"
    for arch, path in paths.items():
        ckpt = CheckpointDir(path)
        cfg = ModelConfig(path=path)
        hf = transformers.AutoModelForCausalLM.from_pretrained(path).eval()
        with torch.no_grad():
            ref = hf(torch.as_tensor(_ids(cfg.vocab_size))).logits.numpy()
        assert np.abs(ref).max() > 1.0  # the tolerance means something
        split = 0
        for rank, r in out.items():
            got = r[arch]
            assert got["heads"] == cfg.num_attention_heads // tp, (rank, "the TP plan did not run")
            diff = float(np.abs(got["logits"] - ref).max())
            assert diff <= TOL, (arch, rank, diff)
            want_reads = []
            for key, local in got["local"].items():
                model, name = key.split("/", 1)
                if name == "score.weight":  # the critic's head starts at zero, not from the file
                    assert not local.any()
                    continue
                full = ckpt.read(name).numpy()
                box = expected_block(name, full.shape, rank, dp, tp)
                block = full[tuple(slice(lo, hi) for lo, hi in box)]
                np.testing.assert_array_equal(local, block, err_msg=f"{arch} rank {rank} {key}")
                split += split_dim(name) is not None and block.size < full.size
                if block.size:
                    want_reads.append((name, block.shape, block.nbytes))
            # each model reads each of its tensors once, exactly its block: never a whole split tensor
            assert sorted(got["reads"]) == sorted(want_reads), (arch, rank)
        assert split > 0


@pytest.mark.parametrize("dp,tp,archs", [(2, 2, ("qwen2", "qwen3")), (1, 2, ("qwen2",))])
def test_hf_checkpoint_loads_each_rank_its_fsdp_x_tp_block(ckpts, dp, tp, archs):
    paths = {k: str(ckpts[k]) for k in archs}
    out = spawn_ranks(_load_worker, dp * tp, (tp, paths), TIMEOUT_S, f"hf load {dp}x{tp}")
    check_ranks(out, paths, dp, tp)


def test_column_block_reads_only_its_bytes(ckpts, monkeypatch):
    """A rowwise (o_proj) block: one positioned read per row of exactly its columns."""
    ckpt = CheckpointDir(ckpts["qwen2"])
    name = "model.layers.1.self_attn.o_proj.weight"
    full = ckpt.read(name)
    calls = []
    orig = os.preadv
    monkeypatch.setattr(os, "preadv", lambda fd, bufs, at: calls.append(sum(len(b) for b in bufs)) or orig(fd, bufs, at))
    got = ckpt.read(name, (3, 9), (16, 40))
    assert torch.equal(got, full[3:9, 16:40])
    assert calls == [24 * full.element_size()] * 6
