"""Integrations of asyncckpt with training frameworks (each needs its framework installed)."""
