"""Prompt files (JSONL / JSON / Parquet): chat rendering, extra columns to the reward, seeded
epoch shuffling, exact resume from the cursor, and one-line errors for bad files."""

import json
from collections import Counter

import numpy as np
import pytest

from rltpu.data.chat_example import make_tiny_tokenizer
from rltpu.config import ConfigError, build_config
from rltpu.data.synthetic import SyntheticPromptDataset
from rltpu.data.sources import DatasetError, PromptDataset, build_dataset, check_prompt_lengths, read_prompt_file
from rltpu.data.rewards import exact_answer, load_reward_fn, normalize_answer, word_credit
from rltpu.control.batch import score

pytest.importorskip("transformers")
from rltpu.data.hf_tokenizer import HFTokenizer  # noqa: E402


def make_rows(n=23):
    rows = []
    for i in range(n):
        row = {"id": f"q{i}", "answer": str(i * 7), "difficulty": i % 3}
        if i % 2:
            row["messages"] = [{"role": "user", "content": f"What is {i} times 7?"}]
        else:
            row["prompt"] = f"{i} * 7 ="
        rows.append(row)
    return rows


def write_jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    corpus = [f"What is {i} times 7? {i} * 7 = {i * 7}" for i in range(30)] + ["user assistant"]
    return HFTokenizer(make_tiny_tokenizer(tmp_path_factory.mktemp("tok"), corpus))


@pytest.fixture()
def jsonl(tmp_path):
    return write_jsonl(tmp_path / "train.jsonl", make_rows())


def ids(batch):
    return [e["id"] for e in batch]


def test_examples_carry_columns_and_rendered_prompt(jsonl, tok):
    ds = PromptDataset.from_file(jsonl, seed=0, shuffle=False, tokenizer=tok)
    text, chat = ds.next_batch(2)
    assert text == {"id": "q0", "answer": "0", "difficulty": 0, "prompt": "0 * 7 ="}
    assert chat["prompt"] == "<|im_start|>user\nWhat is 1 times 7?<|im_end|>\n<|im_start|>assistant\n"
    assert chat["messages"][0]["content"] == "What is 1 times 7?" and chat["answer"] == "7"
    # a rendered chat prompt is encoded as is; BOS goes only to text prompts (and this tokenizer has none)
    assert ds.encode(chat, tok) == tok.encode(chat["prompt"], add_bos=False)
    assert tok.decode(ds.encode(chat, tok), stop_at_eos=False) == chat["prompt"]


def test_jsonl_json_and_parquet_give_the_same_examples(tmp_path, jsonl, tok):
    pa = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq

    rows = make_rows()
    keys = list(dict.fromkeys(k for r in rows for k in r))  # from_pylist would take the first row's keys only
    pq.write_table(pa.table({k: [r.get(k) for r in rows] for k in keys}), tmp_path / "train.parquet")
    (tmp_path / "train.json").write_text(json.dumps(rows))

    def drop_nulls(e):  # Parquet has a value (null) in every column of every row
        return {k: v for k, v in e.items() if v is not None}

    streams = [PromptDataset.from_file(p, seed=5, tokenizer=tok).next_batch(30)
               for p in (jsonl, tmp_path / "train.json", tmp_path / "train.parquet")]
    assert streams[0] == streams[1] == [drop_nulls(e) for e in streams[2]]
    assert len({e["id"] for e in streams[0]}) == 23


def test_shuffle_is_seeded_epoch_wise_and_covers_every_row(jsonl, tok):
    def order(seed, n=46):
        return ids(PromptDataset.from_file(jsonl, seed=seed, tokenizer=tok).next_batch(n))

    a = order(1)
    assert a == order(1)  # deterministic by seed
    assert a != order(2)  # different across seeds
    epoch0, epoch1 = a[:23], a[23:]
    assert sorted(epoch0) == sorted(epoch1) == sorted(f"q{i}" for i in range(23))  # each epoch: every row once
    assert epoch0 != epoch1  # reshuffled per epoch
    assert order(1, 23) != [f"q{i}" for i in range(23)]
    unshuffled = PromptDataset.from_file(jsonl, seed=1, shuffle=False, tokenizer=tok).next_batch(23)
    assert ids(unshuffled) == [f"q{i}" for i in range(23)]


def test_resume_from_cursor_neither_skips_nor_replays(jsonl, tok):
    a = PromptDataset.from_file(jsonl, seed=3, tokenizer=tok)
    first = a.next_batch(17)
    state = json.loads(json.dumps(a.state_dict()))  # the checkpoint stores it as JSON
    rest = a.next_batch(20)  # crosses into epoch 1
    assert a.state_dict()["epoch"] == 1
    b = PromptDataset.from_file(jsonl, seed=3, tokenizer=tok)
    b.load_state_dict(state)
    resumed = b.next_batch(20)
    assert resumed == rest
    # two full epochs seen across the interruption: every row exactly twice more or less the tail
    seen = Counter(ids(first) + ids(resumed) + ids(b.next_batch(9)))
    assert set(seen.values()) == {2} and len(seen) == 23
    with pytest.raises(DatasetError, match="dataset of 99 rows but .* has 23"):
        b.load_state_dict({"epoch": 0, "position": 3, "rows": 99})


def test_probe_texts_leave_the_cursor_alone(jsonl, tok):
    ds = PromptDataset.from_file(jsonl, seed=0, tokenizer=tok)
    probe = ds.probe_texts(4)
    assert ds.state_dict()["position"] == 0
    assert probe[0] == ("0 * 7 =", True) and probe[1][0].startswith("<|im_start|>user") and probe[1][1] is False


def test_extra_columns_reach_the_reward_function(jsonl, tok):
    """The scoring path the controller uses hands each completion its own row's columns."""
    ds = PromptDataset.from_file(jsonl, seed=0, tokenizer=tok)
    examples = ds.next_batch(3)
    G = 2
    completions = [e["answer"] for e in examples for _ in range(G)]
    completions[1] = "wrong"
    rows = [tok.encode(c, add_bos=False) + [tok.eos_id] for c in completions]
    T = max(map(len, rows))
    gen = {"tokens": np.array([r + [tok.pad_id] * (T - len(r)) for r in rows]),
           "lengths": np.array([len(r) for r in rows])}
    seen = []

    def recording(completion, example):
        seen.append((completion, example["answer"], example["difficulty"]))
        return exact_answer(completion, example)

    rewards, texts = score(gen, examples, G, tok, recording)
    assert texts == completions
    assert rewards.tolist() == [1.0, 0.0, 1.0, 1.0, 1.0, 1.0]
    assert [s[1:] for s in seen] == [(e["answer"], e["difficulty"]) for e in examples for _ in range(G)]


def test_exact_answer_normalises_and_reads_a_configurable_column():
    assert normalize_answer("  The Answer:\tIS 42. ") == "the answer: is 42"
    assert exact_answer(" 42.", {"answer": "42"}) == 1.0
    assert exact_answer("43", {"answer": "42"}) == 0.0
    assert exact_answer("forty-two", {"answer": ["42", "Forty-Two"]}) == 1.0
    fn = load_reward_fn("rltpu.data.rewards:exact_answer", {"column": "reference"})
    assert fn("x", {"reference": "X"}) == 1.0
    with pytest.raises(ConfigError, match="no 'answer' column .*task.reward_kwargs.column"):
        exact_answer("42", {"prompt": "p"})
    with pytest.raises(ValueError, match="do not fit rltpu.data.rewards:exact_answer"):
        load_reward_fn("rltpu.data.rewards:exact_answer", {"colum": "reference"})


def test_word_credit_counts_words_in_place_over_the_longer():
    assert word_credit("7 6 4", {"answer": "7 6 4"}) == 1.0
    assert word_credit("7 1 4", {"answer": "7 6 4"}) == pytest.approx(2 / 3)
    assert word_credit("7 6 4 fox", {"answer": "7 6 4"}) == pytest.approx(3 / 4)  # a word too many costs
    assert word_credit("7", {"answer": "7 6 4"}) == pytest.approx(1 / 3)  # stopping early too
    assert word_credit("6 4", {"answer": "7 6 4"}) == 0.0  # in place, not anywhere
    assert word_credit("", {"answer": "7 6 4"}) == 0.0
    assert load_reward_fn("rltpu.data.rewards:word_credit", {"column": "ref"})("a b", {"ref": "a c"}) == 0.5
    with pytest.raises(ConfigError, match="word_credit: the example has no 'answer' column"):
        word_credit("1", {"prompt": "p"})


def test_word_level_tiny_tokenizer_keeps_every_word_as_one_id(tmp_path):
    """The hf_chat example's tokenizer (``kind="words"``), loaded through transformers as users' are:
    every word and digit of the chat-templated prompt is its own id (none dropped), a reply decodes to
    the words joined by spaces, and the vocabulary is the corpus's words plus the specials."""
    corpus = ["Reply with the digits only.", "Repeat: 3 1 4 1 5 9 2 6 8 7 0", "user assistant system"]
    d = make_tiny_tokenizer(tmp_path / "tok", corpus, kind="words")
    tok = HFTokenizer(d)
    assert tok.vocab_size == 3 + 1 + 21  # 3 specials, <unk>; 8 words and marks, 10 digits, 3 role names
    text = tok.apply_chat_template([{"role": "system", "content": "Reply with the digits only."},
                                    {"role": "user", "content": "Repeat: 3 1 4"}])
    ids = tok.encode(text, add_bos=False)
    assert len(ids) == 5 + 3 + 5 + 1 + 2 + 3  # 5 specials, 3 role names, 5 words, '.', 'Repeat' ':', 3 digits
    assert tok.decode(tok.encode("3 1 4", add_bos=False)) == "3 1 4"
    assert tok._tok.unk_token_id not in ids
    with pytest.raises(ValueError, match="bpe or words"):
        make_tiny_tokenizer(tmp_path / "bad", corpus, kind="chars")


def test_chat_example_digits_options(tmp_path):
    import subprocess
    import sys

    from rltpu.data.chat_example import write_chat_example

    made = write_chat_example(tmp_path / "a", num_rows=30, min_digits=3, max_digits=3)
    rows = [json.loads(line) for line in open(made["dataset"])]
    assert len(rows) == 30 and {len(r["answer"].split()) for r in rows} == {3}
    assert all(r["messages"][-1]["content"] == f"Repeat: {r['answer']}" for r in rows)
    res = subprocess.run([sys.executable, "-m", "rltpu.data.chat_example", str(tmp_path / "b"), "--min-digits", "4",
                          "--max-digits", "3"], capture_output=True, text=True, timeout=120)
    assert res.returncode == 2 and "need 1 <= --min-digits <= --max-digits" in res.stderr.strip().splitlines()[-1]


def test_build_dataset_picks_file_or_synthetic(jsonl, tok):
    synth = build_dataset(build_config({"seed": 4, "task": {"num_prompts": 50}}))
    assert isinstance(synth, SyntheticPromptDataset)
    assert synth.next_batch(5) == SyntheticPromptDataset("copy", 50, 4, 3, 5).next_batch(5)  # unchanged
    text_only = write_jsonl(jsonl.with_name("text.jsonl"), [r for r in make_rows() if "prompt" in r])
    cfg = build_config({"seed": 4, "task": {"dataset": str(text_only), "shuffle": False}})
    plain = build_dataset(cfg)  # text prompts work with the built-in char tokenizer
    assert isinstance(plain, PromptDataset) and plain.next_batch(1)[0]["prompt"] == "0 * 7 ="
    cfg = build_config({"seed": 4, "task": {"dataset": str(jsonl)}})
    with pytest.raises(DatasetError, match=r"train.jsonl:2: chat 'messages' need a tokenizer"):
        build_dataset(cfg)  # no task.tokenizer: the char tokenizer cannot render chat
    assert isinstance(build_dataset(cfg, tok), PromptDataset)


def test_too_long_prompt_is_the_bucket_error_unless_truncating(tok):
    cfg = build_config({"sampler": {"prompt_buckets": [8]}})
    examples = [{"id": "q1", "prompt": "x" * 30}]
    with pytest.raises(DatasetError, match=r"is 12 tokens but the largest sampler.prompt_buckets entry is 8; "
                                           r"add a bucket >= 12 or set sampler.truncate_prompts=true"):
        check_prompt_lengths([[1] * 12], examples, cfg.sampler)
    check_prompt_lengths([[1] * 8], examples, cfg.sampler)
    check_prompt_lengths([[1] * 12], examples, build_config({"sampler": {"prompt_buckets": [8],
                                                                         "truncate_prompts": True}}).sampler)


def one_line_error(path, tok=None, **kw):
    with pytest.raises(DatasetError) as err:
        read_prompt_file(path, **kw) if tok is None else PromptDataset.from_file(path, 0, tokenizer=tok)
    msg = str(err.value)
    assert "\n" not in msg and str(path) in msg
    return msg


def test_bad_files_are_one_line_errors_naming_file_line_and_fix(tmp_path, tok):
    msg = one_line_error(tmp_path / "missing.jsonl")
    assert "does not exist" in msg
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt": "a"}\n\n{"prompt": "b", "answer": 1,}\n')
    msg = one_line_error(bad)
    assert f"{bad}:3: malformed JSON at column 29" in msg and "one JSON object" in msg
    bad.write_text('{"prompt": "a"}\n{"question": "b"}\n')
    msg = one_line_error(bad)
    assert f"{bad}:2: row has neither 'prompt' nor 'messages' (keys: question)" in msg
    assert "task.prompt_key" in msg
    bad.write_text('{"question": "a"}\n{"question": "b"}\n')
    assert read_prompt_file(bad, prompt_key="question")[1] == [f"{bad}:1", f"{bad}:2"]  # the fix works
    bad.write_text('{"prompt": "a"}\n[1, 2]\n')
    assert "2: a line is a JSON list" in one_line_error(bad)
    bad.write_text('{"messages": [{"role": "user"}]}\n')
    assert "'messages' must be a non-empty list of" in one_line_error(bad)
    bad.write_text('{"prompt": 5}\n')
    assert "'prompt' must be a string, got int" in one_line_error(bad)
    bad.write_text("\n")
    assert "has no rows" in one_line_error(bad)
    arr = tmp_path / "bad.json"
    arr.write_text('{"prompt": "a"}')
    assert "is a list of objects" in one_line_error(arr)


def test_bad_parquet_files(tmp_path):
    pa = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq

    path = tmp_path / "q.parquet"
    pq.write_table(pa.table({"question": ["a"], "answer": ["b"]}), path)
    msg = one_line_error(path)
    assert "no 'prompt' or 'messages' column (columns: question, answer)" in msg
    assert read_prompt_file(path, prompt_key="question")[0] == [{"question": "a", "answer": "b"}]
    path.write_bytes(b"PAR1 not really")
    assert "not a readable Parquet file" in one_line_error(path)


def test_chat_template_failure_names_the_row(tmp_path):
    """A template that raises (here: it only allows user/assistant) fails at start, naming the line."""
    tmpl = ("{% for m in messages %}{% if m['role'] not in ['user', 'assistant'] %}"
            "{{ raise_exception('unsupported role ' + m['role']) }}{% endif %}{{ m['content'] }}{% endfor %}")
    strict = HFTokenizer(make_tiny_tokenizer(tmp_path / "tok", ["hello"], chat_template=tmpl))
    path = write_jsonl(tmp_path / "d.jsonl", [{"prompt": "x"}, {"messages": [{"role": "tool", "content": "hi"}]}])
    msg = one_line_error(path, tok=strict)
    assert f"{path}:2: the chat template failed on these messages (unsupported role tool)" in msg


def test_config_keys_validate_in_one_line(jsonl):
    cfg = build_config({"task": {"dataset": str(jsonl), "prompt_key": "q", "tokenizer": "/t", "shuffle": False,
                                 "reward_fn": "rltpu.data.rewards:exact_answer", "reward_kwargs": {"column": "ref"}}})
    assert cfg.task.prompt_key == "q" and cfg.task.reward_kwargs == {"column": "ref"}
    with pytest.raises(ConfigError, match=r"must be a .jsonl, .json, .parquet, .csv file, a glob of them, a directory "
                                          r"or a Hugging Face Hub dataset id") as err:
        build_config({"task": {"dataset": "data.txt"}})
    assert "\n" not in str(err.value)
    with pytest.raises(ConfigError, match="prompt_key and messages_key are both 'x'"):
        build_config({"task": {"prompt_key": "x", "messages_key": "x"}})


def test_check_lengths_reports_stats_and_names_the_first_long_row(tmp_path, tok):
    rows = [{"prompt": "1 * 7 ="}, {"prompt": "What is 12 times 7? " * 4}, {"prompt": "2"}]
    ds = PromptDataset.from_file(write_jsonl(tmp_path / "d.jsonl", rows), 0, tokenizer=tok)
    n = [len(tok.encode(r["prompt"])) for r in rows]
    fits = build_config({"sampler": {"prompt_buckets": [max(n)]}}).sampler
    assert ds.check_lengths(tok, fits) == {"rows": 3, "prompt_tokens_min": min(n), "prompt_tokens_mean": sum(n) / 3,
                                           "prompt_tokens_max": max(n), "truncated_rows": 0}
    small = build_config({"sampler": {"prompt_buckets": [sorted(n)[1]]}}).sampler
    with pytest.raises(DatasetError, match=rf"d.jsonl:2: prompt is {n[1]} tokens \(1 of 3 rows exceed"):
        ds.check_lengths(tok, small)
    truncating = small.model_copy(update={"truncate_prompts": True})
    assert ds.check_lengths(tok, truncating)["truncated_rows"] == 1


def test_cli_fails_in_one_line_before_starting_anything(tmp_path):
    """Bad data is exit code 2 and one stderr line from `rltpu train`, before Ray starts."""
    import subprocess
    import sys
    from pathlib import Path

    from rltpu.data.chat_example import write_chat_example

    root = Path(__file__).resolve().parents[1]
    made = write_chat_example(tmp_path, num_rows=8)

    def train(*overrides):
        cmd = [sys.executable, "-m", "rltpu.cli", "train", str(root / "configs" / "chat_jsonl.yaml"),
               f"run_dir={tmp_path / 'run'}", f"task.tokenizer={made['tokenizer']}", *overrides]
        return subprocess.run(cmd, cwd=root, capture_output=True, text=True, timeout=120)

    res = train(f"task.dataset={made['dataset']}", "sampler.prompt_buckets=[8]")
    assert res.returncode == 2 and res.stderr.count("\n") == 1, res.stderr
    assert res.stderr.startswith(f"rltpu: error: {made['dataset']}:1: prompt is ")
    assert "sampler.truncate_prompts=true" in res.stderr
    res = train(f"task.dataset={tmp_path / 'nope.jsonl'}")
    assert res.returncode == 2 and res.stderr.count("\n") == 1 and "does not exist" in res.stderr, res.stderr
    assert not (tmp_path / "run").exists()
