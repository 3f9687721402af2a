"""What a CPU can check of the CUDA branch of ``book/programs/gpt/cost_model.py``.

On CUDA the attention's saved state depends on the kernel SDPA picks
(``cost_model.attention_kernel``): flash and the memory-efficient kernel cannot run on a
CPU, but the math kernel, which CUDA runs for float64 and for grouped-query attention in
float32, is a composite of ordinary operations that runs the same on both:
:func:`saved_by_kernel` forces it (or the CPU's own kernel) with
``torch.nn.attention.sdpa_kernel`` in one process, counts what autograd keeps with the
program's own counter (``cost_meter.SavedBytes``) and sets it beside
``cost_model.predict_memory`` for that kernel. The norms stay the CPU's composite there,
so the comparison is the CPU branch with the attention of the kernel named.
"""

from __future__ import annotations

import types

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

from ddpguide.launch.programs import load

#: the kernels a CPU can run: cost_model's name -> the SDPA backend that forces it
BACKENDS = {"cpu": SDPBackend.FLASH_ATTENTION, "math": SDPBackend.MATH}


def saved_by_kernel(kernel: str, dtype: str = "float64", batch: int = 4, **config: int) -> dict:
    """``{"measured", "predicted"}``: bytes autograd keeps in one forward of the program's
    GPT (one process, ``config`` as ``model.Config``'s fields) with the attention kernel
    forced, and ``predict_memory``'s activations for that kernel."""
    if kernel not in BACKENDS:
        raise ValueError(f"saved_by_kernel: {kernel!r} does not run on a CPU (one of {', '.join(BACKENDS)})")
    model, cost_model = load("gpt/model.py"), load("gpt/cost_model.py")
    meter, parallelize = load("gpt/cost_meter.py"), load("gpt/parallelize.py")
    c = model.Config(**config)
    c = model.Config(**{**config, "kv_heads": c.kv_heads or c.heads})
    args = types.SimpleNamespace(dtype=dtype, bf16=False, batch=batch, accumulate=1, microbatches=1,
                                 schedule="1F1B", checkpoint_activations=False, clip=1.0)
    before = torch.get_default_dtype()
    torch.set_default_dtype(getattr(torch, dtype))
    try:
        torch.manual_seed(0)
        gpt = model.GPT(c)
        x = torch.randint(0, c.vocab, (batch, c.seq))
        saved = meter.SavedBytes(gpt)
        with saved.hooks, sdpa_kernel(BACKENDS[kernel]):
            loss = model.loss_of(gpt(x), x)
        loss.backward()  # the graph was whole
    finally:
        torch.set_default_dtype(before)
    predicted = cost_model.predict_memory(c, parallelize.Layout(), args, 0, kernel=kernel)
    return {"measured": saved.peak, "predicted": predicted["activations"]}
