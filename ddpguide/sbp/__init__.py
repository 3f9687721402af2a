"""SBP on DTensor: placements and regions, boxing rules and boxing by hand,
the chapter's workers and figures."""
