"""One shard's episodes, turn by turn, laid out for the trainer.

    out = run_episodes(generate, envs, renderer, examples, G, seed, max_turns, max_tokens, max_context, call)

Each row (example i's g-th sample) is an episode. Turn 0 samples G completions per prompt (one
shared prefill per prompt); each later turn samples one completion for every row still playing,
with its whole history as the prompt. After every turn the environment's ``step`` runs for each
playing row (``call``: under a deadline, in the worker's threads).

The row the trainer gets is the same fixed-shape layout as a single-turn row, ``(prompt, response)``
with the response region ``max_tokens`` wide: ``c1 o1 c2 o2 ... cn`` (completions, observations).
``policy_mask`` is 1 on completion tokens (stop token included) and 0 on observations and padding;
``logprobs`` and ``token_versions`` hold each completion token's sampler logprob and the weight
version that sampled it (-1 elsewhere); ``token_turns`` the turn that wrote it (-1 elsewhere) and
``turn_returns`` (rows x ``max_turns``) each turn's return-to-go, the sum of its own and later turns'
rewards (``env.credit: turn`` trains a turn's tokens on that, not on rewards earned before it). Versions can differ between turns in async mode (a sync
can land between two turns of one episode); ``versions`` (per row) is the oldest, which is what the
staleness bound is checked against.

An episode ends when the environment says done, after ``max_turns`` turns, when the next
observation would not fit ``max_tokens`` or the sampler's largest prompt bucket (``truncated``),
or when a ``reset``/``step`` call fails (raised, timed out, non-finite reward): the episode then
scores the default and its failure kind is reported like a failed reward call.
"""

from __future__ import annotations

import time
from typing import Callable

import numpy as np

from rltpu.data.rewards import DeadlineRunner
from rltpu.data.envs.base import Renderer, check_reset, check_step

ACCOUNTING = ("seconds", "program_seconds", "host_seconds", "new_tokens", "decode_steps", "compiles",
              "compile_seconds", "padded_slots", "total_slots", "prefill_tokens", "preemptions", "slot_steps")


def _reset(env, example):
    return env.reset(example)


def _step(env, messages, text):
    return env.step(messages, text)


CHECKS = {"reset": (_reset, check_reset), "step": (_step, check_step)}


def direct_call(what: str, items: list[tuple]) -> list[tuple]:
    """No deadline, same outcomes (tests; a failing call is its outcome, never raised)."""
    fn, check = CHECKS[what]
    out = []
    for item in items:
        try:
            out.append(check(fn(*item)))
        except Exception as err:  # noqa: BLE001 - user code: the call's outcome
            out.append((None, "error", f"{type(err).__name__}: {err}"))
    return out


def deadline_call(timeout_s: float, concurrency: int) -> Callable[[str, list[tuple]], list[tuple]]:
    """Calls on ``DeadlineRunner`` threads, each under ``timeout_s`` (the reward workers' runner):
    a hanging ``step`` costs its own deadline, overlapped with the other rows' calls."""
    runners = {what: DeadlineRunner(fn, timeout_s, concurrency, check) for what, (fn, check) in CHECKS.items()}

    def call(what: str, items: list[tuple]) -> list[tuple]:
        return runners[what].run(items) if items else []

    call.runners = runners
    return call


def _stop_cut(tokens: np.ndarray, length: int) -> list[int]:
    return [int(t) for t in tokens[:length]]


def run_episodes(generate: Callable, envs: list, renderer: Renderer, examples: list[dict], G: int, seed: int,
                 max_turns: int, max_tokens: int, max_context: int,
                 call: Callable[[str, list[tuple]], list[tuple]], default: float = 0.0) -> dict:
    """``generate(prompts, n, seed) -> engine output``; ``envs``: one fresh instance per row
    (``len(examples) * G``); ``call("reset" | "step", items) -> [(value, kind, detail)]`` runs
    ``env.reset(example)`` / ``env.step(messages, text)`` for each item (``deadline_call``: each under
    its deadline). Returns the engine-shaped output of the whole episode plus ``rewards``,
    ``reward_kinds``, ``reward_details``, ``turns``, ``truncated``, ``env_seconds``."""
    R = len(examples) * G
    if len(envs) != R:
        raise ValueError(f"{len(envs)} environments for {R} rows")
    rows_ex = [examples[r // G] for r in range(R)]
    t_env = time.perf_counter()
    resets = call("reset", list(zip(envs, rows_ex)))
    env_s = time.perf_counter() - t_env
    kinds = ["ok"] * R
    details = [""] * R
    ret = np.zeros(R, np.float64)
    turn_rewards = np.zeros((R, max_turns), np.float64)  # each turn's reward: returns-to-go for turn credit
    messages: list[list[dict]] = [[] for _ in range(R)]
    prompts: list[list[int]] = [[] for _ in range(R)]
    done = np.zeros(R, bool)
    for r, (value, kind, detail) in enumerate(resets):
        if kind != "ok":  # one attended pad token: a row with nothing to attend would give NaN logits
            kinds[r], details[r], done[r], prompts[r] = kind, f"reset: {detail}", True, [renderer.tok.pad_id]
            continue
        messages[r] = value
        prompts[r] = renderer.prompt(value)
        if len(prompts[r]) > max_context:  # the sampler would refuse the whole shard: fail this row only
            kinds[r], done[r] = "error", True
            details[r] = (f"reset: the first prompt is {len(prompts[r])} tokens, over the largest "
                          f"sampler.prompt_buckets entry {max_context}; add a larger bucket")
            prompts[r] = prompts[r][-max_context:]
    ids: list[list[int]] = [[] for _ in range(R)]
    mask: list[list[int]] = [[] for _ in range(R)]
    tturn: list[list[int]] = [[] for _ in range(R)]  # the turn of each response token (-1: the environment's)
    logp: list[list[float]] = [[] for _ in range(R)]
    ver: list[list[int]] = [[] for _ in range(R)]
    turns = np.zeros(R, np.int32)
    truncated = np.zeros(R, bool)
    acc = dict.fromkeys(ACCOUNTING, 0)
    occupancy, first = [], None
    for turn in range(max_turns):
        live = [r for r in range(R) if not done[r]]
        if not live:
            break
        shared = turn == 0 and len(live) == R and all(prompts[r] == prompts[r - r % G] for r in range(R))
        if shared:  # one prefill per prompt, G samples each
            out = generate([prompts[r] for r in range(0, R, G)], G, seed)
        else:
            out = generate([prompts[r] + ids[r] for r in live], 1, seed + 7919 * turn)
        if turn == 0:
            first = out if shared else None
        for k in ACCOUNTING:
            acc[k] += out.get(k) or 0
        if out.get("occupancy") is not None:
            occupancy.append(out["occupancy"])
        row_version = out["versions"] if "versions" in out else np.full(len(out["lengths"]), out["version"])
        texts = []
        for i, r in enumerate(live):
            comp = _stop_cut(out["tokens"][i], int(out["lengths"][i]))
            room = max_tokens - len(ids[r])
            if len(comp) > room:
                comp, truncated[r] = comp[:room], True
            ids[r] += comp
            mask[r] += [1] * len(comp)
            tturn[r] += [turn] * len(comp)
            logp[r] += [float(x) for x in out["logprobs"][i, :len(comp)]]
            ver[r] += [int(row_version[i])] * len(comp)
            turns[r] += 1
            texts.append(renderer.tok.decode(comp))
        t_env = time.perf_counter()
        steps = call("step", [(envs[r], messages[r] + [{"role": "assistant", "content": t}], t)
                              for r, t in zip(live, texts)])
        env_s += time.perf_counter() - t_env
        for r, text, (value, kind, detail) in zip(live, texts, steps):
            messages[r] = messages[r] + [{"role": "assistant", "content": text}]
            if kind != "ok":
                kinds[r], details[r], done[r] = kind, f"step (turn {turn + 1}): {detail}", True
                continue
            observation, reward, finished = value
            ret[r] += reward
            turn_rewards[r, turn] = reward
            if finished or observation is None or turn + 1 == max_turns or truncated[r]:
                done[r] = True
                continue
            obs = renderer.observation(observation)
            if len(ids[r]) + len(obs) + 1 > max_tokens or len(prompts[r]) + len(ids[r]) + len(obs) > max_context:
                done[r] = truncated[r] = True  # no room for the observation and one more token
                continue
            ids[r] += obs
            mask[r] += [0] * len(obs)
            tturn[r] += [-1] * len(obs)
            logp[r] += [0.0] * len(obs)
            ver[r] += [-1] * len(obs)
            messages[r].append({"role": renderer.role, "content": observation})
    ok = np.array(kinds) == "ok"
    rewards = np.where(ok, ret, default).astype(np.float32)
    # returns-to-go: what turn k's tokens could still influence (a failed episode: the default from every turn)
    returns = np.flip(np.cumsum(np.flip(turn_rewards, 1), 1), 1)
    returns = np.where(ok[:, None], returns, default).astype(np.float32)
    token_turns = np.full((R, max_tokens), -1, np.int32)
    for r in range(R):
        token_turns[r, :len(tturn[r])] = tturn[r]
    return _layout(first, prompts, ids, mask, logp, ver, renderer, max_tokens) | {
        "turn_returns": returns, "token_turns": token_turns} | {
        k: v for k, v in acc.items()} | {
        "rewards": rewards, "reward_kinds": kinds, "reward_details": details, "turns": turns,
        "truncated": truncated, "env_seconds": env_s,
        "occupancy": float(np.mean(occupancy)) if occupancy else None}


def _layout(first: dict | None, prompts, ids, mask, logp, ver, renderer: Renderer, T: int) -> dict:
    """The engine-shaped arrays: prompts left-padded (the turn-0 call's own arrays when it shared
    one prefill per prompt), the response region right-padded to ``T``."""
    R = len(ids)
    pad = renderer.tok.pad_id
    if first is not None:
        prompt, pmask = first["prompt"], first["prompt_mask"]
    else:
        P = max(max((len(p) for p in prompts), default=1), 1)
        prompt = np.full((R, P), pad, np.int32)
        pmask = np.zeros((R, P), np.int32)
        for r, p in enumerate(prompts):
            if p:
                prompt[r, P - len(p):], pmask[r, P - len(p):] = p, 1
    tokens = np.full((R, T), pad, np.int32)
    policy = np.zeros((R, T), np.int32)
    logprobs = np.zeros((R, T), np.float32)
    versions = np.full((R, T), -1, np.int64)
    for r in range(R):
        n = len(ids[r])
        tokens[r, :n], policy[r, :n], logprobs[r, :n], versions[r, :n] = ids[r], mask[r], logp[r], ver[r]
    lengths = np.array([len(x) for x in ids], np.int32)
    played = versions.max(axis=1) >= 0
    row_version = np.where(played, np.where(versions >= 0, versions, np.iinfo(np.int64).max).min(axis=1), -1)
    return {"prompt": prompt, "prompt_mask": pmask, "tokens": tokens, "logprobs": logprobs, "lengths": lengths,
            "policy_mask": policy, "token_versions": versions, "versions": row_version,
            "version": int(row_version.max()) if R else -1}
