"""A reward for tests/test_e2e_rewards.py with injected faults, chosen by the training example's id
so the test can count them from ``ledger.jsonl``: id % 10 == 0 sleeps past the deadline, id % 10 == 1
raises, anything else is ``partial_credit``. Evaluation rows (string ids) are never faulted. Kept
out of the test module so a reward worker imports nothing heavy to load it."""

import time

from rltpu.data.rewards import partial_credit

SLEEP_S = 3.0  # the test's task.reward_timeout_s is 1.0


def faulty_partial_credit(completion: str, example: dict) -> float:
    i = example["id"]
    if isinstance(i, int) and i % 10 == 0:
        time.sleep(SLEEP_S)
    elif isinstance(i, int) and i % 10 == 1:
        raise RuntimeError(f"injected failure on example {i}")
    return partial_credit(completion, example)
