"""The chapter's program, imported by path: its layer, router and exchange, nothing copied."""

from __future__ import annotations

import importlib.util
from functools import lru_cache
from types import ModuleType

from ddpguide.launch.programs import path_of

NAME = "moe_expert_parallel.py"


@lru_cache(maxsize=1)
def load() -> ModuleType:
    """``book/programs/moe_expert_parallel.py`` as a module (its ``main`` does not run)."""
    path = path_of(NAME)
    spec = importlib.util.spec_from_file_location("moe_expert_parallel", path)
    if spec is None or spec.loader is None:
        raise ImportError(f"cannot load {path} as a module")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module
