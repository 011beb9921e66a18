"""The facade: ``Checkpointer`` and ``load()``, and the parts the facade delegates to."""
