"""Sharding: ZeRO, FSDP2, tensor parallelism and checkpoints that reshard."""
