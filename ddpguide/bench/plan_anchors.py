"""The anchors of the ``plan`` suite's fixed ratios (``appendix.ANCHORS["plan"]``): meaning,
reference, goal. The per-layout and per-row ratios are named by their layout or row and
explained by the chapter."""

from ddpguide.bench.plan_command import ANCHORS as COMMAND
from ddpguide.plan.perturb import TERMS

ANCHORS: dict[str, tuple[str, str, str]] = {
    "rank_correlation": ("Spearman's rank correlation, predicted against measured step, every layout "
                         "train.py runs of the GPT on chapter 15's emulated cluster (2 nodes x 2 ranks, "
                         "20mbit links)", "", ">= 0.8"),
    "rank_correlation_dtensor_constants": ("the same with DTensor's built-in link constants "
                                           "(MeshTopoInfo: 87.7 GB/s, 0.6 us a hop)", "", ""),
    "best_layout_measured_over_best_measured": ("measured step of the planner's best layout / the best "
                                                "measured step", "", "<= 1.05"),
    "best_layout_measured_over_best_measured_dtensor_constants": ("the same with DTensor's constants", "", ""),
    "step_predicted_over_measured: *": ("step time predicted from the microbenchmarks / measured, that layout "
                                        "on the emulated cluster", "", "0.8-1.25"),
    "memory_predicted_over_measured: *": ("parameters + gradients + AdamW state + saved activations, predicted / "
                                          "counted by train.py --cost at the busiest rank", "", "0.95-1.05"),
    "published_predicted_over_reported: *": ("tokens/s a GPU (torchtitan) or MFU (the Playbook, picotron) "
                                             "predicted / published, H100 data sheet", "", "median 0.8-1.25"),
    "step_predicted_over_measured_loopback: *": ("step time predicted with the compute rate measured beside "
                                                 "the run (a matmul timed in its ranks before the steps) / "
                                                 "measured, that layout on loopback", "", "0.8-1.25"),
    "step_predicted_over_measured_loopback_table: *": ("the same predicted from the table alone (plan_measure.py's "
                                                       "matmul rates, cores and link, measured just before that run)",
                                                       "", ""),
    "rank_correlation_loopback": ("Spearman's rank correlation of the loopback layouts, the rate beside each run",
                                  "", ">= 0.8"),
    "compute_share_min": ("predicted compute over predicted step, the layout with the least, the cluster's and "
                          "loopback's (the time check tests a term only where it is a large share)", "", "< 0.25"),
    "compute_share_max": ("the same, the layout with the most", "", "> 0.75"),
    "memory_predicted_over_tracker: *": ("predicted peak, every part (FSDP's buffers included) / the peak torch's "
                                         "FSDPMemTracker or MemTracker sees, busiest rank, loopback", "", "0.9-1.1"),
    **COMMAND,
    **{f"perturbed_{term}_out_of_band": (f"1 when the model with its {term} doubled moves a layout out of "
                                         "0.8-1.25 (or Spearman below 0.8): the time check catches that error",
                                         "", "1") for term in TERMS},
}
