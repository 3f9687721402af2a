"""The anchors of the ``plan`` suite's fixed ratios (``appendix.ANCHORS["plan"]``): meaning,
reference, goal. The per-layout ratios are named by their layout and explained by the chapter."""

ANCHORS: dict[str, tuple[str, str, str]] = {
    "rank_correlation": ("Spearman's rank correlation, predicted against measured step, every layout "
                         "train.py runs of the GPT on 4 ranks (loopback)", "", ">= 0.8"),
    "rank_correlation_dtensor_constants": ("the same with DTensor's built-in link constants "
                                           "(MeshTopoInfo: 87.7 GB/s, 0.6 us a hop)", "", ""),
    "best_layout_measured_over_best_measured": ("measured step of the planner's best layout / the best "
                                                "measured step", "", "<= 1.05"),
    "best_layout_measured_over_best_measured_dtensor_constants": ("the same with DTensor's constants", "", ""),
}
