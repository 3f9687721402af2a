"""The anchors of the ``plan`` suite's fixed ratios (``appendix.ANCHORS["plan"]``): meaning,
reference, goal. The per-layout and per-row ratios are named by their layout or row and
explained by the chapter."""

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
}
