"""The load planner of the partial-checkpoint layout.

:class:`LayoutLoadPlanner` is DCP's default load planner, which works from
the checkpoint's metadata and so handles a changed partition, with two
changes: non-tensor values are unpickled with ``weights_only=True`` (a
checkpoint cannot run code on load), and ``strict=False`` tolerates keys the
checkpoint lacks.
"""

from __future__ import annotations

import io
import logging
from collections.abc import Collection, Sequence
from typing import Any

import torch
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    MetadataIndex,
)
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan, ReadItem
from torch.distributed.checkpoint.planner_helpers import (
    create_read_items_for_chunk_list,
)
from torch.distributed.tensor import DTensor

from .._runtime import (
    FLATTEN_MAPPING,
    _create_chunk_list,
    _create_read_items,
    set_element,
)
from ..errors import CheckpointCorruptError, CheckpointKeyError, ReshardError
from ..layout import MeshInfo, Partition
from ..metadata.chunk_columns import ChunkColumns
from ._tensor_reads import match_chunk, read_items_for_columns

__all__ = ["LayoutLoadPlanner"]

log = logging.getLogger("dcp_ext.planners")


class LayoutLoadPlanner(DefaultLoadPlanner):
    """DCP's default load planner with clear errors, selective loads, safe
    non-tensor values and SageMaker's same-partition fast path.

    Every rank constructs one. Planning (``create_local_plan``) first checks
    each requested key against the checkpoint and raises, naming the key and
    both shapes or dtypes:

    * :class:`~dcp_ext.errors.CheckpointKeyError` for keys the checkpoint lacks
      (with ``strict``), and for keys the checkpoint holds in the loaded
      namespaces that the state dict does not take (with ``strict``; always
      listed in :attr:`unexpected_keys`);
    * :class:`~dcp_ext.errors.ReshardError` for a different global shape, a
      different dtype (unless ``allow_dtype_cast``), a tensor/non-tensor
      mismatch, or a destination shard the saved chunks do not cover.

    Resharding itself is DCP's overlap computation: on version-3 metadata,
    whose chunks are columns (:class:`~dcp_ext.metadata.chunk_columns.ChunkColumns`),
    done with numpy by :func:`dcp_ext.planning._tensor_reads.read_items_for_columns`
    (the same read items as DCP's, without a Python object per saved chunk);
    otherwise DCP's own sweep over the chunk objects. When ``partition``
    shows the checkpoint was saved by the same world size and mesh, each
    tensor whose local shard equals a saved chunk is read from that chunk
    directly, with no overlap computation (SageMaker's ``same_partition_load``).

    Non-tensor values are unpickled with ``weights_only=True``: a checkpoint
    cannot run code on load.

    Args:
        strict: Refuse missing and unexpected keys (the default).
        keys: Load only these flattened keys (or key prefixes ending in
            ``.``), e.g. ``{"model."}``; everything else keeps its value.
        allow_dtype_cast: Load a tensor saved in another dtype by casting it.
        partition: The checkpoint's partition record (``partition.json``).
        world_size: This load's world size (for the same-partition check).
        mesh: This load's mesh (for the same-partition check).
        optional_prefixes: Key prefixes (ending in ``.``) whose keys may be
            absent together: when the checkpoint holds no key under one, its
            requested keys are skipped without error and the prefix is listed
            in :attr:`absent_prefixes`. The manager passes one per parameter's
            optimizer state, which does not exist for a parameter that never
            had a gradient (frozen, or unused by the loss) when it saved.

    Attributes:
        unexpected_keys: Checkpoint keys in the loaded namespaces that the
            state dict does not take (after ``create_local_plan``).
        missing_keys: Requested keys the checkpoint lacks (``strict=False``).
        fast_path_keys: How many tensors took the same-partition fast path.
        absent_prefixes: The ``optional_prefixes`` with no key in the checkpoint.
    """

    def __init__(
        self,
        strict: bool = True,
        *,
        keys: Collection[str] | None = None,
        allow_dtype_cast: bool = False,
        partition: Partition | None = None,
        world_size: int | None = None,
        mesh: MeshInfo | None = None,
        optional_prefixes: Collection[str] = (),
    ) -> None:
        super().__init__(allow_partial_load=not strict)
        self.strict = strict
        self.keys = None if keys is None else tuple(keys)
        self._exact = frozenset(k for k in self.keys or () if not k.endswith("."))
        self._prefixes = tuple(k for k in self.keys or () if k.endswith("."))
        self.allow_dtype_cast = allow_dtype_cast
        self.partition = partition
        self.world_size = world_size
        self.mesh = mesh
        self.unexpected_keys: tuple[str, ...] = ()
        self.missing_keys: tuple[str, ...] = ()
        self.fast_path_keys = 0
        self.optional_prefixes = tuple(optional_prefixes)
        self.absent_prefixes: tuple[str, ...] = ()

    def _selected(self, fqn: str) -> bool:
        if self.keys is None:
            return True
        return fqn in self._exact or (bool(self._prefixes) and fqn.startswith(self._prefixes))

    @property
    def same_partition(self) -> bool:
        """Whether the checkpoint's partition matches this load's."""
        return (
            self.partition is not None
            and self.world_size is not None
            and self.partition.world_size == self.world_size
            and self.partition.mesh == self.mesh
        )

    def create_local_plan(self) -> LoadPlan:
        """(all ranks) Validate the requested keys, then plan their reads."""
        if self.metadata is None:
            raise AssertionError("set_up_planner was not called")
        saved = self.metadata.state_dict_metadata
        where = getattr(self.metadata.storage_meta, "checkpoint_id", None) or "the checkpoint"
        wanted = {k: v for k, v in self.state_dict.items() if self._selected(k)}
        if self.optional_prefixes:
            saved_prefixes = {k[: i + 1] for k in saved for i, c in enumerate(k) if c == "."}
            self.absent_prefixes = tuple(p for p in self.optional_prefixes if p not in saved_prefixes)
            if self.absent_prefixes:
                absent = self.absent_prefixes
                wanted = {k: v for k, v in wanted.items() if not k.startswith(absent)}
        missing = sorted(k for k in wanted if k not in saved)
        if missing and self.strict:
            raise CheckpointKeyError(
                f"{where} lacks {len(missing)} key(s) the state dict asks for: "
                f"{_preview(missing)}.{_namespace_hint(missing, saved)} Pass strict=False to keep their "
                f"current values, or LayoutLoadPlanner(keys=...) to load a subset."
            )
        self.missing_keys = tuple(missing)
        if self.keys is None:
            # An app-state dict ({"model": {...}, "optimizer": {...}}) loads its
            # namespaces only: loading just the model is not an error. A flat
            # dict takes the whole checkpoint.
            top = self.original_state_dict
            namespaced = bool(top) and all(isinstance(v, dict) for v in top.values())
            self.unexpected_keys = tuple(sorted(
                k for k in saved
                if k not in self.state_dict and (not namespaced or k.split(".", 1)[0] in top)
            ))
            if self.unexpected_keys:
                if self.strict:
                    raise CheckpointKeyError(
                        f"{where} holds {len(self.unexpected_keys)} key(s) the state dict does "
                        f"not take: {_preview(list(self.unexpected_keys))}. Pass strict=False to "
                        f"ignore them, or LayoutLoadPlanner(keys=...) to load a subset."
                    )
                log.warning("ignoring checkpoint keys the state dict does not take: %s",
                            _preview(list(self.unexpected_keys)))
        fast = self.same_partition
        requests: list[ReadItem] = []
        for fqn, obj in wanted.items():
            if fqn not in saved:
                continue
            md = saved[fqn]
            if isinstance(obj, DTensor) and obj.device_mesh.get_coordinate() is None:
                continue  # this rank is not in the tensor's mesh
            requests += self._plan_key(fqn, md, obj, fast)
        return LoadPlan(requests)

    def _plan_key(self, fqn: str, md: Any, obj: Any, fast: bool) -> list[ReadItem]:
        is_tensor = isinstance(obj, torch.Tensor)
        if isinstance(md, BytesStorageMetadata):
            if is_tensor:
                raise ReshardError(f"{fqn!r} is a non-tensor value in the checkpoint but a tensor here")
            return _create_read_items(fqn, md, obj)
        if not is_tensor:
            raise ReshardError(
                f"{fqn!r} is a {md.properties.dtype} tensor of shape {tuple(md.size)} in the "
                f"checkpoint but a {type(obj).__name__} here"
            )
        saved_shape, shape = tuple(md.size), tuple(obj.size())
        if saved_shape != shape:
            raise ReshardError(
                f"{fqn!r}: the checkpoint holds global shape {saved_shape} "
                f"({md.properties.dtype}) but the state dict expects {shape} ({obj.dtype}). "
                f"Resharding changes how a tensor is split, never its global shape: the "
                f"model's configuration differs from the one that saved it."
            )
        if md.properties.dtype != obj.dtype and not self.allow_dtype_cast:
            raise ReshardError(
                f"{fqn!r} was saved as {md.properties.dtype} but the state dict holds "
                f"{obj.dtype} (shape {shape}); pass allow_dtype_cast=True to cast on load"
            )
        try:
            local_chunks = _create_chunk_list(obj)
        except Exception as err:
            raise ReshardError(f"cannot load {fqn!r} into a {type(obj).__name__}: {err}") from err
        if fast and len(local_chunks) == 1:
            chunk = local_chunks[0]
            offsets, sizes = tuple(chunk.offsets), tuple(chunk.sizes)
            row = match_chunk(md.chunks, offsets, sizes)
            if row is not None:
                self.fast_path_keys += 1
                if not all(sizes):
                    return []
                return [
                    ReadItem(
                        type=LoadItemType.TENSOR,
                        dest_index=MetadataIndex(fqn, offsets, 0),
                        dest_offsets=torch.Size((0,) * len(offsets)),
                        storage_index=MetadataIndex(fqn, offsets, row),
                        storage_offsets=torch.Size((0,) * len(offsets)),
                        lengths=torch.Size(sizes),
                    )
                ]
        if isinstance(md.chunks, ChunkColumns):
            items = read_items_for_columns(fqn, md.chunks, local_chunks)
        else:
            items = create_read_items_for_chunk_list(fqn, md, local_chunks)
        needed = sum(_volume(c.sizes) for c in local_chunks)
        covered = sum(_volume(item.lengths) for item in items)
        if covered < needed:
            raise ReshardError(
                f"{fqn!r}: the saved chunks cover {covered} of the {needed} elements this rank "
                f"needs (shard offsets {[tuple(c.offsets) for c in local_chunks]}, sizes "
                f"{[tuple(c.sizes) for c in local_chunks]}); the checkpoint cannot fill this "
                f"layout (it is incomplete, or was saved with partial/replicated-sum placements)"
            )
        return items

    def load_bytes(self, read_item: ReadItem, value: io.BytesIO) -> None:
        """Unpickle a non-tensor value with ``weights_only=True``: plain data only."""
        fqn = read_item.dest_index.fqn
        try:
            obj: Any = torch.load(value, weights_only=True)
        except Exception as err:
            raise CheckpointCorruptError(
                f"checkpoint value {fqn!r} is not plain data (loading it would need "
                f"arbitrary unpickling, which dcp_ext refuses): {err}",
                fqn,
            ) from err
        if self.flatten_state_dict:
            mappings: FLATTEN_MAPPING = self.mappings
            set_element(self.original_state_dict, mappings[fqn], obj)
        else:
            self.state_dict[fqn] = obj


def _volume(sizes: Sequence[int]) -> int:
    n = 1
    for s in sizes:
        n *= int(s)
    return n


def _namespace_hint(missing: Sequence[str], saved: Collection[str]) -> str:
    """A hint when whole top-level names are absent, e.g. ``optim.*`` asked, ``optimizer.*`` saved."""
    saved_tops = sorted({k.split(".", 1)[0] for k in saved})
    absent = sorted({k.split(".", 1)[0] for k in missing} - set(saved_tops))
    if not absent:
        return ""
    return (f" The checkpoint has no key under {', '.join(repr(a) for a in absent)} at all; its top-level "
            f"names are {_preview(saved_tops)} (checkpoints saved by CheckpointManager use 'model' and 'optimizer').")


def _preview(keys: list[str], limit: int = 8) -> str:
    shown = ", ".join(repr(k) for k in keys[:limit])
    return f"[{shown}{', ...' if len(keys) > limit else ''}]"
