"""The ranks of a job, over the c10d store only (never a collective): the process group and
its store, the coordination of one save, agreements made at the call, the check that every
rank sees the same root, and ``on_every_rank``."""
