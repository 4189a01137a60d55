"""Rank functions for tests/test_integrations_megatron.py: Megatron-Core's
``dist_checkpointing`` with dcp_ext's strategies, on a gloo world (CPU).

Two sharded state dicts: one built with ``dist_checkpointing``'s own helpers
(a row-sharded fp32 tensor, a column-sharded bf16 tensor, a replicated
tensor, a ``ShardedObject`` per rank and plain values for ``common.pt``) and
a tiny ``GPTModel``'s ``sharded_state_dict()`` with tensor parallelism
(layers stacked on a prepended axis, ``_extra_state`` objects). Also
:func:`stock_save_on_cpu`, which lets Megatron's own ``torch_dist`` save run
without CUDA (used by bench.frameworks too).
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist

__all__ = ["megatron_suite", "megatron_one_rank", "stock_save_on_cpu", "cuda_calls_stubbed",
           "stop_writer_results_manager", "handmade_state", "plain", "full_tensors", "gpt_model"]


@contextlib.contextmanager
def cuda_calls_stubbed() -> Iterator[None]:
    """Megatron's default ``torch_dist`` save on a CPU-only torch.

    megatron-core 0.16.1 calls ``torch.cuda.synchronize()`` before its writer
    processes copy the tensors (``filesystem_async.preload_tensors``) and
    builds a ``device=torch.cuda.current_device()`` tensor to share
    failures (``state_dict_saver.save_state_dict_async_finalize``); on a CPU
    build both raise "Torch not compiled with CUDA enabled". Inside this block
    the first does nothing and the second answers ``"cpu"`` (psutil must be
    installed: its writer processes import it).
    """
    synchronize, current_device = torch.cuda.synchronize, torch.cuda.current_device
    torch.cuda.synchronize = lambda *args, **kwargs: None  # type: ignore[assignment]
    torch.cuda.current_device = lambda: "cpu"  # type: ignore[assignment, return-value]
    try:
        yield
    finally:
        torch.cuda.synchronize, torch.cuda.current_device = synchronize, current_device


def stop_writer_results_manager() -> None:
    """Shut down the ``spawn`` manager process Megatron's ``torch_dist`` save
    starts once per process for its writers' results (it would outlive a
    rank that leaves with ``os._exit``)."""
    from megatron.core.dist_checkpointing.strategies import filesystem_async

    queue = filesystem_async._results_queue
    if queue is not None:
        filesystem_async._results_queue = None
        queue._manager.shutdown()


@contextlib.contextmanager
def stock_save_on_cpu() -> Iterator[None]:
    """:func:`cuda_calls_stubbed`, then :func:`stop_writer_results_manager`."""
    try:
        with cuda_calls_stubbed():
            yield
    finally:
        stop_writer_results_manager()


def handmade_state(rank: int, world: int, seed: int, column_dtype: torch.dtype = torch.bfloat16) -> dict[str, Any]:
    """A sharded state dict built with Megatron's helpers; the same global
    values for a ``seed`` whatever ``world`` is (``world=1``: whole tensors,
    and both of a 2-rank save's ``ShardedObject`` shards as a list).
    ``column_dtype``: the column-sharded tensor's (the others are float32)."""
    from megatron.core.dist_checkpointing import ShardedObject, ShardedTensor

    g = torch.Generator().manual_seed(seed)
    rows = torch.randn(8, 6, generator=g)
    columns = torch.randn(5, 4, generator=g).to(column_dtype)
    bias = torch.randn(3, generator=g)
    if world == 1:
        objects: Any = [ShardedObject("rng", {"seed": seed + r, "t": torch.arange(3) + r}, (2,), (r,), replica_id=0)
                        for r in range(2)]
    else:
        objects = ShardedObject("rng", {"seed": seed + rank, "t": torch.arange(3) + rank}, (world,), (rank,),
                                replica_id=0)
    return {
        "w": ShardedTensor.from_rank_offsets("layer.w", rows.chunk(world)[rank].clone(), (0, rank, world)),
        "bf": ShardedTensor.from_rank_offsets("layer.bf", columns.chunk(world, dim=1)[rank].contiguous(),
                                              (1, rank, world)),
        "b": ShardedTensor.from_rank_offsets("layer.b", bias, replica_id=rank),  # replicated on every rank
        "obj": objects,
        "common": {"step": seed, "lr": 0.5, "name": f"run{seed}"},
        "iteration": seed,
    }


def plain(value: Any) -> Any:
    """What loading a sharded state dict gives: each ``ShardedTensor`` /
    ``ShardedObject`` replaced by its data (a copy)."""
    from megatron.core.dist_checkpointing import ShardedObject, ShardedTensor

    if isinstance(value, ShardedTensor):
        return value.data.detach().clone()
    if isinstance(value, ShardedObject):
        return value.data
    if isinstance(value, dict):
        return {k: plain(v) for k, v in value.items()}
    if isinstance(value, list):
        return [plain(v) for v in value]
    return value


def gpt_model(tensor_parallel: int, seed: int) -> Any:
    """A 2-layer GPT (hidden 32, 4 heads, vocabulary 128) on CPU, tensor
    parallel over ``tensor_parallel`` ranks (model parallel state set up)."""
    from megatron.core import parallel_state
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer import TransformerConfig

    if not parallel_state.model_parallel_is_initialized():
        parallel_state.initialize_model_parallel(tensor_model_parallel_size=tensor_parallel)
    torch.manual_seed(seed)  # the same everywhere: replicated parameters agree, TP shards split one master
    config = TransformerConfig(num_layers=2, hidden_size=32, num_attention_heads=4, use_cpu_initialization=True,
                               pipeline_dtype=torch.float32, tensor_model_parallel_size=tensor_parallel)
    return GPTModel(config=config, transformer_layer_spec=get_gpt_layer_local_spec(), vocab_size=128,
                    max_sequence_length=16)


def _shards(sharded_state_dict: dict[str, Any]) -> list[tuple[str, torch.Tensor, tuple[int, ...], tuple[int, ...]]]:
    """The main replicas of the ``ShardedTensor`` s of a (flat) model
    sharded state dict: (state dict key, data, offset and shape in the
    model's own tensor, i.e. without prepended axes)."""
    from megatron.core.dist_checkpointing import ShardedTensor
    from megatron.core.dist_checkpointing.mapping import is_main_replica

    found = []
    for key, sh in sharded_state_dict.items():
        if isinstance(sh, ShardedTensor) and is_main_replica(sh.replica_id):
            skip = sh.prepend_axis_num
            found.append((key, sh.data.detach().clone(), tuple(sh.global_offset[skip:]),
                          tuple(sh.global_shape[skip:])))
    return found


def full_tensors(per_rank: list[list[tuple[str, torch.Tensor, tuple[int, ...], tuple[int, ...]]]]) -> dict[
        str, torch.Tensor]:
    """The whole tensors the ranks' :func:`_shards` cover, by state dict key."""
    whole: dict[str, torch.Tensor] = {}
    for shards in per_rank:
        for key, data, offset, shape in shards:
            target = whole.setdefault(key, torch.full(shape, float("nan"), dtype=data.dtype))
            target[tuple(slice(o, o + n) for o, n in zip(offset, data.shape))] = data
    return whole


def _error(fn: Any) -> tuple[str, str]:
    """The type and message of the error ``fn()`` raises, unwrapped from DCP's ``CheckpointException``."""
    from dcp_ext.errors import unwrap_checkpoint_exception

    try:
        fn()
    except BaseException as exc:  # DCP's CheckpointException derives from BaseException
        inner = unwrap_checkpoint_exception(exc)
        return type(inner).__name__, str(inner)
    return "no error", ""


def megatron_suite(rank: int, world: int, local_root: str, s3_root: str,
                   storage_options: dict[str, Any]) -> dict[str, Any]:
    """Every 2-rank check (see the test's docstring); differences as lists of paths."""
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing import ShardedTensor
    from megatron.core.dist_checkpointing.strategies.torch import TorchDistLoadShardedStrategy
    from megatron.core.dist_checkpointing.validation import StrictHandling

    from dcp_ext.integrations import megatron as dcp_megatron
    from dcp_ext.storage import Location
    from tests.support.compare import state_diff

    ours, ours_load = dcp_megatron.DcpExtSaveShardedStrategy, dcp_megatron.DcpExtLoadShardedStrategy
    saved = handmade_state(rank, world, seed=1)
    expected = plain(saved)

    def template() -> dict[str, Any]:
        return handmade_state(rank, world, seed=2)  # other values: a load must replace all of them

    def diff(got: Any) -> list[str]:
        return state_diff(expected, got)

    out: dict[str, Any] = {}
    paths = {name: os.path.join(local_root, name)
             for name in ("ours", "stock", "zstd", "async", "gpt", "fp", "cache1", "cache2", "cache_fp16", "cache_shape",
                          "replicas")}
    if rank == 0:
        for path in paths.values():  # Megatron's save lists the directory first (rank 0): it must exist
            os.makedirs(path)
    dist.barrier()
    # dcp_ext's strategy through Megatron's entry points, read by Megatron's own loader and by ours.
    dist_checkpointing.save(handmade_state(rank, world, 1), paths["ours"], sharded_strategy=ours())
    out["ours_by_megatron"] = diff(dist_checkpointing.load(template(), paths["ours"]))
    out["ours_by_ours"] = diff(dist_checkpointing.load(template(), paths["ours"], sharded_strategy=ours_load()))
    # Plan caching (on by default): one strategy saves the same state twice, the second save reuses the
    # first's global plan (on the coordinator); the same keys and shapes with the bf16 tensor in float16
    # (the same bytes per element, sizes and chunks: only the dtype differs, what issue 40's caching reused
    # wrongly) and then other shapes plan afresh and load bit-exact, by Megatron's loader and by ours.
    cached = ours()
    for name in ("cache1", "cache2"):
        dist_checkpointing.save(handmade_state(rank, world, 1), paths[name], sharded_strategy=cached)
        out[f"{name}_reused"] = cached.last_planner.reused_global_plan
        out[f"{name}_by_megatron"] = diff(dist_checkpointing.load(template(), paths[name]))
    half = torch.float16
    dist_checkpointing.save(handmade_state(rank, world, 4, half), paths["cache_fp16"], sharded_strategy=cached)
    out["cache_fp16_reused"] = cached.last_planner.reused_global_plan
    half_saved = plain(handmade_state(rank, world, 4, half))
    out["cache_fp16_by_megatron"] = state_diff(
        half_saved, dist_checkpointing.load(handmade_state(rank, world, 2, half), paths["cache_fp16"]))
    out["cache_fp16_by_ours"] = state_diff(half_saved, dist_checkpointing.load(
        handmade_state(rank, world, 2, half), paths["cache_fp16"], sharded_strategy=ours_load()))
    out["cache_fp16_dtypes"] = sorted(
        (key, str(sh.dtype)) for key, sh in dist_checkpointing.load_tensors_metadata(paths["cache_fp16"]).items())
    narrow = handmade_state(rank, world, 5)
    narrow["w"] = ShardedTensor.from_rank_offsets("layer.w", torch.randn(3, 6), (0, rank, world))
    dist_checkpointing.save(narrow, paths["cache_shape"], sharded_strategy=cached)
    out["cache_shape_reused"] = cached.last_planner.reused_global_plan
    narrow_template = handmade_state(rank, world, 2)
    narrow_template["w"] = ShardedTensor.from_rank_offsets("layer.w", torch.zeros(3, 6), (0, rank, world))
    out["cache_shape_by_megatron"] = state_diff(plain(narrow), dist_checkpointing.load(narrow_template,
                                                                                       paths["cache_shape"]))
    # keep_only_main_replica=False: every rank's copy of the replicated tensor is in the plans, and
    # dcp_ext's planner saves it once (one chunk recorded); read back by Megatron's loader.
    # (Saved with io_options={"key_prefixes": 4}: its data files go under key prefixes.)
    dist_checkpointing.save(handmade_state(rank, world, 1), paths["replicas"],
                            sharded_strategy=ours(keep_only_main_replica=False, io_options={"key_prefixes": 4}))
    out["replicas_by_megatron"] = diff(dist_checkpointing.load(template(), paths["replicas"]))
    stored = ours_load()._reader(paths["replicas"]).read_metadata().state_dict_metadata
    out["replicas_chunks"] = {key: len(stored[key].chunks) for key in ("layer.w", "layer.bf", "layer.b")}
    # Megatron's FullyParallelSaveStrategyWrapper around ours: the ranks share out the replicated
    # tensor's save (main replicas distributed by size); read by Megatron's default loader and by ours.
    # (Its load wrapper is not exercised: megatron-core 0.16.1's exchange_utils allocates the exchanged
    # tensors on "cuda".)
    from megatron.core.dist_checkpointing.strategies.fully_parallel import FullyParallelSaveStrategyWrapper

    dist_checkpointing.save(handmade_state(rank, world, 1), paths["fp"],
                            sharded_strategy=FullyParallelSaveStrategyWrapper(ours()))
    out["fp_by_megatron"] = diff(dist_checkpointing.load(template(), paths["fp"]))
    out["fp_by_ours"] = diff(dist_checkpointing.load(template(), paths["fp"], sharded_strategy=ours_load()))
    # Megatron's own torch_dist save (CUDA calls stubbed), read by ours: through Megatron's load and ours.
    with stock_save_on_cpu():
        dist_checkpointing.save(handmade_state(rank, world, 1), paths["stock"])
    out["stock_by_ours"] = diff(dist_checkpointing.load(template(), paths["stock"], sharded_strategy=ours_load()))
    out["stock_by_our_load"] = diff(dcp_megatron.load(template(), paths["stock"]))
    # Compressed: backend ("dcp_ext", 1), found by Megatron's default loader; refused by its torch_dist strategy.
    dist_checkpointing.save(handmade_state(rank, world, 1), paths["zstd"], sharded_strategy=ours(compression="zstd"))
    out["zstd_by_default"] = diff(dist_checkpointing.load(template(), paths["zstd"]))
    # Megatron's torch_dist strategy reads torch's .metadata of a compressed checkpoint: dcp_ext's marker,
    # whose unpickling raises NeedsCheckpointReaderError. Its metadata reads let the error through as it is;
    # its load reaches it inside dcp.load, which (torch 2.13) re-raises a failed metadata read as an
    # AssertionError quoting the message.
    stock_load = TorchDistLoadShardedStrategy
    out["zstd_by_torch_dist"] = _error(lambda: dist_checkpointing.load(
        template(), paths["zstd"], sharded_strategy=stock_load()))
    out["zstd_by_torch_dist_strict"] = _error(lambda: dist_checkpointing.load(
        template(), paths["zstd"], sharded_strategy=stock_load(), strict=StrictHandling.RAISE_ALL))
    out["zstd_tensors_by_torch_dist"] = _error(lambda: dist_checkpointing.load_tensors_metadata(
        paths["zstd"], stock_load()))
    out["zstd_strict"] = dist_checkpointing.load(template(), paths["zstd"], strict=StrictHandling.RETURN_ALL)[1:]
    # Megatron's async_sharded_save=True: our strategy saves at once; the request runs Megatron's finalizers.
    request = dist_checkpointing.save(handmade_state(rank, world, 1), paths["async"], sharded_strategy=ours(),
                                      async_sharded_save=True)
    out["async_left_to_run"] = request.async_fn is not None
    request.execute_sync()  # a trainer's async queue would run it later: metadata.json is written then
    out["async"] = diff(dist_checkpointing.load(template(), paths["async"]))

    # S3 (SeaweedFS) through dcp_ext's save/load: zstd, replaced by another save, refused without overwrite.
    opts = storage_options
    s3_zstd, s3_plain = f"{s3_root}/zstd", f"{s3_root}/plain"
    dcp_megatron.save(handmade_state(rank, world, 1), s3_zstd, compression="zstd", storage_options=opts)
    out["s3_zstd"] = diff(dcp_megatron.load(template(), s3_zstd, storage_options=opts))
    dcp_megatron.save(handmade_state(rank, world, 3), s3_zstd, compression="zstd", storage_options=opts)
    out["s3_replaced"] = state_diff(plain(handmade_state(rank, world, 3)),
                                    dcp_megatron.load(template(), s3_zstd, storage_options=opts))
    out["s3_no_overwrite"], _ = _error(lambda: dcp_megatron.save(handmade_state(rank, world, 1), s3_zstd,
                                                              overwrite=False, storage_options=opts))
    out["s3_kept"] = state_diff(plain(handmade_state(rank, world, 3)),
                                dcp_megatron.load(template(), s3_zstd, storage_options=opts))
    dcp_megatron.save(handmade_state(rank, world, 1), s3_plain, content_metadata={"format": 7},
                      storage_options=opts)
    out["s3_plain"] = state_diff({**expected, "content_metadata": {"format": 7}},
                                 dcp_megatron.load(template(), s3_plain, storage_options=opts))
    out["s3_common"] = dcp_megatron.load_common_state_dict(s3_plain, opts)

    # A tiny GPT, tensor parallel over both ranks: Megatron's save with our strategy, its default load;
    # S3 zstd through ours. The fresh model (another seed) must come back as saved.
    model = gpt_model(world, seed=0)
    gpt_saved = plain(model.sharded_state_dict())
    out["gpt_shards"] = _shards(model.sharded_state_dict())
    dist_checkpointing.save(model.sharded_state_dict(), paths["gpt"], sharded_strategy=ours())
    fresh = gpt_model(world, seed=1)
    out["gpt_fresh_differs"] = bool(state_diff(gpt_saved, plain(fresh.sharded_state_dict())))
    out["gpt_by_megatron"] = state_diff(gpt_saved, dist_checkpointing.load(fresh.sharded_state_dict(), paths["gpt"]))
    dcp_megatron.save(model.sharded_state_dict(), f"{s3_root}/gpt", compression="zstd", storage_options=opts)
    loaded = dcp_megatron.load(fresh.sharded_state_dict(), f"{s3_root}/gpt", storage_options=opts)
    out["gpt_s3_zstd"] = state_diff(gpt_saved, loaded)
    fresh.load_state_dict(loaded)  # what a trainer does with it
    out["gpt_applied"] = state_diff(gpt_saved, plain(fresh.sharded_state_dict()))
    dist.barrier()
    if rank == 0:
        out["files"] = {name: sorted(os.listdir(path)) for name, path in paths.items()}
        out["configs"] = {name: open(os.path.join(path, "metadata.json")).read() for name, path in paths.items()}
        out["s3_files"] = sorted(Location.of(s3_zstd, opts).open().list_names())
        out["s3_config"] = Location.of(s3_zstd, opts).open().read_file("metadata.json").decode()
    return out


def megatron_one_rank(rank: int, world: int, local_root: str, s3_root: str, storage_options: dict[str, Any],
                      gpt_shards: list[Any]) -> dict[str, Any]:
    """(1 rank) Load the 2-rank checkpoints whole: the handmade state (local,
    Megatron's default loader; S3 zstd, ours) and the GPT into a model without
    tensor parallelism, compared with the whole tensors the 2 ranks saved
    (``gpt_shards``: each rank's :func:`_shards`)."""
    from megatron.core import dist_checkpointing

    from dcp_ext.integrations import megatron as dcp_megatron
    from tests.support.compare import state_diff

    local = dist_checkpointing.load(handmade_state(0, 1, seed=2), os.path.join(local_root, "ours"))
    s3_zstd = dcp_megatron.load(handmade_state(0, 1, seed=2), f"{s3_root}/zstd", storage_options=storage_options)
    model = gpt_model(1, seed=1)
    whole = full_tensors(gpt_shards)
    loaded = dist_checkpointing.load(model.sharded_state_dict(), os.path.join(local_root, "gpt"))
    return {
        "local": state_diff(plain(handmade_state(0, 1, seed=1)), local),
        "s3_zstd": state_diff(plain(handmade_state(0, 1, seed=3)), s3_zstd),  # the save that replaced seed 1's
        "gpt": state_diff(whole, {key: loaded[key] for key in whole}),
        "gpt_keys": len(whole),
    }
