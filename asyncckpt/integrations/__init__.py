"""Integrations of asyncckpt with the frameworks people already run (each imported on its own)."""
