"""Data parallelism: DDP written by hand, the equivalence check against one
process, and the pitfalls of a DDP script as runnable checks."""
