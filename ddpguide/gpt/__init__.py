"""Chapter 14's machinery: the GPT of ``book/programs/gpt/`` run on every layout and
compared with one process (``python -m ddpguide.gpt``)."""
