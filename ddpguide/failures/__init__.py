"""Per-step fault tolerance (chapter 17): the checks on ``ft_train.py``'s reports, the chaos
run, semi-synchronous training's bytes, and the checkpoint interval under failures."""
