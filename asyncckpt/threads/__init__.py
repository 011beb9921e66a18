"""The threads asyncckpt runs work on: a dedicated loop thread (the writer's, the mirror's, the
lease keeper's), the one shared loop for coroutines run from synchronous code, and the bounded
pool for blocking file-system calls with the meter of its threads' CPU time; and the
``Deadline`` type every wait of one operation counts down to."""
