"""A root that is a directory of a POSIX file system: the storage seam (raw OS calls, async
``Storage`` on the I/O pool, the blocking file writes, ``ensure_dir``, link-safe removal),
mmap-free file I/O, discovery, ownership by ``flock``, retention and leftovers."""
