"""Multi-turn environments: a sample is an episode, not one completion.

    class MyEnv:                                       # env.path: "my_pkg.envs:MyEnv"
        def reset(self, example) -> str | list[dict]:  # the first prompt: text, or chat messages
        def step(self, messages, completion) -> (observation | None, reward, done)

``base`` loads and checks an environment class and renders turns into tokens (plain text for the
char tokenizer, the chat template's own turn markup for a Hugging Face tokenizer); ``episodes``
runs a shard's episodes turn by turn against any ``generate`` callable and lays the sequence out
for the trainer (policy tokens trained, observation tokens masked); ``calculator`` and ``guess``
are the two bundled examples (a tool call, and a higher/lower game).
"""
