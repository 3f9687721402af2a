"""The training loop, mixed precision, SyncBatchNorm and the command line
(``python -m ddpguide.train``, ``torchrun -m ddpguide.train``)."""
