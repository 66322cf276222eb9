"""The environment interface, its loader, and how a turn becomes tokens.

An environment is a class with two methods; one instance plays one episode:

    reset(example: dict) -> str | list[dict]
        the first prompt: plain text, or chat messages ``[{"role", "content"}, ...]``
    step(messages: list[dict], completion: str) -> (observation: str | None, reward: float, done: bool)
        ``messages`` is the conversation so far, the policy's ``completion`` last; the observation
        (a tool result, feedback) is appended as the next message unless ``done`` or None. The
        episode's reward is the sum of its steps' rewards.

Why this shape: it is what a tool loop or a game already looks like in user code (no framework base
class to inherit, no tokens), and everything token-level (masks, logprobs, versions) stays ours.
An optional class attribute ``observation_role`` (default ``"tool"``) names the role observations
take in chat messages.
"""

from __future__ import annotations

import importlib
import math
from typing import Any

from rltpu.config import ConfigError


def load_env_class(path: str) -> type:
    """``module:Class`` -> the class, checked for ``reset`` and ``step``; a one-line error otherwise."""
    module_name, _, name = path.partition(":")
    try:
        module = importlib.import_module(module_name)
    except ImportError as err:
        raise ConfigError(f"env.path={path!r}: cannot import module {module_name!r} ({err}); "
                          f"check the module path and that its package is installed") from None
    except BaseException as err:  # noqa: BLE001 - the module's own code raised (or a SyntaxError): one line
        if isinstance(err, KeyboardInterrupt):
            raise
        text = str(err).strip().splitlines()
        raise ConfigError(f"env.path={path!r}: importing module {module_name!r} raised {type(err).__name__}"
                          f"{': ' + text[0][:200] if text else ''}; fix the module (it runs as trusted code in "
                          f"every environment worker)") from None
    cls = getattr(module, name, None)
    if cls is None:
        raise ConfigError(f"env.path={path!r}: module {module_name!r} has no {name!r}")
    missing = [m for m in ("reset", "step") if not callable(getattr(cls, m, None))]
    if missing:
        raise ConfigError(f"env.path={path!r}: {name} has no {' or '.join(missing)} method; an environment needs "
                          f"reset(example) and step(messages, completion)")
    return cls


def make_env(cls: type, kwargs: dict) -> Any:
    try:
        return cls(**kwargs)
    except TypeError as err:
        raise ConfigError(f"env.kwargs {sorted(kwargs)} do not fit {cls.__name__}() ({err})") from None


def check_step(result) -> tuple[Any, str, str]:
    """A ``step`` result as ``DeadlineRunner`` wants it: ``((observation, reward, done), kind, detail)``."""
    try:
        observation, reward, done = result
    except (TypeError, ValueError):
        return None, "error", f"step returned {type(result).__name__}, not (observation, reward, done)"
    reward = float(reward)
    if not math.isfinite(reward):
        return None, "nonfinite", f"returned reward {reward}"
    if observation is not None and not isinstance(observation, str):
        return None, "error", f"observation is {type(observation).__name__}, not str or None"
    return (observation, reward, bool(done)), "ok", ""


def check_reset(result) -> tuple[Any, str, str]:
    if isinstance(result, str):
        return [{"role": "user", "content": result}], "ok", ""
    if isinstance(result, list) and all(isinstance(m, dict) and "role" in m and "content" in m for m in result):
        return [dict(m) for m in result], "ok", ""
    return None, "error", f"reset returned {type(result).__name__}, not text or a list of {{role, content}} messages"


class Renderer:
    """Turns messages into token ids the way the policy sees them.

    Plain text (the char tokenizer, or a tokenizer without a chat template): the prompt is the
    messages' contents joined, with BOS; an observation is its text. A chat template: the prompt is
    the template with the assistant header; an observation is exactly what the template puts after
    the policy's stop token up to the next assistant header (its end-of-turn markup, the tool
    message, the new header), found by rendering a fixed conversation with and without it."""

    def __init__(self, tokenizer, observation_role: str = "tool"):
        self.tok, self.role = tokenizer, observation_role
        self.chat = bool(getattr(tokenizer, "chat_template", None))

    def prompt(self, messages: list[dict]) -> list[int]:
        if self.chat:
            return self.tok.encode(self.tok.apply_chat_template(messages), add_bos=False)
        return self.tok.encode("".join(str(m["content"]) for m in messages))

    def observation(self, text: str) -> list[int]:
        if not self.chat:
            return self.tok.encode(text, add_bos=False)
        base = [{"role": "user", "content": "u"}, {"role": "assistant", "content": "a"}]
        before = self.tok.apply_chat_template(base, add_generation_prompt=False)
        after = self.tok.apply_chat_template(base + [{"role": self.role, "content": text}])
        eos = self.tok.decode([self.tok.eos_id], stop_at_eos=False)
        cut = before.rfind(eos)
        if not after.startswith(before[:cut]) or cut < 0:
            raise ConfigError(f"the chat template does not render a {self.role!r} message after an assistant turn "
                              f"as a continuation; set the environment's observation_role to a role it supports")
        return self.tok.encode(after[cut + len(eos):], add_bos=False)
