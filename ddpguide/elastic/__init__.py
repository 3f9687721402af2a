"""Elastic training with torchrun: nodes that join, leave and crash.

``python -m ddpguide.elastic`` runs the local demo; ``node`` runs one
machine's torchrun agent with the package's tuned rendezvous settings;
``store`` hosts the rendezvous store as a process of its own. The workers
(``ddpguide.elastic.worker``) run the book's training core and resume from an
atomic checkpoint after every change of membership.

This module imports nothing heavy: every worker restart imports it.
"""

from ddpguide.elastic.settings import (
    STORE_SHARING_WORKAROUND,
    TORCHRUN_MONITOR_INTERVAL,
    TORCHRUN_RDZV_CONF,
    TUNED_MONITOR_INTERVAL,
    TUNED_RDZV_CONF,
    AgentSettings,
    UsageError,
)

__all__ = [
    "STORE_SHARING_WORKAROUND", "TORCHRUN_MONITOR_INTERVAL", "TORCHRUN_RDZV_CONF",
    "TUNED_MONITOR_INTERVAL", "TUNED_RDZV_CONF", "AgentSettings", "UsageError",
]
