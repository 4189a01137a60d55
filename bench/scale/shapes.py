"""Llama-style model shapes for the scale simulator (``python -m bench.scale``).

A :class:`ModelShape` lists a model's parameters in the order an
``nn.Module`` registers them (``tok_embeddings``, each layer's ``attention``
``wq/wk/wv/wo``, ``feed_forward`` ``w1/w2/w3``, ``attention_norm``,
``ffn_norm``, then ``norm`` and ``output``), with their real shapes and the
dimension tensor parallelism splits (column-parallel layers on dim 0,
row-parallel ones on dim 1, norms replicated), as torchtitan parallelizes a
Llama model. The 8B/70B/405B entries are Meta's Llama 3 configurations;
``tiny`` is small enough for a real gloo world in the tests and splits
unevenly (3 vocabulary rows leave ranks without a row at 4 ranks).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

__all__ = ["Param", "ModelShape", "MODELS", "OPTIMIZER_STATES"]

#: Adam's per-parameter state tensors (``step`` is a scalar, saved apart).
OPTIMIZER_STATES = ("exp_avg", "exp_avg_sq")


@dataclass(frozen=True)
class Param:
    """One parameter of a model.

    Attributes:
        fqn: Its key in ``model.state_dict()`` (``layers.0.attention.wq.weight``).
        shape: Its global shape.
        tp_dim: The dimension tensor parallelism shards (``0``: column-parallel,
            ``1``: row-parallel), or ``None`` when it is replicated over TP.
    """

    fqn: str
    shape: tuple[int, ...]
    tp_dim: int | None


@dataclass(frozen=True)
class ModelShape:
    """A Llama-style decoder's sizes and the dtypes its state is saved in.

    Attributes:
        name: Short name (``8B``).
        vocab: Vocabulary size.
        dim: Model width.
        layers: Decoder layers.
        heads: Attention heads.
        kv_heads: Key/value heads (grouped-query attention).
        ffn: Hidden width of the feed-forward block.
        param_dtype: dtype of the saved model parameters.
        state_dtype: dtype of Adam's ``exp_avg`` / ``exp_avg_sq``.
    """

    name: str
    vocab: int
    dim: int
    layers: int
    heads: int
    kv_heads: int
    ffn: int
    param_dtype: torch.dtype = torch.bfloat16
    state_dtype: torch.dtype = torch.float32

    @property
    def head_dim(self) -> int:
        return self.dim // self.heads

    def params(self) -> tuple[Param, ...]:
        """Every parameter, in module registration order."""
        dim, kv = self.dim, self.kv_heads * self.head_dim
        per_layer = (
            ("attention.wq.weight", (self.heads * self.head_dim, dim), 0),
            ("attention.wk.weight", (kv, dim), 0),
            ("attention.wv.weight", (kv, dim), 0),
            ("attention.wo.weight", (dim, self.heads * self.head_dim), 1),
            ("feed_forward.w1.weight", (self.ffn, dim), 0),
            ("feed_forward.w2.weight", (dim, self.ffn), 1),
            ("feed_forward.w3.weight", (self.ffn, dim), 0),
            ("attention_norm.weight", (dim,), None),
            ("ffn_norm.weight", (dim,), None),
        )
        params = [Param("tok_embeddings.weight", (self.vocab, dim), 0)]
        for layer in range(self.layers):
            params += [Param(f"layers.{layer}.{name}", shape, tp) for name, shape, tp in per_layer]
        params += [Param("norm.weight", (dim,), None), Param("output.weight", (self.vocab, dim), 0)]
        return tuple(params)

    def numel(self) -> int:
        """Elements of all parameters."""
        total = 0
        for param in self.params():
            n = 1
            for s in param.shape:
                n *= s
            total += n
        return total


MODELS: dict[str, ModelShape] = {
    "8B": ModelShape("8B", vocab=128256, dim=4096, layers=32, heads=32, kv_heads=8, ffn=14336),
    "70B": ModelShape("70B", vocab=128256, dim=8192, layers=80, heads=64, kv_heads=8, ffn=28672),
    "405B": ModelShape("405B", vocab=128256, dim=16384, layers=126, heads=128, kv_heads=8, ffn=53248),
    # For real gloo worlds in the tests: uneven splits at 2 and 4 ranks, and
    # ranks without vocabulary rows (3 rows over 4 ranks, or 2 TP x 2 DP);
    # fp32 throughout, as an FSDP2 model trained in mixed precision keeps it.
    "tiny": ModelShape("tiny", vocab=3, dim=8, layers=2, heads=2, kv_heads=1, ffn=12,
                       param_dtype=torch.float32),
}
