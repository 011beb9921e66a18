"""Where checkpoints live: a POSIX directory (``posix/``) or an object-store prefix
(``objstore/``), and what serves both (the storage half of the save protocol, bad marks, read
faults, runs, the Checkpointer's start on its root)."""
