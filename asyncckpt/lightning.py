"""The Lightning plugin's first home, kept so that ``from asyncckpt.lightning import ...`` keeps
working: everything lives in :mod:`asyncckpt.integrations.lightning`."""

from .integrations.lightning import ROOT_NAME, AsyncckptCheckpointIO, load_checkpoint, read_pointer

__all__ = ["ROOT_NAME", "AsyncckptCheckpointIO", "load_checkpoint", "read_pointer"]
