"""An ``s3://`` root on obstore: the client, the lease, the steps and leftovers on a prefix, the
save backend (commit by conditional create), push, pull and discovery."""
