"""Bundled example 2, a feedback game: find a secret digit from higher/lower answers.

    prompt       ?
    policy       5        a guess: one digit
    environment  <        the secret is lower ('>' higher, '!' not a single digit)
    policy       2
    environment  >
    policy       3        found: reward 1, the episode ends

Reward 1 when the secret is found within the episode's turns, else 0. A binary search finds it
in at most 4 guesses (``configs/env_guess.yaml`` allows 5); without the environment's turn (``max_turns: 1``) no policy can
do better than 1 in 10, so what the policy learns is to use the feedback.

Use with ``task.name: guess`` (examples with ``prompt`` and ``secret``).
"""

from __future__ import annotations


class GuessNumber:
    observation_role = "user"

    def __init__(self):
        self.secret = -1

    def reset(self, example: dict) -> str:
        self.secret = int(example["secret"])
        return example["prompt"]

    def step(self, messages: list[dict], completion: str) -> tuple[str | None, float, bool]:
        if len(completion) != 1 or not completion.isdigit():
            return "!", 0.0, False
        guess = int(completion)
        if guess == self.secret:
            return None, 1.0, True
        return ("<" if self.secret < guess else ">"), 0.0, False
