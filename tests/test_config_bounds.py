"""Bounded config inputs (issue 34): every invalid value a user can write is refused by the config
loader in one line that names the key, before anything is built. The invalid configs are generated
from the schema itself (every leaf key: a wrong type, each side of its range, inf and NaN; every
section: an unknown key; the path-like keys: bad paths), so a key added later is covered too. All
in-process (the loader takes milliseconds); a few ``rltpu train`` runs check exit 2 and no traceback."""

from __future__ import annotations

import copy
import math
import subprocess
import sys
import time
import types
import typing
from pathlib import Path

import annotated_types
import pytest
import yaml
from pydantic import BaseModel

from rltpu.config import ConfigError, RunConfig, build_config, load_config

ROOT = Path(__file__).resolve().parents[1]
QUICKSTART = ROOT / "configs" / "quickstart.yaml"
BASE = yaml.safe_load(QUICKSTART.read_text())
# optional sections, each with the least that makes it valid (so a bad leaf is the only problem)
SECTION_BASE = {"critic": {}, "reward_model": {"path": "/tmp"}, "eval": {"dataset": "held.jsonl"},
                "env": {"path": "rltpu.data.envs.guess:GuessNumber"}, "trainer.lora": {},
                "model.rope_scaling": {"rope_type": "linear", "factor": 2.0}}


def _model_of(annotation):
    """The section model inside ``X | None``, else None."""
    for a in (annotation, *typing.get_args(annotation)):
        if isinstance(a, type) and issubclass(a, BaseModel):
            return a
    return None


def _leaves(model: type[BaseModel], prefix: str = ""):
    for name, info in model.model_fields.items():
        key = f"{prefix}{name}"
        sub = _model_of(info.annotation)
        if sub is not None:
            yield from _leaves(sub, key + ".")
        else:
            yield key, info


def _kinds(annotation) -> set[str]:
    """Which scalar kinds a field takes: int, float, bool, str, literal, seq, dict."""
    origin, args = typing.get_origin(annotation), typing.get_args(annotation)
    if origin in (typing.Union, types.UnionType):
        return set().union(*(_kinds(a) for a in args if a is not type(None)))
    if origin is typing.Annotated:
        return _kinds(args[0])
    if origin is typing.Literal:
        return {"literal"}
    if origin in (tuple, list):
        return {"seq"}
    if origin is dict:
        return {"dict"}
    return {{int: "int", float: "float", bool: "bool", str: "str"}.get(annotation, "other")}


def _of_strings(annotation) -> bool:
    """``tuple[str, ...]`` (or ``| None``): a sequence whose items are plain strings."""
    args = [a for a in typing.get_args(annotation) if a is not type(None)]
    if typing.get_origin(annotation) in (typing.Union, types.UnionType):
        return any(_of_strings(a) for a in args)
    return typing.get_origin(annotation) in (tuple, list) and bool(args) and args[0] is str


def _invalid(key: str, info) -> list[tuple[str, object]]:
    """(label, value) pairs the schema must refuse for ``key``."""
    kinds = _kinds(info.annotation)
    out: list[tuple[str, object]] = []
    if kinds & {"int", "float"}:
        out += [("type-str", "abc"), ("type-dict", {"a": 1}), ("type-list", [1, 2]), ("inf", math.inf),
                ("-inf", -math.inf), ("nan", math.nan)]
        if kinds == {"int"}:
            out.append(("type-fraction", 2.5))
        for m in info.metadata:
            if isinstance(m, annotated_types.Ge):
                out.append(("below-ge", m.ge - (1 if kinds == {"int"} else 1e-3)))
            elif isinstance(m, annotated_types.Gt):
                out.append(("at-gt", m.gt))
            elif isinstance(m, annotated_types.Le):
                out.append(("above-le", m.le + (1 if kinds == {"int"} else 1e-3)))
            elif isinstance(m, annotated_types.Lt):
                out.append(("at-lt", m.lt))
    elif kinds == {"bool"}:
        out += [("type-str", "maybe"), ("type-int", 7), ("type-list", [True])]
    elif kinds <= {"str"}:
        out += [("type-int", 5), ("type-list", ["a"]), ("type-dict", {"a": 1})]
    elif kinds <= {"literal"}:
        out += [("literal", "no-such-choice"), ("type-list", ["a"])]
    elif kinds <= {"seq"}:
        # a sequence of strings (loggers.wandb_tags) takes ["x"]: an int is what it must refuse
        wrong = ("type-int-in-seq", [5]) if _of_strings(info.annotation) else ("type-str-in-seq", ["x"])
        out += [wrong, ("type-dict", {"a": 1}), ("inf-in-seq", [math.inf]), ("nan-in-seq", [math.nan])]
    elif kinds <= {"dict"}:
        out += [("type-list", [1, 2]), ("type-str", "x"), ("nan-in-dict", {"a": math.nan}),
                ("inf-in-dict", {"a": {"b": [math.inf]}})]
    return out


def _set(data: dict, key: str, value) -> dict:
    data = copy.deepcopy(data)
    for section, extra in SECTION_BASE.items():  # the optional section the key lives in exists
        if key.startswith(section + "."):
            node = data
            for p in section.split(".")[:-1]:
                node = node.setdefault(p, {})
            node.setdefault(section.split(".")[-1], copy.deepcopy(extra))
            if section == "critic":
                data.setdefault("trainer", {})["algorithm"] = "ppo"
    node = data
    parts = key.split(".")
    for p in parts[:-1]:
        node = node.setdefault(p, {})
    node[parts[-1]] = value
    return data


def _cases() -> list[tuple[str, str, object]]:
    cases = [(key, label, value) for key, info in _leaves(RunConfig) for label, value in _invalid(key, info)]
    sections = {k.rsplit(".", 1)[0] for k, _ in _leaves(RunConfig) if "." in k}
    cases += [(f"{s}.no_such_key", "unknown", 1) for s in sorted(sections)] + [("no_such_section", "unknown", {})]
    cases += [("name", "path", v) for v in ("../x", "a/b", "..", "/abs", "a\\b", "")]
    cases += [("model.path", "path", "/nonexistent/model"), ("task.dataset", "path", "prompts.txt"),
              ("eval.dataset", "path", "held.txt"), ("task.reward_fn", "path", "no_colon"),
              ("task.reward_fn", "path", "../x:f"), ("env.path", "path", "a/b:C"),
              ("cluster.topology", "range", "1024x1024"), ("cluster.topology", "range", "4096x4096"),
              ("cluster.topology", "range", "0x2"), ("trainer.betas", "range", [2, 3]),
              ("trainer.betas", "range", [0.9, 1.0]), ("critic.betas", "range", [-0.1, 0.9]),
              ("model.max_position_embeddings", "range", 8), ("sampler.stop_token_ids", "range", [-1])]
    return cases


CASES = _cases()


def test_at_least_200_generated_invalid_configs_each_a_one_line_error_naming_the_key():
    assert len(CASES) >= 200, len(CASES)
    build_config(copy.deepcopy(BASE))  # the base is valid
    accepted, unnamed, multiline, crashed = [], [], [], []
    t0 = time.perf_counter()
    for key, label, value in CASES:
        try:
            build_config(_set(BASE, key, value))
        except ConfigError as err:
            msg = str(err)
            if "\n" in msg or not msg:
                multiline.append((key, label, msg))
            leaf = key.rsplit(".", 1)[-1]
            if leaf not in msg:
                unnamed.append((key, label, msg))
        except Exception as err:  # noqa: BLE001 - a crash instead of a one-line error
            crashed.append((key, label, f"{type(err).__name__}: {err}"[:200]))
        else:
            accepted.append((key, label, value))
    assert not crashed, f"{len(crashed)} invalid configs crashed the loader: {crashed[:20]}"
    assert not accepted, f"{len(accepted)} invalid configs accepted: {accepted[:20]}"
    assert not multiline, multiline[:10]
    assert not unnamed, f"errors not naming the key: {unnamed[:10]}"
    assert time.perf_counter() - t0 < 60  # in-process: milliseconds each, nothing built


def test_every_generated_config_through_rltpu_train_is_exit_2_one_line(tmp_path, capsys):
    """Every 4th case (> 200) as a YAML file through ``rltpu train``'s own code (``cli._train``,
    in-process: as subprocesses they would take many minutes of CI): exit code 2, one
    ``rltpu: error:`` line, nothing created, Ray never started."""
    import argparse

    import ray

    from rltpu import cli

    run_dir = tmp_path / "run"
    bad = []
    sample = CASES[::4]
    assert len(sample) >= 200
    for i, (key, label, value) in enumerate(sample):
        cfg = tmp_path / f"c{i}.yaml"
        cfg.write_text(yaml.safe_dump(_set(BASE, key, value)))
        args = argparse.Namespace(config=str(cfg), overrides=[], run_dir=str(run_dir), resume=False, new_run=False,
                                  address=None)
        code = cli._train(args, None)
        err = capsys.readouterr().err
        lines = [ln for ln in err.splitlines() if ln.strip()]
        if code != 2 or len(lines) != 1 or not lines[0].startswith("rltpu: error:") or "Traceback" in err:
            bad.append((key, label, code, err[-300:]))
    assert not bad, f"{len(bad)} not exit 2 + one line: {bad[:10]}"
    assert not run_dir.exists() and not ray.is_initialized()


def test_topology_beyond_the_largest_slice_is_refused_at_once():
    """Refused by arithmetic on the string: 4096x4096 took 323 s of chip-table building before."""
    t0 = time.perf_counter()
    for topo, gen in (("4096x4096", "v5e"), ("1024x1024", "v6e"), ("64x64x64", "v5p"), ("32x32x32", "v4")):
        with pytest.raises(ConfigError, match="largest"):
            load_config(QUICKSTART, [f"cluster.generation={gen}", f"cluster.topology={topo}"])
    assert time.perf_counter() - t0 < 2


def test_the_largest_slices_are_the_planners():
    from rltpu.config import GENERATIONS, MAX_SLICE_CHIPS
    from rltpu.plan.hardware import tpu

    assert {g: tpu(g).max_slice_chips for g in GENERATIONS} == MAX_SLICE_CHIPS


def test_overrides_of_inf_and_nan_are_refused_with_the_key():
    for override, key in (("trainer.lr=inf", "trainer.lr"), ("task.reward_default=nan", "task.reward_default"),
                          ("health.deadlines.training=.inf", "health.deadlines.training"),
                          ("sync.timeout_s=1e300", "sync.timeout_s"), ("checkpoint.keep_last=1e7", "checkpoint.keep_last"),
                          ("task.reward_kwargs={a: .nan}", "task.reward_kwargs.a"), ("seed=-5", "seed")):
        with pytest.raises(ConfigError) as err:
            load_config(QUICKSTART, [override])
        assert f"'{key}'" in str(err.value) and "\n" not in str(err.value)


def test_a_config_file_nested_deeply_or_not_utf8_is_one_line(tmp_path):
    deep = tmp_path / "deep.yaml"
    deep.write_text("a: " + "[" * 5000 + "]" * 5000 + "\n")
    bad = tmp_path / "bad.yaml"
    bad.write_bytes(b"name: \xff\xfe\n")
    for p in (deep, bad):
        with pytest.raises(ConfigError) as err:
            load_config(p)
        assert str(p) in str(err.value) and "\n" not in str(err.value)


@pytest.mark.parametrize("override, fragment", [
    ("trainer.lr=inf", "'trainer.lr' has bad value inf"),
    ("trainer.betas=[2,3]", "betas must each be in [0, 1)"),
    ("name=../../x", "'name' has bad value '../../x'"),
    ("cluster.topology=4096x4096", "largest v5e slice"),
    ("sampler.stop_token_ids=[999999]", "sampler.stop_token_ids has 999999"),  # past the vocabulary
])
def test_rltpu_train_exit_2_one_line_no_traceback(tmp_path, override, fragment):
    run_dir = tmp_path / "run"
    res = subprocess.run([sys.executable, "-m", "rltpu.cli", "train", str(QUICKSTART), override, f"run_dir={run_dir}"],
                         cwd=tmp_path, capture_output=True, text=True, timeout=120)
    lines = [ln for ln in res.stderr.splitlines() if ln.strip()]
    assert res.returncode == 2 and len(lines) == 1 and fragment in lines[0], res.stderr[-2000:]
    assert "Traceback" not in res.stderr and not run_dir.exists()


@pytest.mark.parametrize("content, fragment", [
    (b'{"prompt": "a"}\n{"prompt": "\xff\xfe"}\n', ":2: not UTF-8"),
    (b'{"prompt": "a"}\n{"prompt": ' + b"[" * 100_000 + b"]" * 100_000 + b"}\n", ":2: JSON nested too deeply"),
    (b'{"prompt": "a", "answer": NaN}\n', ":1: NaN is not a number JSON allows"),
    (b'{"prompt": "a"}\n\n{"prompt": "b", "w": 1e999}\n', ":3: 1e999 overflows"),
], ids=["utf8", "deep", "nan", "overflow"])
def test_jsonl_problems_name_the_file_and_line(tmp_path, content, fragment):
    from rltpu.data.sources import DatasetError, read_prompt_file

    f = tmp_path / "prompts.jsonl"
    f.write_bytes(content)
    with pytest.raises(DatasetError) as err:
        read_prompt_file(f)
    assert str(f) + fragment in str(err.value) and "\n" not in str(err.value)
    g = tmp_path / "prompts.json"  # the .json form of the same rows names the file too
    g.write_bytes(b"[" + b",".join(ln for ln in content.splitlines() if ln.strip()) + b"]")
    with pytest.raises(DatasetError) as err:
        read_prompt_file(g)
    assert str(g) in str(err.value) and "\n" not in str(err.value)


def test_nan_in_a_parquet_column_is_refused(tmp_path):
    pa = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq

    from rltpu.data.sources import DatasetError, read_prompt_file

    f = tmp_path / "prompts.parquet"
    pq.write_table(pa.table({"prompt": ["a", "b"], "weight": [1.0, float("nan")]}), f)
    with pytest.raises(DatasetError, match=r"row 1: column weight is NaN"):
        read_prompt_file(f)


@pytest.mark.parametrize("body, kind", [("raise RuntimeError('boom\\nsecond line')", "RuntimeError: boom"),
                                        ("def f(:\n    pass", "SyntaxError"),
                                        ("import sys\nsys.exit(3)", "SystemExit: 3")],
                         ids=["raises", "syntax", "exits"])
def test_reward_or_env_module_raising_at_import_is_one_line(tmp_path, monkeypatch, body, kind):
    from rltpu.data.envs.base import load_env_class
    from rltpu.data.rewards import load_reward_fn

    monkeypatch.syspath_prepend(str(tmp_path))
    for i, load in enumerate((lambda m: load_reward_fn(f"{m}:score"), lambda m: load_env_class(f"{m}:Env"))):
        mod = f"broken_at_import_{abs(hash(body))}_{i}"
        (tmp_path / f"{mod}.py").write_text(body + "\n")
        with pytest.raises(ValueError) as err:
            load(mod)
        msg = str(err.value)
        assert "\n" not in msg and mod in msg and kind in msg, msg
