"""``python -m ddpguide.doctor``: a pre-flight check of a distributed job.

Run it where the training will run, with the same launcher::

    python -m ddpguide.doctor                      # no launcher: a local group of 2 ranks
    python -m ddpguide.doctor --nproc 4            # ... of 4 ranks
    torchrun --standalone --nproc-per-node 2 -m ddpguide.doctor
    torchrun --nnodes 2 --nproc-per-node 8 --rdzv-backend c10d \\
        --rdzv-endpoint HOST:29500 -m ddpguide.doctor --json doctor.json

Every rank checks its launcher variables, that ``MASTER_ADDR`` resolves, reaches
the rendezvous endpoint (``MASTER_ADDR:MASTER_PORT``, bounded by ``--timeout``)
and registers in the rendezvous store; rank 0 checks that they agree (unique
``RANK`` below ``WORLD_SIZE``, one ``MASTER_ADDR``/``MASTER_PORT``, ``LOCAL_RANK``
below ``LOCAL_WORLD_SIZE``, one GPU per rank by the package's rule or "GPUs
visible but this job would run on CPU", one torch and nccl version, ``/dev/shm``;
on each rank's GPU at least 90% of its memory free, no process of another job there
by ``nvidia-smi``, and a float64 matmul equal to the CPU's: :mod:`ddpguide.doctor.gpu`).
Then the ranks form a process group, check the collectives the book uses
(:data:`ddpguide.doctor.collectives.CHECKS`, the 2-D sub-groups, then
``dist.monitored_barrier``) against their known results, time an all-reduce
sweep and every ring link, and optionally a shared checkpoint directory
(``--checkpoint-dir``, ``--checkpoint-size``) and the clocks. Rank 0 prints one
line per rank, one line per problem (``PROBLEM rank R (host H): ...``) and a
summary. Each rank ends within 3 x ``--timeout`` + 120 s (its watchdog).

Under SLURM, run it as the training runs: torchrun inside the job (one agent
per node, as ``cluster/slurm_torchrun.sbatch`` does), or srun with ``RANK``,
``WORLD_SIZE``, ``MASTER_ADDR`` and ``MASTER_PORT`` exported per task; srun
tasks without ``RANK`` are told so instead of each starting a local group.

Exit status: 0 when every check passed, 1 when a problem was found (always
within a bounded time, never a hang), 2 for invalid options.

``DDPGUIDE_DOCTOR_FAKE_GPUS=N`` makes the device check believe each machine
has N GPUs (identities ``fake-gpu-0`` ...), so the GPU assignment can be
tested on a CPU machine; collectives still run where
:func:`ddpguide.runtime.select_runtime` puts them. ``DDPGUIDE_DOCTOR_FAKE_GPU_STATE``
(``free=10G,total=80G,matmul_error=0.5``) says what those GPUs' memory and matmul
would show. The GPU checks are tested this way only: none has run on a real GPU here.
"""

#: Environment variable: pretend this many GPUs are visible (device check only).
FAKE_GPUS_VARIABLE = "DDPGUIDE_DOCTOR_FAKE_GPUS"
#: Set by the local launcher on the ranks it starts, so they can say how they were started.
LOCAL_LAUNCH_VARIABLE = "DDPGUIDE_DOCTOR_LOCAL"
