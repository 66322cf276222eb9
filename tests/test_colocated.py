"""Colocated mode (no Ray): one process holds the trainer and the sampler; weights pass in-process.

One tiny model. The single-process scenario (build both engines, publish v0, sample, train, publish
v1) runs once per module; the 2-rank case spawns two gloo ranks (and one) that each run the
real ``ColocatedActor`` (without Ray) and checks the all-gathered weights against the single process.
"""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch
from procs import spawn_ranks

from learner.trainer import TrainerEngine
from rltpu.sync.colocated import full_params_for_sampler, process_memory, publish_local
from rltpu.config import ModelConfig, RunConfig, SamplerConfig, TrainerConfig, sections_of
from rltpu.control.batch import build_train_batch, split_by_rank
from rltpu.sampling.engine import SamplerEngine
from rltpu.sync.collective import param_spec, shard_rows

torch.set_num_threads(1)
torch.set_float32_matmul_precision("highest")

V, PAD, EOS = 17, 0, 1
G, T = 2, 6
SEED, TEMPERATURE = 0, 1.0
MCFG = ModelConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                   num_key_value_heads=2, max_position_embeddings=64, init_std=0.2)
SCFG = SamplerConfig(engine="static", group_size=G, max_new_tokens=T, batch_buckets=(4,), prompt_buckets=(8,),
                     precompile=False)
TCFG = TrainerConfig(lr=1e-2, prompts_per_step=2, grad_clip=1.0)
PROMPTS = [[2, 3, 4, 5], [6, 7, 8]]
SPEC = param_spec(MCFG, V)
TOL = 1e-4


def _hand_n_params(c: ModelConfig, vocab: int) -> int:
    """Parameters of the Llama-style policy from its sizes: embeddings, per layer (2 RMSNorms,
    q/k/v/o without bias, gate/up/down), final norm, untied lm_head."""
    H, I, hd = c.hidden_size, c.intermediate_size, c.head_dim
    attn = H * c.num_attention_heads * hd + 2 * H * c.num_key_value_heads * hd + c.num_attention_heads * hd * H
    layer = 2 * H + attn + 3 * H * I
    return vocab * H + c.num_hidden_layers * layer + H + (0 if c.tie_word_embeddings else vocab * H)


def _probe():
    tokens = np.array([[2, 3, 4, 5, 6, 7], [8, 9, 10, 0, 0, 0]], np.int64)
    mask = (tokens != 0).astype(np.int64)
    return tokens, np.maximum(np.cumsum(mask, 1) - 1, 0), mask


def _batch(gen: dict) -> dict:
    """A real rollout of this sampler scored by a fixed rule (reward = share of even tokens)."""
    R = len(gen["lengths"])
    rewards = np.array([np.mean(gen["tokens"][r, : gen["lengths"][r]] % 2 == 0) for r in range(R)], np.float32)
    rewards[0] += 0.5  # never all equal: non-zero advantages
    return build_train_batch(gen, rewards, G, scale_rewards=True)


def _gap(a, b) -> float:
    return float(np.abs(np.asarray(a) - np.asarray(b)).max())


def _engines():
    trainer = TrainerEngine(MCFG, TCFG, V, SEED, TEMPERATURE)
    sampler = SamplerEngine(MCFG, SCFG, V, PAD, EOS, {n: (s, d) for n, s, d in SPEC}, pack=False)  # as ColocatedActor
    return trainer, sampler


@pytest.fixture(scope="module")
def single():
    """Build both engines in this process, publish v0, sample, train one step, publish v1."""
    trainer, sampler = _engines()
    probe = _probe()
    r = {"version_before": sampler.version, "params_before": sampler.params,
         "mem_built": process_memory(trainer, sampler)}
    with pytest.raises(RuntimeError, match="no weights"):
        sampler.generate(PROMPTS, G, SEED)
    r["stats0"] = publish_local(trainer.model, sampler, SPEC, 0)
    r["version0"] = sampler.version
    r["trainer0"] = trainer.probe_logits(*probe)
    r["sampler0"] = sampler.probe_logits(*probe)
    gen = sampler.generate(PROMPTS, G, SEED)
    r["batch"] = _batch(gen)
    r["train"] = trainer.train_step(split_by_rank(r["batch"], 1)[0])
    r["sampler_after_train"] = sampler.probe_logits(*probe)  # not yet published
    r["stats1"] = publish_local(trainer.model, sampler, SPEC, 1)
    r["version1"] = sampler.version
    r["trainer1"] = trainer.probe_logits(*probe)
    r["sampler1"] = sampler.probe_logits(*probe)
    r["mem"] = process_memory(trainer, sampler)
    r["full"] = {k: v.detach().clone().numpy() for k, v in trainer.full_state_dict().items()}
    r["trainer"], r["sampler"] = trainer, sampler
    return r


# ---------------------------------------------------------------------------------------------
# one process: the weight handoff


def test_sampler_has_no_weights_until_publish(single):
    assert single["version_before"] == -1 and single["params_before"] is None
    assert single["version0"] == 0 and single["version1"] == 1


def test_publish_gives_the_trainer_logits_before_and_after_a_train_step(single):
    assert _gap(single["sampler0"], single["trainer0"]) < TOL
    assert _gap(single["sampler1"], single["trainer1"]) < TOL
    assert _gap(single["trainer1"], single["trainer0"]) > 1e-2  # the step moved the weights
    assert single["train"]["grad_norm"] > 0
    # snapshot: the optimizer's in-place update did not reach the sampler before the publish
    assert _gap(single["sampler_after_train"], single["sampler0"]) == 0.0


def test_publish_stats_single_rank_snapshot(single):
    n_bytes = _hand_n_params(MCFG, V) * 4
    for st, v in ((single["stats0"], 0), (single["stats1"], 1)):
        assert st["version"] == v and st["mode"] == "snapshot" and st["ranks"] == 1
        assert st["tensors"] == len(SPEC) and st["zero_copy"] == len(SPEC)  # JAX adopts the snapshot as is
        assert st["bytes"] == st["copied_bytes"] == n_bytes  # one memcpy of the parameters, no more
        assert st["gathered_bytes"] == 0 and st["aliased_bytes"] == 0 and st["converted"] == 0
        assert st["buckets"] == 0 and st["link_bytes"] == {"host": 0, "dcn": 0, "ici": 0}
        assert st["seconds"] > 0


def test_memory_figures_match_a_hand_computation(single):
    n = _hand_n_params(MCFG, V)
    n_tensors = len(SPEC)
    built, mem = single["mem_built"], single["mem"]
    assert built["trainer"]["param_bytes"] == n * 4
    assert built["trainer"]["grad_bytes"] == 0 and built["trainer"]["optimizer_bytes"] == 0  # lazy
    assert built["sampler"]["param_bytes"] == 0
    tr, sm = mem["trainer"], mem["sampler"]
    assert tr["param_bytes"] == n * 4 and tr["grad_bytes"] == n * 4
    # AdamW: exp_avg + exp_avg_sq (fp32, like the parameters) + one fp32 scalar step per tensor
    assert tr["optimizer_bytes"] == 2 * n * 4 + 4 * n_tensors
    assert tr["reference_bytes"] == 0 and tr["critic_bytes"] == 0
    assert tr["total_bytes"] == 4 * n * 4 + 4 * n_tensors
    assert sm["param_bytes"] == n * 4 and sm["shared_with_trainer_bytes"] == 0
    rows, plen, new = 4, 8, T
    assert sm["largest_cell"] == [rows, plen, new]
    assert sm["kv_cache_bytes"] == 2 * MCFG.num_hidden_layers * rows * MCFG.num_key_value_heads * (plen + new) \
        * MCFG.head_dim * 4
    assert sm["programs"] == 1
    assert mem["rss_bytes"] > 0 and mem["peak_rss_bytes"] >= mem["rss_bytes"]
    assert mem["device_memory"] is None and "CPU" in mem["device_memory_note"]
    gen = sm["program_temp_bytes"] or sm["kv_cache_bytes"]  # XLA:CPU reports temp bytes; they hold the cache
    assert sm["program_temp_bytes"] is None or sm["program_temp_bytes"] >= sm["kv_cache_bytes"]
    assert mem["resident_estimate_bytes"] == tr["total_bytes"] + sm["param_bytes"] + gen


# ---------------------------------------------------------------------------------------------
# the other cases of full_params_for_sampler


def test_alias_mode_shares_trainer_memory_and_sees_in_place_updates(single):
    """Why aliasing is not the default: the optimizer moves the sampler's weights under it."""
    trainer, sampler = _engines()
    probe = _probe()
    st = publish_local(trainer.model, sampler, SPEC, 0, alias=True)
    n_bytes = _hand_n_params(MCFG, V) * 4
    assert st["mode"] == "alias" and st["copied_bytes"] == 0 and st["aliased_bytes"] == n_bytes
    assert st["zero_copy"] == len(SPEC)
    assert process_memory(trainer, sampler)["sampler"]["shared_with_trainer_bytes"] == n_bytes
    before = sampler.probe_logits(*probe)
    trainer.train_step(split_by_rank(single["batch"], 1)[0])
    after = sampler.probe_logits(*probe)
    assert sampler.version == 0 and _gap(after, before) > 1e-2  # new weights, old version label
    assert _gap(after, trainer.probe_logits(*probe)) < TOL


def test_dtype_mismatch_converts_once(single):
    spec16 = [(n, s, "bfloat16") for n, s, _ in SPEC]
    tensors, st = full_params_for_sampler(single["trainer"].model, spec16)
    assert st["converted"] == len(SPEC) and st["copied_bytes"] == _hand_n_params(MCFG, V) * 2
    for name, t in tensors.items():
        assert t.dtype == torch.bfloat16
        want = torch.from_numpy(single["full"][name]).to(torch.bfloat16)
        assert torch.equal(t, want), name


def test_failed_publish_drops_or_keeps_the_live_version(single):
    """Default: the live weights are released before the new ones are built (lower peak), so a
    failed publish leaves no weights (version -1), never stale ones; ``keep_live`` keeps them."""
    trainer, sampler = single["trainer"], single["sampler"]
    bad = [(n, (s[0] + 1, *s[1:]) if i == 0 else s, d) for i, (n, s, d) in enumerate(SPEC)]
    with pytest.raises(ValueError, match="model configs disagree"):
        publish_local(trainer.model, sampler, bad, 2, keep_live=True)
    assert sampler.version == 1 and sampler.params is not None
    with pytest.raises(ValueError, match="model configs disagree"):
        publish_local(trainer.model, sampler, bad, 2)
    assert sampler.version == -1 and sampler.params is None
    with pytest.raises(RuntimeError, match="no weights"):
        sampler.generate(PROMPTS, G, SEED)
    publish_local(trainer.model, sampler, SPEC, 1)  # restore (the module's engines are shared)
    assert _gap(sampler.probe_logits(*_probe()), single["sampler1"]) == 0.0


# ---------------------------------------------------------------------------------------------
# two FSDP2 ranks, each a real ColocatedActor (no Ray): the all-gather path


@pytest.fixture(scope="module")
def jax_cache(tmp_path_factory) -> str:
    """A persistent compile cache shared by the spawned ranks (compiling generate is most of their time)."""
    return str(tmp_path_factory.mktemp("jax_cache"))


def _cfg_dict(world: int) -> dict:
    """What the placement sends a ColocatedActor: its config sections, as JSON data."""
    from actors.colocated_actor import ColocatedActor

    cfg = RunConfig(model=MCFG, sampler=SCFG, trainer=TCFG, seed=SEED,
                    placement={"mode": "colocated", "sampler_chips": world, "trainer_chips": world})
    return sections_of(cfg, ColocatedActor.SECTIONS)


def _actor_worker(rank: int, world: int, port: int, cfg_dict: dict, batch: dict, cache_dir: str, q) -> None:
    os.environ["GLOO_SOCKET_IFNAME"] = "lo"
    torch.set_num_threads(1)
    torch.set_float32_matmul_precision("highest")
    from actors.colocated_actor import ColocatedActor

    actor = None
    try:
        actor = ColocatedActor(rank, cfg_dict)
        actor.rt.backend_info = {"device": "cpu"}  # what claim() resolves on this machine
        actor.rt.init_process_groups("127.0.0.1", port, world, rank, world, 60.0)
        log = actor.build(V, PAD, EOS, SPEC, cache_dir)  # world 2 loads world 1's programs from disk
        out = {"log": log, "v_before": actor.weight_version()}
        probe = _probe()
        out["stats0"] = actor.publish_local(0)
        out["gap0"] = _gap(actor.sampler_probe_logits(*probe), actor.probe_logits(*probe))
        gen = actor.generate(PROMPTS[rank:rank + 1], G, SEED)  # each rank samples its prompt
        out["gen_rows"] = len(gen["lengths"])
        actor.train_step(split_by_rank(batch, world)[rank])
        out["stats1"] = actor.publish_local(1)
        out["gap1"] = _gap(actor.sampler_probe_logits(*probe), actor.probe_logits(*probe))
        out["v_after"] = actor.weight_version()
        out["sampler_params"] = {k: np.asarray(v) for k, v in actor.sampler.params.items()}
        full = actor.engine.full_state_dict()  # FSDP's own gather, for comparison (collective)
        out["equal_to_own_gather"] = all(np.array_equal(out["sampler_params"][k], full[k].numpy())
                                         for k in out["sampler_params"])
        out["report"] = actor.report()
        out["beat"] = actor.hb.report()
        q.put((rank, out))
    except Exception as e:  # noqa: BLE001 - reported to the parent
        import traceback

        q.put((rank, {"error": f"{type(e).__name__}: {e}\n{traceback.format_exc()}"}))
    finally:
        if actor is not None:
            actor.shutdown()


@pytest.mark.parametrize("world", [1, 2])
def test_fsdp_ranks_publish_full_tensors_equal_to_one_process(single, world, jax_cache):
    """world 1: an FSDP2 mesh of one rank (DTensor local shard = the full tensor, snapshot copy);
    world 2: FSDP's all-gather over the trainer group."""
    res = spawn_ranks(_actor_worker, world, (_cfg_dict(world), single["batch"], jax_cache), 120.0, "colocated")
    for rank in range(world):
        r = res[rank]
        assert "error" not in r, f"rank {rank}: {r['error']}"
        assert r["log"] == [] and r["v_before"] == -1 and r["v_after"] == 1
        assert r["gap0"] < TOL and r["gap1"] < TOL
        assert r["gen_rows"] == G
        # the sampler holds exactly the full tensors FSDP gathers; they equal the single process's
        # after the same step up to the sharded reduction's rounding (Adam at lr 1e-2 can turn a
        # 1e-8 gradient difference into ~5e-6; the step itself moves weights by ~1e-2)
        assert r["equal_to_own_gather"]
        assert sorted(r["sampler_params"]) == sorted(single["full"])
        for name, want in single["full"].items():
            np.testing.assert_allclose(r["sampler_params"][name], want, rtol=1e-5, atol=2e-5, err_msg=name)
        # gathered = everything but this rank's own dim-0 rows
        own = sum(4 * (shard_rows(s[0], world, rank)[1] - shard_rows(s[0], world, rank)[0]) * int(np.prod(s[1:]))
                  for _, s, _ in SPEC)
        total = _hand_n_params(MCFG, V) * 4
        for st in (r["stats0"], r["stats1"]):
            assert st["ranks"] == world and st["bytes"] == total and st["gathered_bytes"] == total - own
            # one rank: a snapshot of the local shard; two: the gathered tensors are adopted as they are
            assert st["copied_bytes"] == (total if world == 1 else 0) and st["aliased_bytes"] == 0
            assert st["tensors"] == st["zero_copy"] == len(SPEC)
        rep = r["report"]
        assert rep["group"] == "trainer" and rep["rank"] == rank and rep["colocated"] is True
        assert rep["engines"] == ["trainer", "sampler"] and rep["weight_version"] == 1
        mem = rep["memory"]
        if world == 1:
            assert mem["trainer"]["param_bytes"] == total
        else:
            assert 0 < mem["trainer"]["param_bytes"] < total  # a shard (FSDP pads it to equal rows)
        assert mem["sampler"]["param_bytes"] == total and mem["rss_bytes"] > 0
        assert r["beat"]["group"] == "trainer" and r["beat"]["step"] == 1 and r["beat"]["sampler_version"] == 1
