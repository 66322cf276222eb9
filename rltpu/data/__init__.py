"""What goes into a rollout and how it is scored: prompt sources (``synthetic`` built-in tasks,
``sources`` files and the one factory), tokenizers (``char_tokenizer``, ``hf_tokenizer``), rule
rewards (``rewards``), multi-turn environments (``envs``: the interface, the episode loop, two
bundled examples) and a local chat example (``chat_example``)."""
