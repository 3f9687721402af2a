"""Model and pipeline parallelism: the split models, stages and micro-batches,
point-to-point transfers, schedules and their figures."""
