"""Issue 16 acceptance 3: the quickstart on 4 emulated chips with a tensor-parallel sampler (one
process, a 2-device JAX mesh) learns, through the real CLI, with weights synced into the mesh.

A sampler process with k emulated chips gets k XLA host devices (``rltpu.chips.backend.apply``);
the engine splits weights and the KV cache over them (``rltpu.sampling.tp``) and weight sync puts
each received tensor straight into its sharding (``device_put_params``).
"""

import json

import pytest

from rltpu.config import load_config
from rltpu.data.sources import build_tokenizer, resolve_vocab
from rltpu.observe.metrics import read_metrics
from test_e2e import QUICKSTART, train

pytestmark = pytest.mark.slow


def test_quickstart_learns_with_a_tensor_parallel_sampler(tmp_path):
    run_dir = tmp_path / "run"
    # one sampler owns 2 chips and draws all 64 x 16 rows per step (one 1024-row bucket)
    res = train(run_dir, "placement.chips_per_sampler=2", "sampler.batch_buckets=[1024]", "sync.verify_every=5")
    assert res.returncode == 0, res.stderr[-3000:]
    m = read_metrics(run_dir / "metrics.jsonl")
    n = len(m)
    assert n == 100 or "trainer.target_reward=0.95 reached at step" in res.stderr, (n, res.stderr[-2000:])
    last5 = sum(r["reward_mean"] for r in m[-5:]) / 5
    assert last5 >= 0.8, last5
    assert all(r["compiles"] == 0 for r in m[1:])
    assert all(r["sampler_versions"] == [r["weight_version"] - 1] for r in m)
    # the sharded sampler's logits equal the trainer's after syncs into the mesh
    probes = [r["sync_probe_max_diff"] for r in m if r["sync_probe_max_diff"] is not None]
    assert probes and max(probes) <= 1e-4, probes

    placement = json.loads((run_dir / "placement.json").read_text())
    (sampler,) = [a for a in placement["actors"] if a["group"] == "sampler"]
    assert len(sampler["chips"]) == 2 and sampler["jax_devices"] == 2
    assert sampler["libtpu_env"]["TPU_VISIBLE_CHIPS"] == ",".join(map(str, sampler["chips"]))
    (layout,) = placement["sampler_layout"]
    assert layout["tp"] == 2 and layout["mesh"] == {"tp": 2, "tp_rep": 1}
    held = list(layout["device_weight_bytes"].values())
    total = layout["model_bytes"]
    # each device holds half the model plus what is replicated: the 5 RMSNorm vectors (2 layers x 2 +
    # the final one) and, as the 17-token vocabulary does not split in 2, both vocabulary tables
    cfg = load_config(QUICKSTART)
    vocab = resolve_vocab(cfg, build_tokenizer(cfg))
    assert vocab % 2 == 1
    replicated = (5 * 128 + 2 * vocab * 128) * 4
    assert len(held) == 2 and all(h == (total - replicated) // 2 + replicated for h in held), (held, total)
    # every device received only its slices: the bytes put equal what the devices hold
    assert all(r["sync_device_put_bytes"] == sum(held) for r in m), m[-1]["sync_device_put_bytes"]
