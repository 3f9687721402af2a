"""Collectives from scratch: the all-reduce algorithms, the chapter's demos and
their figures."""
