"""The controller's loop on in-process fakes (``tests/fakes.py``): no Ray, seconds per test.

Each mode's step, a sampler that dies or hangs mid-step, a trainer death rewound to the last
checkpoint, ``health.max_restarts`` and the async staleness bound. What only Ray shows (processes,
chips, the sync fabric) stays in the end-to-end tests (``test_e2e*.py``, ``test_fault_tolerance.py``).
"""

from __future__ import annotations

import json

import numpy as np
import pytest

from rltpu.config import build_config
from rltpu.control.controller import Controller
from rltpu.observe.health import HealthError
from tests.fakes import FakeActors, FakePlacement

FAST_HEALTH = {"heartbeat_s": 0.02, "heartbeat_timeout_s": 2.0, "poll_s": 0.02, "max_restarts": 2,
               "deadlines": {k: 2.0 for k in ("sampling", "training", "syncing", "checkpointing", "scoring",
                                              "loading", "compiling", "identity", "claim", "rendezvous",
                                              "join_sync", "probe")}}


def make_cfg(tmp_path, **over):
    data = {"name": "fakes", "seed": 0, "run_dir": str(tmp_path / "run"),
            "cluster": {"generation": "v5e", "topology": "2x2", "slices": 1},
            "placement": {"sampler_chips": 2, "trainer_chips": 2},
            "model": {"hidden_size": 16, "intermediate_size": 32, "num_hidden_layers": 1, "num_attention_heads": 2,
                      "num_key_value_heads": 1, "max_position_embeddings": 32},
            "task": {"name": "copy", "min_digits": 2, "max_digits": 2, "reward_fn": "rltpu.data.rewards:partial_credit"},
            "sampler": {"group_size": 4, "max_new_tokens": 4, "batch_buckets": [8], "prompt_buckets": [8],
                        "precompile": False, "compile_cache": False},
            "trainer": {"steps": 2, "prompts_per_step": 4, "target_reward": None},
            "sync": {"verify_every": 1}, "checkpoint": {"every_steps": 1, "every_minutes": 0},
            "health": FAST_HEALTH, "dashboard": {"enabled": False}}
    for key, value in over.items():
        section, _, field = key.partition("__")
        data.setdefault(section, {})
        if field:
            data[section][field] = value
        else:
            data[section] = value
    return build_config(data)


def run(cfg, arrange=None, mode=None):
    actors = FakeActors(cfg.sampler.max_new_tokens)
    ctl = Controller(cfg, placement=lambda c, m: FakePlacement(c, m, actors), mode=mode)
    try:
        ctl.start()
        if arrange:
            arrange(actors, ctl)
        records = ctl.run()
    finally:
        ctl.shutdown()
    return ctl, actors, records


def lines(ctl, name="metrics.jsonl"):
    return [json.loads(x) for x in (ctl.run_dir / name).read_text().splitlines()]


def grpo(rewards, G):
    g = rewards.reshape(-1, G)
    return ((g - g.mean(1, keepdims=True)) / (g.std(1, ddof=1, keepdims=True) + 1e-4)).reshape(-1)


def test_disaggregated_step_trains_the_scored_rows_and_syncs_every_sampler(tmp_path):
    ctl, actors, records = run(make_cfg(tmp_path))
    assert [r["step"] for r in records] == [1, 2] and ctl.version == 2
    assert records[-1]["sampler_weight_versions"] == [2, 2] and records[-1]["sync_probe_max_diff"] == 0.0
    # each step: 4 prompts x G=4 rows, split 8 + 8 over the two trainer ranks
    assert [(r, len(b["tokens"])) for r, b in actors.batches] == [(0, 8), (1, 8)] * 2
    rows = np.concatenate([b["advantages"] for _, b in actors.batches[:2]])
    mask = np.concatenate([b["loss_mask"] for _, b in actors.batches[:2]])
    assert (rows[mask == 0] == 0).all() and np.abs(rows).sum() > 0
    assert [ln["step"] for ln in lines(ctl)] == [1, 2]
    assert (ctl.run_dir / "checkpoint" / "trainer_state.json").exists()


def test_colocated_step_passes_weights_in_process(tmp_path):
    ctl, actors, records = run(make_cfg(tmp_path, placement__mode="colocated"))
    assert [r["step"] for r in records] == [1, 2] and records[-1]["sampler_weight_versions"] == [2, 2]
    assert not actors.fabric  # nothing crossed a sync fabric
    assert not [c for c in actors.calls if c[0] == "join_sync"]
    assert records[-1]["sync_probe_max_diff"] == 0.0 and records[-1]["mode"] == "colocated"
    assert [k for k in sorted(actors.handles) if not k.startswith("reward-worker")] == ["trainer-0", "trainer-1"]


def test_async_step_trains_rollouts_at_most_staleness_versions_old(tmp_path):
    ctl, actors, records = run(make_cfg(tmp_path, placement__staleness=1, trainer__steps=4))
    assert [r["step"] for r in records] == [1, 2, 3, 4]
    assert [r["staleness"] for r in records] == [0, 1, 1, 1]  # rollout k+1 is drawn while step k trains
    assert max(r["rollouts_in_flight"] for r in records) == 1


def test_async_staleness_bound_stops_a_rollout_older_than_allowed(tmp_path):
    def frozen(actors, ctl):  # sampler 0 keeps generating with version 0
        eng = actors.handles["sampler-0"]._obj.engine
        eng.set_params = lambda params, version: None

    with pytest.raises(RuntimeError, match=r"placement.staleness=1"):
        run(make_cfg(tmp_path, placement__staleness=1, trainer__steps=4), frozen)


def test_a_sampler_that_dies_mid_step_is_replaced_and_its_shard_redone(tmp_path):
    ctl, actors, records = run(make_cfg(tmp_path), lambda a, c: a.fail("sampler-1", "generate", after=1))
    assert [r["step"] for r in records] == [1, 2] and records[-1]["sampler_weight_versions"] == [2, 2]
    assert actors.spawned.count("sampler-1") == 2 and actors.spawned.count("trainer-0") == 1
    health = json.loads((ctl.run_dir / "health.json").read_text())
    assert health["restarts"] == {"sampler-1": 1}
    assert [e["what"] for e in health["events"] if e["actor"] == "sampler-1"] == ["fenced", "replaced"]
    # the replacement joined a new sync generation with everyone else
    assert ("join_sync", "sampler-1", 2) in actors.calls and ("join_sync", "trainer-0", 2) in actors.calls


def test_a_hung_sampler_is_fenced_by_the_watchdog_and_replaced(tmp_path):
    ctl, actors, records = run(make_cfg(tmp_path), lambda a, c: a.hang("sampler-0", "generate", after=1))
    assert [r["step"] for r in records] == [1, 2]
    health = json.loads((ctl.run_dir / "health.json").read_text())
    assert health["restarts"] == {"sampler-0": 1}
    fenced = [e for e in health["events"] if e["what"] == "fenced"]
    assert fenced and "hung in sampling" in fenced[0]["why"]


def test_a_trainer_death_restarts_the_group_from_the_last_checkpoint(tmp_path):
    ctl, actors, records = run(make_cfg(tmp_path, trainer__steps=3),
                               lambda a, c: a.fail("trainer-1", "train_step", after=2))
    assert [r["step"] for r in records] == [1, 2, 3] and ctl.version == 3
    assert actors.spawned.count("trainer-0") == actors.spawned.count("trainer-1") == 2
    health = json.loads((ctl.run_dir / "health.json").read_text())
    assert health["restarts"] == {"trainer-1": 1}
    restarted = [e for e in health["events"] if e["what"] == "restarted"]
    assert restarted and "from step 2" in restarted[0]["why"]  # checkpoint of step 2: step 3 is redone
    ledger = [json.loads(x) for x in (ctl.run_dir / "ledger.jsonl").read_text().splitlines()]
    assert [e["rollback_to"] for e in ledger if "rollback_to" in e] == [2]  # step 3's first try is voided
    # the new trainers hold what they trained after the rewind: 3 updates (2 restored + 1 redone)
    assert [t.step for _, t in actors.live_trainers()] == [3, 3]


def test_past_max_restarts_the_job_stops_with_a_health_error(tmp_path):
    with pytest.raises(HealthError, match=r"sampler-0 failed 3 times .*health.max_restarts=2"):
        run(make_cfg(tmp_path), lambda a, c: a.fail("sampler-0", "generate", always=True))


def test_a_new_placement_mode_is_one_class_here(tmp_path):
    """A toy mode, defined only in this test: disaggregated processes, but the samplers receive
    weights every other version (its own weight handoff, wrapping the fabric's)."""
    from rltpu.control.modes import PlacementMode

    class EveryOtherSync:
        def __init__(self, inner):
            self.inner = inner

        def __getattr__(self, name):
            return getattr(self.inner, name)

        def push(self, version: int) -> dict:
            if version % 2:
                return {k: 0 for k in ("seconds", "bytes", "host_bytes", "ici_bytes", "dcn_bytes", "zero_copy_frac")}
            return self.inner.push(version)

    class EveryOtherSyncMode(PlacementMode):
        name = "every-other-sync"

        def handoff(self, *args):
            return EveryOtherSync(super().handoff(*args))

    cfg = make_cfg(tmp_path, trainer__steps=3, sync__verify_every=0)
    ctl, actors, records = run(cfg, mode=EveryOtherSyncMode(cfg.placement))
    assert [r["step"] for r in records] == [1, 2, 3]
    assert [r["sampler_weight_versions"] for r in records] == [[0, 0], [2, 2], [2, 2]]
    assert [r["sampler_versions"] for r in records] == [[0], [0], [2]]  # the rows each step trained on
    assert sorted(actors.fabric) == [0, 2]


def test_a_registered_estimator_is_valid_config_and_gets_what_it_declares(tmp_path, monkeypatch):
    """An estimator registered here (advantage = its own row's reward minus the reference logprob
    sum, needing the reference and the trainer's own old logprobs) trains on the fakes."""
    import torch

    from learner.losses import ESTIMATORS, register_estimator
    from rltpu.config import ConfigError

    monkeypatch.setattr("learner.losses.ESTIMATORS", dict(ESTIMATORS))  # the registration ends with the test
    seen = []

    @register_estimator("reward-minus-ref", reference=True, old_logprobs=True)
    def _mine(x):
        seen.append(x)
        return (x.rewards[:, None] - x.reference_logprobs.sum(1, keepdim=True)) * x.mask.float()

    with pytest.raises(ConfigError, match="trainer.algorithm: unknown advantage estimator 'nope'.*reward-minus-ref"):
        Controller(make_cfg(tmp_path, trainer__algorithm="nope"))
    ctl, actors, records = run(make_cfg(tmp_path, trainer__steps=1, trainer__algorithm="reward-minus-ref"))
    assert [r["step"] for r in records] == [1] and len(seen) == 1
    batch = {k: np.concatenate([b[k] for _, b in actors.batches]) for k in ("advantages", "loss_mask", "old_logprobs")}
    m = batch["loss_mask"]
    x = seen[0]  # FakeTrainer.logprobs: -1 on every position of the (R, P+T) layout
    np.testing.assert_allclose(x.reference_logprobs.sum(1).numpy(), -np.full(len(m), m.shape[1]))
    np.testing.assert_allclose(batch["advantages"], (x.rewards.numpy() + m.shape[1])[:, None] * m)
    assert (batch["old_logprobs"] == -m).all()  # the trainer's own, not the sampler's (-log of the vocabulary)


def test_an_estimator_declaring_a_critic_takes_the_critic_section(tmp_path, monkeypatch):
    """The critic section follows the registry: a new estimator that declares ``critic`` is valid with
    it and gets the values; the built-in critic-free ones refuse it, naming the ones that use it."""
    import torch

    from learner.losses import ESTIMATORS, register_estimator
    from rltpu.config import ConfigError

    monkeypatch.setattr("learner.losses.ESTIMATORS", dict(ESTIMATORS))
    seen = []

    @register_estimator("reward-minus-value", critic=True)
    def _mine(x):
        seen.append(x)
        returns = x.rewards.float()[:, None] * x.mask.float()
        return returns - x.values * x.mask.float(), returns

    with pytest.raises(ConfigError, match=r"value model \(ppo, reward-minus-value\), not trainer.algorithm=grpo"):
        Controller(make_cfg(tmp_path, critic={"lr": 1e-3}))
    with pytest.raises(ConfigError, match="reward-minus-value needs a value model"):
        Controller(make_cfg(tmp_path, trainer__algorithm="reward-minus-value"))
    ctl, actors, records = run(make_cfg(tmp_path, trainer__steps=1, trainer__algorithm="reward-minus-value",
                                        critic={"lr": 1e-3}))
    assert [r["step"] for r in records] == [1] and len(seen) == 1 and seen[0].values is not None
    b = {k: np.concatenate([x[k] for _, x in actors.batches]) for k in ("advantages", "returns", "loss_mask")}
    m = b["loss_mask"]
    np.testing.assert_allclose(b["returns"] * m, (seen[0].rewards.numpy()[:, None] * m))
    np.testing.assert_allclose(b["advantages"], b["returns"] * m)  # FakeTrainer.values: 0 everywhere
    assert torch.equal(seen[0].values, torch.zeros_like(seen[0].values))


def test_ppo_asks_the_trainers_for_the_critics_values(tmp_path):
    """PPO declares ``critic``: the trainers' values come first and the batch carries the critic's targets."""
    from learner.losses import gae, outcome_token_rewards, whiten
    import torch

    ctl, actors, records = run(make_cfg(tmp_path, trainer__steps=1, trainer__algorithm="ppo", critic={"lr": 1e-3}))
    assert [r["step"] for r in records] == [1]
    b = {k: np.concatenate([x[k] for _, x in actors.batches]) for k in ("advantages", "returns", "old_values",
                                                                         "loss_mask")}
    assert (b["old_values"] == 0).all()  # FakeTrainer.values: 0 everywhere, masked
    m = torch.from_numpy(b["loss_mask"])
    # the returns of zero values are the outcome reward on every token (gamma 1): one value per row
    per_row = [set(np.round(r[mk > 0], 6)) for r, mk in zip(b["returns"], b["loss_mask"])]
    assert all(len(s) == 1 for s in per_row)
    rewards = torch.tensor([next(iter(s)) for s in per_row])
    adv, ret = gae(outcome_token_rewards(rewards, m), torch.zeros_like(m), m, 1.0, ctl.cfg.critic.gae_lambda)
    np.testing.assert_allclose(b["advantages"], whiten(adv, m).numpy(), atol=1e-5)


def test_a_reward_worker_that_dies_mid_step_is_replaced_by_its_pool(tmp_path):
    ctl, actors, records = run(make_cfg(tmp_path), lambda a, c: a.fail("reward-worker-0", "score", after=1))
    assert [r["step"] for r in records] == [1, 2]
    assert actors.spawned.count("reward-worker-0") == 2 and actors.spawned.count("reward-worker-1") == 1
    assert [r["reward_workers_replaced"] for r in records] == [1, 0]  # its 2nd chunk: step 1's 2nd shard
    assert records[-1]["reward_errors"] == 0  # the chunk went to the new worker, nothing was lost
