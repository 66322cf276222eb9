"""A reward for the model.path end-to-end test: ``exact_answer`` on a dataset column plus partial
credit for the answer's characters (so a random policy's group rewards differ and the update
moves the weights), and one JSON line per call (written in the controller process) so the test
can see what the reward received. Kept out of the test module so the controller imports nothing
heavy to load it."""

import json
import os

from rltpu.data.rewards import exact_answer

REWARD_LOG = "RLTPU_TEST_HF_REWARD_LOG"


def logged_answer_reward(completion: str, example: dict, column: str = "answer") -> float:
    with open(os.environ[REWARD_LOG], "a") as f:
        f.write(json.dumps({"id": example["id"], "answer": example[column], "prompt": example["prompt"]}) + "\n")
    answer = set(str(example[column]))
    overlap = len(answer & set(completion)) / max(len(answer), 1)
    return 0.5 * exact_answer(completion, example, column) + 0.5 * overlap
