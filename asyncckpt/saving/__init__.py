"""One save, from the caller's tensors to a committed step: staging, dedupe, the commit
protocol and its pre-commit check, the handle, and tier mode's background upload."""
