"""An ``s3://`` root on obstore: the client, the lease, the steps and leftovers on a prefix, the
save backend (commit by conditional create), push, pull and discovery."""

# Every module here needs obstore, an optional dependency: say which extra brings it, once.
try:
    import obstore  # noqa: F401
except ImportError as _missing:
    raise ImportError(
        "asyncckpt: s3:// roots, mirror= and asyncckpt.remote need the s3 extra: "
        f"pip install 'asyncckpt[s3]' (obstore could not be imported: {_missing})"
    ) from _missing
