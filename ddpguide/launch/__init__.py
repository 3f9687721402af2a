"""Starting workers: from a notebook (``spawn``), as torchrun agents on one
machine (``torchrun``), and what each worker is told (``whoami``)."""
