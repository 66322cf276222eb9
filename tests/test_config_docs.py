"""docs/config.md is the schema's own reference (kept current here), and a wrong key gets a suggestion."""

from pathlib import Path

import pytest
from pydantic import Field

from rltpu.config import (FOREIGN_NAMES, ConfigError, RunConfig, _Section, key_meaning, load_config, markdown,
                          source_comments, walk_fields)

ROOT = Path(__file__).resolve().parents[1]
QUICKSTART = ROOT / "configs" / "quickstart.yaml"


def test_docs_config_md_is_current():
    assert (ROOT / "docs" / "config.md").read_text() == markdown(), (
        "docs/config.md is stale: regenerate it with `python -m rltpu.config --markdown > docs/config.md` "
        "(a new key's meaning is the comment beside it in rltpu/config.py, or Field(description=...))")


def test_every_key_is_documented_with_a_meaning():
    keys = list(walk_fields(RunConfig))
    assert len(keys) > 190  # the walk reached the nested sections (trainer.lora, health.deadlines, ...)
    page = markdown()
    missing = [k for k, _f, owner in keys if not key_meaning(k, owner, k.rpartition(".")[2])]
    assert missing == [], f"keys without a meaning: {missing}; add a comment beside each in rltpu/config.py"
    for k, _f, _owner in keys:
        assert f"| `{k}` |" in page, k
    assert "| `trainer.lora.rank` | int | `8` |" in page and "| `checkpoint.every_steps` | int (>= 0) | `10` |" in page
    assert '| `sampler.engine` | "continuous" \\| "static" | `"continuous"` |' in page


def test_foreign_names_point_at_real_keys():
    keys = {k for k, _f, _m in walk_fields(RunConfig)}
    for lib, theirs, ours, _note in FOREIGN_NAMES:
        assert ours in keys or ours.startswith("--resume"), (lib, theirs, ours)
    assert ("TRL", "num_generations", "sampler.group_size", "completions per prompt") in FOREIGN_NAMES


class _Example(_Section):
    # first line of a block comment
    # second line
    a: int = 1  # trailing
    b: str = Field("x", description="from the description")
    c: float = 2.0


def test_source_comments_reads_block_and_trailing_comments():
    got = source_comments(_Example)
    assert got == {"a": "first line of a block comment second line trailing", "b": "", "c": ""}
    assert key_meaning("b", _Example, "b") == "from the description"


@pytest.mark.parametrize("override, suggestion", [
    ("trainer.lrr=1e-3", "did you mean 'trainer.lr'?"),
    ("sampler.groupsize=4", "did you mean 'sampler.group_size'?"),
    ("chekpoint.every_steps=5", "did you mean 'checkpoint'?"),
    ("trainer.lora.rnak=4", "did you mean 'trainer.lora.rank'?"),
    ("trainer.num_generations=4", "did you mean 'sampler.group_size'? (TRL's num_generations;"),
    ("trainer.beta=0.04", "did you mean 'trainer.kl_coef'? (TRL's beta;"),
    ("actor_rollout_ref.rollout.n=4", "did you mean 'sampler.group_size'? (verl's actor_rollout_ref.rollout.n;"),
    ("trainer.save_freq=20", "did you mean 'checkpoint.every_steps'? (verl's trainer.save_freq;"),
])
def test_unknown_keys_get_a_suggestion(override, suggestion):
    with pytest.raises(ConfigError) as err:
        load_config(QUICKSTART, [override])
    msg = str(err.value)
    assert msg.startswith(f"unknown config key '{override.split('=')[0].split('.')[0]}") and suggestion in msg, msg
    assert "\n" not in msg and "docs/config.md" in msg


def test_nothing_close_gets_no_suggestion():
    with pytest.raises(ConfigError) as err:
        load_config(QUICKSTART, ["zzzz=1"])
    assert str(err.value) == "unknown config key 'zzzz' (docs/config.md lists every key)"
