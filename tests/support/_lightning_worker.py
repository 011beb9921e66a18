"""A tiny Lightning training run checkpointing through AsyncckptCheckpointIO.

argv: ckpt_dir losses_file epochs [devices [final_weights]] ; used in-process by tests/test_lightning.py
too. With devices=2, Lightning's DDP strategy on the CPU (gloo) runs this script again as rank 1;
rank 0 writes the losses (of its half of the data) and, at the end, the final weights.
Deterministic on the CPU: fixed data, no shuffling, no dropout, so a resume from a checkpoint
reproduces the losses of an uninterrupted run exactly.
"""

from __future__ import annotations

import argparse
import sys
import time
import warnings
from pathlib import Path
from typing import Any

import lightning as L
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from torch.utils.data import DataLoader, TensorDataset

from asyncckpt.integrations.lightning import AsyncckptCheckpointIO

BATCHES_PER_EPOCH = 4


class Tiny(L.LightningModule):
    def __init__(self, cfg: argparse.Namespace, pace_s: float = 0.0, losses: str | None = None) -> None:
        super().__init__()
        self.save_hyperparameters(cfg)
        self.net = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))
        self.pace_s = pace_s
        self.losses_file = losses
        self.losses: list[tuple[int, float]] = []

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        loss = torch.nn.functional.mse_loss(self.net(x), y)
        self.log("train_loss", loss, on_step=False, on_epoch=True, sync_dist=True)
        self.losses.append((self.global_step, loss.item()))
        if self.losses_file is not None and self.global_rank == 0:
            with open(self.losses_file, "a") as f:
                f.write(f"{self.global_step} {loss.item()!r}\n")
        if self.pace_s:
            time.sleep(self.pace_s)
        return loss

    def configure_optimizers(self) -> Any:
        opt = torch.optim.AdamW(self.parameters(), lr=self.hparams.lr)
        return {"optimizer": opt, "lr_scheduler": torch.optim.lr_scheduler.StepLR(opt, step_size=3, gamma=0.5)}


def data() -> DataLoader[Any]:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(BATCHES_PER_EPOCH * 8, 8, generator=g)
    y = x.sum(dim=1, keepdim=True) + 0.1 * torch.randn(len(x), 1, generator=g)
    return DataLoader(TensorDataset(x, y), batch_size=8, shuffle=False)


def trainer(
    ckpt_dir: str, epochs: int, top_k: int = 2, plugin: Any = None, devices: int = 1
) -> tuple[L.Trainer, ModelCheckpoint]:
    cb = ModelCheckpoint(dirpath=ckpt_dir, monitor="train_loss", mode="min", save_top_k=top_k, save_last=True)
    t = L.Trainer(
        max_epochs=epochs,
        accelerator="cpu",
        devices=devices,
        strategy="ddp" if devices > 1 else "auto",
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[cb],
        plugins=[plugin if plugin is not None else AsyncckptCheckpointIO()],
        deterministic=True,
    )
    return t, cb


def model(pace_s: float = 0.0, losses: str | None = None) -> Tiny:
    torch.manual_seed(1)
    return Tiny(argparse.Namespace(lr=0.05, width=16, name="tiny"), pace_s, losses)


def main() -> None:
    warnings.simplefilter("ignore")
    ckpt_dir, losses, epochs = sys.argv[1], sys.argv[2], int(sys.argv[3])
    devices = int(sys.argv[4]) if len(sys.argv) > 4 else 1
    torch.set_num_threads(1)  # ranks on a small machine: no OpenMP spinning against each other
    t, _ = trainer(ckpt_dir, epochs, devices=devices)
    m = model(pace_s=0.05, losses=losses)
    t.fit(m, train_dataloaders=data(), ckpt_path="last")
    if t.global_rank == 0:
        if len(sys.argv) > 5:
            torch.save(m.state_dict(), sys.argv[5])
        Path(losses + ".done").touch()


if __name__ == "__main__":
    main()
