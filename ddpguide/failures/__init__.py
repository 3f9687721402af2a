"""Per-step fault tolerance (chapter 17): the engine that runs ``ft_train.py`` as torchft
deploys it (the lighthouse, one torchrun per replica group), chaos from outside, the checks
on its reports, semi-synchronous training's bytes, and the checkpoint interval under failures."""
