"""Tasks, rewards, tokenizer and the resumable data cursor."""

import pytest

from rltpu.data.synthetic import SyntheticPromptDataset, make_example
from rltpu.data.rewards import exact_match, load_reward_fn, partial_credit
from rltpu.data.char_tokenizer import CharTokenizer


def test_tasks_depend_on_the_whole_prompt():
    ex = [make_example(t, 7, seed=0, min_digits=5, max_digits=5) for t in ("copy", "reverse", "sort")]
    digits = ex[0]["prompt"][1:-1]
    assert ex[0]["prompt"] == f"c{digits}=" and ex[0]["answer"] == digits
    assert ex[1]["answer"] == digits[::-1] and ex[2]["answer"] == "".join(sorted(digits))
    answers = {make_example("copy", i, 0, 4, 4)["answer"] for i in range(200)}
    assert len(answers) > 190  # not a constant pattern


def test_partial_credit_by_hand():
    ex = {"answer": "1234"}
    assert partial_credit("1234", ex) == 1.0
    assert partial_credit("1299", ex) == 0.5
    assert partial_credit("12", ex) == 0.5  # too short: 2 hits / 4
    assert partial_credit("123456", ex) == pytest.approx(4 / 6)  # too long costs credit
    assert partial_credit("", ex) == 0.0
    assert exact_match("1234", ex) == 1.0 and exact_match("12345", ex) == 0.0


def test_reward_fn_import_errors_name_the_problem():
    assert load_reward_fn("rltpu.data.rewards:exact_match") is exact_match
    with pytest.raises(ValueError, match="no function 'nope'"):
        load_reward_fn("rltpu.data.rewards:nope")


def test_tokenizer_round_trip_and_visible_specials():
    tok = CharTokenizer()
    ids = tok.encode("c123=")
    assert ids[0] == tok.bos_id and tok.decode(ids) == "^c123="
    assert tok.decode([*tok.encode("12", add_bos=False), tok.eos_id, 5]) == "12"
    # pad inside a completion is visible to the reward, so it cannot shorten an answer for free
    assert tok.decode([4, tok.pad_id, 5]) == "1_2"
    with pytest.raises(ValueError, match="not in the tokenizer alphabet"):
        tok.encode("x")


def test_cursor_resume_is_exact_across_epochs():
    a = SyntheticPromptDataset("copy", num_prompts=10, seed=3, min_digits=3, max_digits=5)
    first = a.next_batch(7)
    state = a.state_dict()
    rest = a.next_batch(9)  # crosses into epoch 1
    assert a.state_dict()["epoch"] == 1
    b = SyntheticPromptDataset("copy", num_prompts=10, seed=3, min_digits=3, max_digits=5)
    b.load_state_dict(state)
    assert [e["id"] for e in b.next_batch(9)] == [e["id"] for e in rest]
    # one epoch visits every prompt once
    c = SyntheticPromptDataset("copy", num_prompts=10, seed=3, min_digits=3, max_digits=5)
    assert sorted(e["id"] for e in c.next_batch(10)) == list(range(10))
    # same seed, same order
    assert [e["id"] for e in first] == [e["id"] for e in SyntheticPromptDataset("copy", 10, 3, 3, 5).next_batch(7)]
