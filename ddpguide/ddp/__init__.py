"""Data parallelism: DDP written by hand, and the pitfalls of a DDP script as runnable checks."""
