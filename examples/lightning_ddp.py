"""Lightning with asynchronous checkpoints, on one process or under DDP (gloo on the CPU).

    .venv/bin/python examples/lightning_ddp.py --dir runs/lit --epochs 20 --devices 2   (after `make venv`)

``AsyncckptCheckpointIO`` makes every ``ModelCheckpoint`` save return once the state is
staged; the file Lightning names (``epoch=3-step=8.ckpt``, ``last.ckpt``) is a pointer written
only after its step committed, in ``--dir/.asyncckpt-lightning``. With ``--devices 2``
Lightning starts a second rank itself; rank 0 saves, every rank loads. Kill it at any moment
(``kill -9`` of the whole process group, Ctrl-C) and run the same command again:
``ckpt_path="last"`` resumes from the newest complete checkpoint.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # this checkout's asyncckpt

import lightning as L
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from torch.utils.data import DataLoader, TensorDataset

from asyncckpt.integrations.lightning import AsyncckptCheckpointIO


class Regressor(L.LightningModule):
    def __init__(self, lr: float = 0.05) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.net = torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.Tanh(), torch.nn.Linear(64, 1))

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        loss = torch.nn.functional.mse_loss(self.net(x), y)
        self.log("train_loss", loss, on_step=False, on_epoch=True, sync_dist=True, prog_bar=True)
        return loss

    def configure_optimizers(self) -> Any:
        return torch.optim.AdamW(self.parameters(), lr=self.hparams.lr)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--dir", default="runs/lit")
    p.add_argument("--epochs", type=int, default=20)
    p.add_argument("--devices", type=int, default=1)
    a = p.parse_args()
    torch.set_num_threads(1)
    g = torch.Generator().manual_seed(0)
    x = torch.randn(512, 16, generator=g)
    data = DataLoader(TensorDataset(x, x.sum(1, keepdim=True)), batch_size=32)
    torch.manual_seed(1)
    trainer = L.Trainer(
        max_epochs=a.epochs, accelerator="cpu", devices=a.devices, strategy="ddp" if a.devices > 1 else "auto",
        plugins=[AsyncckptCheckpointIO()], logger=False, enable_model_summary=False,
        callbacks=[ModelCheckpoint(dirpath=a.dir, monitor="train_loss", save_top_k=2, save_last=True)],
    )  # fmt: skip
    trainer.fit(Regressor(), train_dataloaders=data, ckpt_path="last")  # "last": resume if there is one


if __name__ == "__main__":
    main()
