"""Each actor is sent only the config parts it declares (``SECTIONS``), as JSON data (no pickle on Ray's
wire), and reads no others.

A parameter is followed from YAML to where it acts by its path: the key, the actor's ``SECTIONS``
entry, the ``self.cfg.<path>`` read. The ast check below fails when an actor reads a part it does not
declare; the round trips check the parts arrive as their schema types.
"""

from __future__ import annotations

import ast
import inspect
import json

import pytest

from actors.colocated_actor import ColocatedActor
from actors.env_worker import EnvWorker
from actors.reward_model_actor import RewardModelActor
from actors.sampler_actor import SamplerActor
from actors.trainer_actor import TrainerActor
from rltpu.config import RunConfig, Sections, load_config, sections_of

ACTORS = [SamplerActor, TrainerActor, ColocatedActor, RewardModelActor, EnvWorker]


def _cfg_reads(source: str) -> set[str]:
    """Every whole ``self.cfg.a.b`` / ``cfg.a.b`` chain in ``source``, as ``"a.b"``."""
    nodes = [n for n in ast.walk(ast.parse(source)) if isinstance(n, ast.Attribute)]
    inner = {id(n.value) for n in nodes}
    found = set()
    for node in [n for n in nodes if id(n) not in inner]:
        chain, n = [], node
        while isinstance(n, ast.Attribute):
            chain.append(n.attr)
            n = n.value
        chain.reverse()
        if isinstance(n, ast.Name) and n.id == "self" and chain[:1] == ["cfg"]:
            chain = chain[1:]
        elif not (isinstance(n, ast.Name) and n.id == "cfg"):
            continue
        if chain:
            found.add(".".join(chain))
    return found


def _source(cls) -> str:
    """The class and its bases of ours (a subclass runs its base's reads too)."""
    return "\n".join(inspect.getsource(k) for k in cls.__mro__ if k.__module__.startswith("actors."))


def _covered(read: str, sections: tuple[str, ...]) -> bool:
    """Inside a sent part, or a step towards one (``health.deadlines`` on the way to ``.sampling``)."""
    return any(read == s or read.startswith(f"{s}.") or s.startswith(f"{read}.") for s in sections)


@pytest.mark.parametrize("cls", ACTORS, ids=lambda c: c.__name__)
def test_every_config_read_of_an_actor_is_in_its_sections(cls):
    reads = _cfg_reads(_source(cls))
    assert reads  # the walk found the reads
    assert [r for r in reads if not _covered(r, cls.SECTIONS)] == []


def test_the_check_catches_an_undeclared_read():
    src = "def lr(self):\n    return self.cfg.trainer.lr * self.cfg.task.reward_default + cfg.sync.bucket_mb\n"
    assert _cfg_reads(src) == {"trainer.lr", "task.reward_default", "sync.bucket_mb"}
    assert [r for r in sorted(_cfg_reads(src)) if not _covered(r, TrainerActor.SECTIONS)] == ["task.reward_default"]


def _cfg() -> RunConfig:
    return RunConfig.model_validate({
        "seed": 7, "model": {"hidden_size": 64, "num_attention_heads": 4},
        "sampler": {"temperature": 0.7, "prompt_buckets": [8, 32], "max_new_tokens": 8},
        "trainer": {"algorithm": "ppo", "lr": 1e-4}, "critic": {"lr": 5e-4},
        "sync": {"bucket_mb": 3.0}, "placement": {"chips_per_trainer": 1},
        "checkpoint": {"keep_last": 4}})


def test_sections_travel_as_json_and_come_back_as_their_types():
    cfg = _cfg()
    sent = sections_of(cfg, ColocatedActor.SECTIONS)
    assert json.loads(json.dumps(sent)) == sent  # plain data: Ray carries it as msgpack, no pickle
    assert "sampler.temperature" not in sent  # inside "sampler", sent once
    got = Sections.read(sent, "ColocatedActor.SECTIONS")
    assert got.model == cfg.model and got.trainer == cfg.trainer and got.critic == cfg.critic
    assert got.sampler == cfg.sampler and got.sampler.prompt_buckets == (8, 32)  # a tuple again
    assert (got.seed, got.checkpoint.keep_last, got.cluster.generation) == (7, 4, "v5e")
    with pytest.raises(AttributeError, match="config sync is not sent"):  # no sync fabric in this process
        got.sync
    assert Sections.read(sections_of(cfg, TrainerActor.SECTIONS), "TrainerActor.SECTIONS").sync.bucket_mb == 3.0


def test_ray_carries_the_sections_without_pickle():
    """Ray serializes actor arguments as msgpack and hands what msgpack cannot hold (a config model, a
    tuple) to pickle through a fallback; the sections of every actor reach none of it."""
    from ray._raylet import MessagePackSerializer  # what Ray's SerializationContext uses for arguments

    cfg = _cfg()
    pickled = []

    def fallback(obj):
        pickled.append(obj)
        return len(pickled) - 1

    for cls in ACTORS:
        MessagePackSerializer.dumps(sections_of(cfg, cls.SECTIONS), fallback)
    assert pickled == []
    MessagePackSerializer.dumps({"sampler": cfg.sampler, "buckets": cfg.sampler.prompt_buckets}, fallback)
    assert [type(o).__name__ for o in pickled] == ["SamplerConfig", "tuple"]  # the check can see pickle


def test_a_part_not_sent_is_an_error_naming_the_list():
    got = Sections.read(sections_of(_cfg(), SamplerActor.SECTIONS), "SamplerActor.SECTIONS")
    assert got.trainer.lora is None and got.placement.chips_per_trainer == 1
    with pytest.raises(AttributeError, match=r"config trainer\.lr is not sent .*SamplerActor\.SECTIONS"):
        got.trainer.lr
    with pytest.raises(AttributeError, match="config critic is not sent"):
        got.critic
    assert "seed" not in sections_of(_cfg(), SamplerActor.SECTIONS)


def test_actors_build_from_their_sections_alone():
    cfg = _cfg()
    sampler = SamplerActor(0, sections_of(cfg, SamplerActor.SECTIONS))
    assert sampler.cfg.sampler == cfg.sampler and sampler.rt.generation == "v5e"
    trainer = TrainerActor(1, sections_of(cfg, TrainerActor.SECTIONS))
    assert trainer.cfg.sampler.temperature == 0.7 and trainer.cfg.critic.lr == 5e-4
    env_cfg = load_config("configs/env_calculator.yaml")
    worker = EnvWorker(0, sections_of(env_cfg, EnvWorker.SECTIONS))
    assert worker.cfg.env == env_cfg.env
    assert worker.sample_timeout_s == env_cfg.health.deadlines.sampling + env_cfg.health.heartbeat_timeout_s
