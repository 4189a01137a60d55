"""The synthetic, transformer-like state dict every system saves and loads.

Shapes: ``layers`` decoder blocks (q/k/v/o projections, gate/up/down MLP
matrices, four norm vectors), an embedding and an LM head sized so that the
total lands close to the requested byte count. With the defaults (1 GiB,
32 layers) that is 355 bf16 tensors: two ~90 MiB embeddings, 192 matrices of
2-9 MiB, 32 of ~0.6 MiB and 129 vectors of 128 B - 2 KiB. Two non-tensor
values ride along (an int and a small dict), as in a real training state.

Content is deterministic (seeded ``random_`` over the bits), so a load can be
checked bit for bit and no storage layer can win by compressing it.

On a world of N > 1 ranks every tensor is a ``DTensor`` placed ``Shard(0)``
on a CPU device mesh: each rank holds 1/N of the rows of every tensor, the
layout FSDP2 produces, and saves only its own shard. Every dimension is a
multiple of 64, so the shards are equal.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch

DTYPE = torch.bfloat16
ESIZE = 2
HEAD_DIM = 64

NON_TENSOR = {"step": 123456, "trainer": {"name": "bench", "lr": 3e-4, "betas": [0.9, 0.95]}}


@dataclass(frozen=True)
class Spec:
    """Names and full (unsharded) shapes of the state dict's tensors."""

    shapes: tuple[tuple[str, tuple[int, ...]], ...]

    @property
    def nbytes(self) -> int:
        return sum(math.prod(s) for _, s in self.shapes) * ESIZE

    @property
    def count(self) -> int:
        return len(self.shapes)


def _round64(x: float) -> int:
    return max(64, int(x) // 64 * 64)


def make_spec(total_bytes: int, layers: int = 32) -> Spec:
    """A transformer-like set of shapes whose bytes come close to ``total_bytes``."""
    params = total_bytes // ESIZE
    # Per layer ~11.5 d^2 (4 attention + 3 MLP matrices with kv = d/4, ffn = 3d),
    # plus ~16 d^2 for the embedding and LM head together.
    d = _round64(math.sqrt(params / (11.5 * layers + 16)))
    kv = _round64(d / 4)
    ffn = _round64(3 * d)
    per_layer = [
        ("self_attn.q_proj.weight", (d, d)),
        ("self_attn.k_proj.weight", (kv, d)),
        ("self_attn.v_proj.weight", (kv, d)),
        ("self_attn.o_proj.weight", (d, d)),
        ("self_attn.q_norm.weight", (HEAD_DIM,)),
        ("self_attn.k_norm.weight", (HEAD_DIM,)),
        ("mlp.gate_proj.weight", (ffn, d)),
        ("mlp.up_proj.weight", (ffn, d)),
        ("mlp.down_proj.weight", (d, ffn)),
        ("input_layernorm.weight", (d,)),
        ("post_attention_layernorm.weight", (d,)),
    ]
    layer_params = sum(math.prod(s) for _, s in per_layer)
    vocab = _round64((params - layers * layer_params - d) / (2 * d))
    shapes: list[tuple[str, tuple[int, ...]]] = [("model.embed_tokens.weight", (vocab, d))]
    for i in range(layers):
        shapes.extend((f"model.layers.{i}.{name}", shape) for name, shape in per_layer)
    shapes.append(("model.norm.weight", (d,)))
    shapes.append(("lm_head.weight", (vocab, d)))
    return Spec(tuple(shapes))


def _fill(tensor: torch.Tensor, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    tensor.view(torch.int16).random_(generator=gen)
    return tensor


def _local_shape(shape: tuple[int, ...], world: int) -> tuple[int, ...]:
    if world == 1:
        return shape
    if shape[0] % world:
        raise ValueError(f"dim 0 of {shape} does not divide by {world} ranks")
    return (shape[0] // world, *shape[1:])


def _wrap(local: torch.Tensor, shape: tuple[int, ...], mesh: Any) -> Any:
    if mesh is None:
        return local
    from torch.distributed.tensor import DTensor, Shard

    stride = tuple(math.prod(shape[i + 1 :]) for i in range(len(shape)))
    return DTensor.from_local(
        local, mesh, [Shard(0)], run_check=False, shape=torch.Size(shape), stride=stride
    )


def build_state(spec: Spec, rank: int, world: int, mesh: Any = None, fill: bool = True) -> dict[str, Any]:
    """This rank's state dict: filled source tensors, or zeroed destinations."""
    state: dict[str, Any] = {}
    for idx, (name, shape) in enumerate(spec.shapes):
        local = torch.empty(_local_shape(shape, world), dtype=DTYPE)
        if fill:
            _fill(local, seed=idx * 1009 + rank)
        else:
            local.zero_()
        state[name] = _wrap(local, shape, mesh)
    if fill:
        state.update(_copy_nontensor(NON_TENSOR))
    else:
        state.update({"step": -1, "trainer": {"name": "", "lr": 0.0, "betas": [0.0, 0.0]}})
    return state


def _copy_nontensor(value: Any) -> Any:
    import copy

    return copy.deepcopy(value)


def local_tensor(value: Any) -> torch.Tensor:
    return value.to_local() if hasattr(value, "to_local") else value


def local_nbytes(state: dict[str, Any]) -> int:
    return sum(
        local_tensor(v).numel() * local_tensor(v).element_size()
        for v in state.values()
        if isinstance(v, torch.Tensor)
    )


def reset_dest(dest: dict[str, Any]) -> None:
    """Zero the destination tensors and non-tensor values before a load."""
    for value in dest.values():
        if isinstance(value, torch.Tensor):
            local_tensor(value).zero_()
    dest["step"] = -1
    dest["trainer"] = {"name": "", "lr": 0.0, "betas": [0.0, 0.0]}


def verify(source: dict[str, Any], dest: dict[str, Any]) -> None:
    """Raise unless ``dest`` holds exactly ``source``'s bits."""
    for key, value in source.items():
        if isinstance(value, torch.Tensor):
            a = local_tensor(value).view(torch.int16)
            b = local_tensor(dest[key]).view(torch.int16)
            if a.shape != b.shape or not torch.equal(a, b):
                raise AssertionError(f"loaded tensor {key!r} differs from the saved one")
        elif dest.get(key) != value:
            raise AssertionError(f"loaded value {key!r} = {dest.get(key)!r}, saved {value!r}")
