"""The ground floor: backend and device, the process group, checkpoints, data,
models, rank-aware logging and process plumbing. Imports nothing else from
ddpguide."""
