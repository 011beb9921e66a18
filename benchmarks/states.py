"""The state dicts every method saves: shapes, construction, mutation and checksums.

Two families, both shaped like what ``{"model": model.state_dict(), "optim":
adam.state_dict()}`` produces (fp32 params, Adam ``exp_avg``/``exp_avg_sq``, a 0-d ``step``
tensor per param, ``param_groups`` with plain Python values):

* ``transformer``: an 8-layer block stack plus embedding and final norm, 99 params, so
  396 tensors; the hidden size is picked so the total is as close to the requested size
  as the shapes allow (the embedding's row count absorbs the rest).
* ``small``: the same structure over ``n_tensors`` tensors in total (``n_tensors / 4``
  params of equal size), e.g. 1 GiB over 10,000 tensors of ~107 KB.

All tensors of one state are walked in one deterministic order (:func:`tensors_of`), so
checksums of a saved state and of a restored one line up entry by entry.
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import crc32c
import torch

LAYERS = 8
_UNITS = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}


def parse_size(text: str) -> int:
    """``"256M"`` -> 268435456 (binary units; ``K``, ``M``, ``G``, ``T``, optional ``iB``/``B``)."""
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMGT]?)(?:i?B)?\s*", text, flags=re.IGNORECASE)
    if not m:
        raise ValueError(f"not a size: {text!r} (use e.g. 256M, 1G, 4G)")
    return int(float(m.group(1)) * _UNITS[m.group(2).upper()])


def format_size(n: float) -> str:
    """Bytes as a short binary-unit string: 1073741824 -> ``"1G"``, 1.5 GiB -> ``"1.5G"``."""
    for unit in ("T", "G", "M", "K"):
        scale = _UNITS[unit]
        if n >= scale:
            v = n / scale
            return f"{v:.0f}{unit}" if abs(v - round(v)) < 0.05 else f"{v:.1f}{unit}"
    return f"{int(n)}B"


@dataclass(frozen=True)
class StateSpec:
    """Which state to build: a family, a target size in bytes, a tensor count, a device."""

    kind: str  # "transformer" or "small"
    nbytes: int
    n_tensors: int = 0  # only for "small"
    device: str = "cpu"

    @property
    def name(self) -> str:
        base = f"{self.kind}-{format_size(self.nbytes)}"
        if self.kind == "small":
            count = f"{self.n_tensors // 1000}k" if self.n_tensors % 1000 == 0 else str(self.n_tensors)
            base = f"small{count}-{format_size(self.nbytes)}"
        return base if self.device == "cpu" else f"{base}-{self.device}"

    def to_json(self) -> dict[str, Any]:
        return {"kind": self.kind, "nbytes": self.nbytes, "n_tensors": self.n_tensors, "device": self.device}

    @staticmethod
    def from_json(d: dict[str, Any]) -> StateSpec:
        return StateSpec(d["kind"], int(d["nbytes"]), int(d.get("n_tensors", 0)), d.get("device", "cpu"))


def _transformer_shapes(nbytes: int) -> list[tuple[str, tuple[int, ...]]]:
    """Param names and shapes of a transformer whose fp32 params + 2 Adam moments fill ``nbytes``."""
    params = max(nbytes // 12, 64 * 64)  # 3 fp32 copies of every element (the 0-d steps are noise)

    def block_elems(d: int) -> int:
        return LAYERS * (12 * d * d + 13 * d) + 2 * d

    d = 16
    while block_elems(d + 16) + 4 * (d + 16) ** 2 <= params:
        d += 16
    vocab = max((params - block_elems(d)) // d, 1)
    shapes: list[tuple[str, tuple[int, ...]]] = [("embed.weight", (vocab, d))]
    for i in range(LAYERS):
        p = f"layers.{i}"
        shapes += [
            (f"{p}.ln1.weight", (d,)),
            (f"{p}.ln1.bias", (d,)),
            (f"{p}.attn.qkv.weight", (3 * d, d)),
            (f"{p}.attn.qkv.bias", (3 * d,)),
            (f"{p}.attn.out.weight", (d, d)),
            (f"{p}.attn.out.bias", (d,)),
            (f"{p}.ln2.weight", (d,)),
            (f"{p}.ln2.bias", (d,)),
            (f"{p}.mlp.fc1.weight", (4 * d, d)),
            (f"{p}.mlp.fc1.bias", (4 * d,)),
            (f"{p}.mlp.fc2.weight", (d, 4 * d)),
            (f"{p}.mlp.fc2.bias", (d,)),
        ]
    shapes += [("norm.weight", (d,)), ("norm.bias", (d,))]
    return shapes


def _small_shapes(nbytes: int, n_tensors: int) -> list[tuple[str, tuple[int, ...]]]:
    n_params = max(n_tensors // 4, 1)
    elems = max(nbytes // 12 // n_params, 1)
    cols = 64 if elems >= 64 else 1
    rows = max(elems // cols, 1)
    return [(f"blocks.{i // 100}.p{i % 100}", (rows, cols)) for i in range(n_params)]


def param_shapes(spec: StateSpec) -> list[tuple[str, tuple[int, ...]]]:
    if spec.kind == "transformer":
        return _transformer_shapes(spec.nbytes)
    if spec.kind == "small":
        return _small_shapes(spec.nbytes, spec.n_tensors)
    raise ValueError(f"unknown state kind {spec.kind!r}")


def build_state(spec: StateSpec, seed: int = 0) -> dict[str, Any]:
    """A fresh state dict for ``spec`` with deterministic random contents on ``spec.device``."""
    gen = torch.Generator(device="cpu").manual_seed(seed)
    device = torch.device(spec.device)
    model: dict[str, torch.Tensor] = {}
    optim_state: dict[int, dict[str, torch.Tensor]] = {}

    def rand(shape: tuple[int, ...], scale: float) -> torch.Tensor:
        # uniform_ is several times faster than randn on CPU and the bytes are just as incompressible
        t = torch.empty(shape, dtype=torch.float32).uniform_(-scale, scale, generator=gen)
        return t.to(device) if device.type != "cpu" else t

    for i, (name, shape) in enumerate(param_shapes(spec)):
        model[name] = rand(shape, 0.02)
        optim_state[i] = {
            "step": torch.tensor(float(100 + i), device=device),
            "exp_avg": rand(shape, 1e-3),
            "exp_avg_sq": rand(shape, 1e-6).abs_(),
        }
    group = {
        "lr": 3e-4,
        "betas": (0.9, 0.95),
        "eps": 1e-8,
        "weight_decay": 0.1,
        "amsgrad": False,
        "maximize": False,
        "foreach": None,
        "capturable": False,
        "differentiable": False,
        "fused": None,
        "params": list(range(len(model))),
    }
    return {"model": model, "optim": {"state": optim_state, "param_groups": [group]}, "iteration": 12345}


def tensors_of(state: Any) -> Iterator[torch.Tensor]:
    """Every tensor of ``state`` in a deterministic order (dict insertion order, depth first)."""
    if isinstance(state, torch.Tensor):
        yield state
    elif isinstance(state, dict):
        for v in state.values():
            yield from tensors_of(v)
    elif isinstance(state, (list, tuple)):
        for v in state:
            yield from tensors_of(v)


def state_nbytes(state: Any) -> int:
    return sum(t.numel() * t.element_size() for t in tensors_of(state))


def n_tensors(state: Any) -> int:
    return sum(1 for _ in tensors_of(state))


def byte_view(t: torch.Tensor) -> memoryview:
    """The raw bytes of a contiguous CPU tensor (no copy)."""
    if t.numel() == 0:
        return memoryview(b"")
    return memoryview(t.detach().reshape(-1).view(torch.uint8).numpy()).cast("B")  # type: ignore[arg-type]


def checksums(state: Any) -> list[int]:
    """CRC-32C of every tensor's bytes, in :func:`tensors_of` order (CUDA tensors are copied to host)."""
    out = []
    for t in tensors_of(state):
        host = t.detach().cpu().contiguous() if t.device.type != "cpu" else t.detach().contiguous()
        out.append(int(crc32c.crc32c(byte_view(host))))
    return out


@torch.no_grad()
def mutate(state: Any) -> None:
    """Change every tensor in place (what the next optimizer step would do to the live state)."""
    for t in tensors_of(state):
        if t.dtype == torch.bool:
            t.logical_not_()
        elif t.is_floating_point():
            t.add_(1.0)
        else:
            t.add_(1)


@torch.no_grad()
def copy_into(target: Any, loaded: Any) -> None:
    """Copy ``loaded`` into the preallocated ``target`` (same structure), tensor by tensor."""
    if isinstance(target, torch.Tensor):
        target.copy_(loaded)
    elif isinstance(target, dict):
        for k in target:
            if isinstance(target[k], (torch.Tensor, dict, list, tuple)):
                copy_into(target[k], loaded[k])
            else:
                target[k] = loaded[k]
    elif isinstance(target, (list, tuple)):
        for i, t in enumerate(target):
            if isinstance(t, (torch.Tensor, dict, list, tuple)):
                copy_into(t, loaded[i])
            elif isinstance(target, list):
                target[i] = loaded[i]


def empty_like_state(state: Any) -> Any:
    """A structure-identical state with uninitialized tensors (preallocated restore targets)."""
    if isinstance(state, torch.Tensor):
        return torch.empty_like(state)
    if isinstance(state, dict):
        return {k: empty_like_state(v) for k, v in state.items()}
    if isinstance(state, list):
        return [empty_like_state(v) for v in state]
    if isinstance(state, tuple):
        return tuple(empty_like_state(v) for v in state)
    return state


def describe(state: Any) -> dict[str, Any]:
    ts = list(tensors_of(state))
    sizes = sorted(t.numel() * t.element_size() for t in ts)
    return {
        "nbytes": sum(sizes),
        "n_tensors": len(ts),
        "largest_tensor_bytes": sizes[-1] if sizes else 0,
        "median_tensor_bytes": sizes[len(sizes) // 2] if sizes else 0,
        "mean_tensor_bytes": math.floor(sum(sizes) / len(sizes)) if sizes else 0,
    }
