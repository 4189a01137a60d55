"""The scale simulator (``python -m bench.scale``): its synthesized plans against real worlds.

The simulator builds every rank's save plan and write results from a model
shape instead of tensors. Here they are compared item by item with what real
2- and 4-rank gloo worlds produce for the same (tiny) Llama shape: FSDP2 with
uneven and empty shards, and FSDP2 x TP on a 2 x 2 mesh; and the simulator's
CLI runs both systems end to end, and reports cases that run out of time or
memory instead of failing.
"""

from __future__ import annotations

import itertools
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn
from torch.distributed.checkpoint.metadata import TensorStorageMetadata
from torch.distributed.tensor import Shard
from torch.distributed.tensor._utils import _compute_local_shape_and_global_offset
from torch.distributed.tensor.placement_types import _StridedShard

from bench.scale import adapter, simulator
from bench.scale.adapter import finish_data_file, pack_rank_results
from bench.scale.cases import Case
from bench.scale.fast import packed_results, sent_plans
from bench.scale.plans import (
    Layout,
    dcp_ext_write_results,
    finish_plans,
    iter_final_plans,
    local_chunk,
    rank_save_plan,
    rank_sent_plan,
    save_plans,
)
from bench.scale.report import render_table
from bench.scale.shapes import MODELS, ModelShape, Param
from dcp_ext.layout import MeshInfo
from dcp_ext import CheckpointReader
from dcp_ext.metadata import METADATA_FILE
from dcp_ext.planning._plan_columns import compact_plan
from dcp_ext.planners import LayoutSavePlanner
from tests.support.dist import run_world

TINY = MODELS["tiny"]
LR = 3e-4  # bench.scale.plans synthesizes Adam(lr=3e-4): equal param groups pickle to equal bytes


# -- the real worlds (rank code) ---------------------------------------------------------


class _Attention(nn.Module):
    def __init__(self, shape: ModelShape) -> None:
        super().__init__()
        q, kv = shape.heads * shape.head_dim, shape.kv_heads * shape.head_dim
        self.wq, self.wk = nn.Linear(shape.dim, q, bias=False), nn.Linear(shape.dim, kv, bias=False)
        self.wv, self.wo = nn.Linear(shape.dim, kv, bias=False), nn.Linear(q, shape.dim, bias=False)


class _FeedForward(nn.Module):
    def __init__(self, shape: ModelShape) -> None:
        super().__init__()
        self.w1 = nn.Linear(shape.dim, shape.ffn, bias=False)
        self.w2 = nn.Linear(shape.ffn, shape.dim, bias=False)
        self.w3 = nn.Linear(shape.dim, shape.ffn, bias=False)


class _Norm(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))


class _Block(nn.Module):
    def __init__(self, shape: ModelShape) -> None:
        super().__init__()
        self.attention, self.feed_forward = _Attention(shape), _FeedForward(shape)
        self.attention_norm, self.ffn_norm = _Norm(shape.dim), _Norm(shape.dim)


class Llama(nn.Module):
    """A Llama-style module with torchtitan's parameter names."""

    def __init__(self, shape: ModelShape) -> None:
        super().__init__()
        self.tok_embeddings = nn.Embedding(shape.vocab, shape.dim)
        self.layers = nn.ModuleList(_Block(shape) for _ in range(shape.layers))
        self.norm = _Norm(shape.dim)
        self.output = nn.Linear(shape.dim, shape.vocab, bias=False)


def _parallelize(model: Llama, world_size: int, tp: int) -> Any:
    """FSDP2 over all ranks, or TP (torchtitan's plan) x FSDP2 on a (dp, tp) mesh."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    if tp == 1:
        mesh = init_device_mesh("cpu", (world_size,))
        dp_mesh = mesh
    else:
        mesh = init_device_mesh("cpu", (world_size // tp, tp), mesh_dim_names=("dp", "tp"))
        plan: dict[str, Any] = {"tok_embeddings": RowwiseParallel(input_layouts=Replicate()),
                                "output": ColwiseParallel()}
        for i in range(len(model.layers)):
            for name in ("attention.wq", "attention.wk", "attention.wv", "feed_forward.w1", "feed_forward.w3"):
                plan[f"layers.{i}.{name}"] = ColwiseParallel()
            for name in ("attention.wo", "feed_forward.w2"):
                plan[f"layers.{i}.{name}"] = RowwiseParallel()
        parallelize_module(model, mesh["tp"], plan)
        dp_mesh = mesh["dp"]
    for layer in model.layers:
        fully_shard(layer, mesh=dp_mesh)
    fully_shard(model, mesh=dp_mesh)
    return mesh


def world_plans(rank: int, world_size: int, root: str, tps: list[int]) -> dict[int, Any]:
    """(each rank) Per TP degree: the local plan of LayoutSavePlanner for an FSDP2
    model + Adam state dict, after a real dcp_ext save of it to ``root/tp{tp}``."""
    from torch.distributed.checkpoint.state_dict import get_state_dict

    from dcp_ext import CheckpointManager

    plans = {}
    for tp in tps:
        torch.manual_seed(0)
        model = Llama(TINY)
        mesh = _parallelize(model, world_size, tp)
        optim = torch.optim.Adam(model.parameters(), lr=LR)
        for p in model.parameters():
            p.grad = torch.zeros_like(p)
        optim.step()  # Adam's state exists for every parameter
        msd, osd = get_state_dict(model, optim)
        mesh_info = MeshInfo.from_device_mesh(mesh) if tp > 1 else None
        planner = LayoutSavePlanner(mesh_info, None)
        planner.set_up_planner({"model": msd, "optimizer": osd}, None, rank == 0)
        sent = planner.create_local_plan()  # what travels to the coordinator
        plans[tp] = (planner.plan, sent)
        CheckpointManager(f"{root}/tp{tp}", mesh=mesh if tp > 1 else None).save("s", model, optim)
    return plans


@pytest.fixture(scope="module")
def worlds(tmp_path_factory: pytest.TempPathFactory) -> dict[tuple[int, int], tuple[list[Any], Path]]:
    """(world size, tp) -> (every rank's real local plan, as it keeps it and as
    it sends it to the coordinator, and the real checkpoint).

    The two worlds run at the same time: their ranks spend most of their
    time importing torch and waiting in gloo, which overlaps well.
    """
    specs = {2: [1], 4: [1, 2]}
    roots = {n: tmp_path_factory.mktemp(f"world{n}") for n in specs}
    with ThreadPoolExecutor(len(specs)) as pool:
        futures = {n: pool.submit(run_world, n, world_plans, str(roots[n]), tps) for n, tps in specs.items()}
        per_rank = {n: future.result() for n, future in futures.items()}
    return {
        (n, tp): ([plans[tp] for plans in per_rank[n]], roots[n] / f"tp{tp}" / "s_partial")
        for n, tps in specs.items() for tp in tps
    }


WORLDS = [(2, 1), (4, 1), (4, 2)]


def _simulated_planner(layout: Layout) -> LayoutSavePlanner:
    mesh = None
    if layout.tp > 1:
        mesh = MeshInfo((layout.dp, layout.tp), ("dp", "tp"), tuple(range(layout.ranks)))
    return LayoutSavePlanner(mesh, None)


# -- tests ----------------------------------------------------------------------------------


@pytest.mark.parametrize("world_size,tp", WORLDS)
def test_synthesized_plans_equal_real_local_plans(worlds: Any, world_size: int, tp: int) -> None:
    real, _ = worlds[(world_size, tp)]
    layout = Layout(world_size, tp)
    for rank, (real_plan, real_sent) in enumerate(real):
        synthesized = rank_save_plan(TINY, layout, rank)
        assert real_sent.items == [] and real_sent.planner_data == compact_plan(synthesized), rank
        assert len(synthesized.items) == len(real_plan.items), rank
        for mine, theirs in zip(synthesized.items, real_plan.items):
            assert mine == theirs, (rank, mine, theirs)
        assert list(synthesized.planner_data.items()) == list(real_plan.planner_data.items()), rank
        assert synthesized.storage_data is None and real_plan.storage_data is None
    if world_size == 4:
        # The uneven case is covered: 3 vocabulary rows leave a rank with none.
        embeddings = [next(i for i in p.items if i.index.fqn == "model.tok_embeddings.weight") for p, _ in real]
        assert sorted(i.tensor_data.chunk.sizes[0] for i in embeddings) == [0, 1, 1, 1]


@pytest.mark.parametrize("world_size,tp", WORLDS)
def test_synthesized_write_results_equal_real_checkpoint(worlds: Any, world_size: int, tp: int) -> None:
    _, checkpoint = worlds[(world_size, tp)]
    real = CheckpointReader(str(checkpoint)).read_metadata()  # whatever the metadata format
    layout = Layout(world_size, tp)
    plans = save_plans(TINY, layout)
    planner = _simulated_planner(layout)
    global_plans, metadata = planner.create_global_plan(plans)
    final = finish_plans(lambda: _simulated_planner(layout), plans, global_plans)
    written = dcp_ext_write_results(TINY, final)  # the items as FrameEncoder makes them
    items = {r.index: r.storage_data for rank_results in written.results for r in rank_results}

    assert metadata.state_dict_metadata.keys() == real.state_dict_metadata.keys()
    for fqn, md in real.state_dict_metadata.items():
        mine = metadata.state_dict_metadata[fqn]
        if isinstance(md, TensorStorageMetadata):
            assert (mine.properties.dtype, mine.size) == (md.properties.dtype, md.size), fqn
            assert sorted(map(str, mine.chunks)) == sorted(map(str, md.chunks)), fqn
        else:
            assert type(mine) is type(md), fqn
    assert items.keys() == real.storage_data.keys()
    for index, theirs in real.storage_data.items():
        mine = items[index]
        fields = ("relative_path", "offset", "length", "data_offset", "data_length", "raw_length", "frame_size")
        assert [getattr(mine, f) for f in fields] == [getattr(theirs, f) for f in fields], index
        if theirs.checksums:  # a format that keeps them apart may load them later
            assert len(mine.checksums) == len(theirs.checksums), index
    assert planner.partition is not None
    assert planner.partition.to_json() == (checkpoint / "partition.json").read_bytes()
    # Through the simulator's metadata adapter: the same data files, sizes and frame indexes.
    written = dcp_ext_write_results(TINY, final, adapter.finish_data_file)
    reported = {r.index: r.storage_data for rank_results in written.results for r in rank_results}
    mine = adapter.decode_dcp_ext(adapter.EncodedMetadata(adapter.encode_dcp_ext(metadata, reported, world_size)))
    theirs = adapter.decode_dcp_ext(adapter.EncodedMetadata((checkpoint / METADATA_FILE).read_bytes()))
    assert mine.files == theirs.files
    refs = [{name: (ref.at, ref.length) for name, ref in getattr(d, "frame_indexes", {}).items()} for d in (mine, theirs)]
    assert refs[0] == refs[1]
    if refs[0]:  # metadata version 3: every data file has its index
        assert sorted(written.file_indexes) == sorted(refs[0])


def test_local_chunk_matches_dtensor_for_uneven_and_empty_shards() -> None:
    # DTensor's own shard arithmetic, without a process group, over many sizes and meshes.
    for n, dp, tp in itertools.product((1, 3, 5, 7, 8, 13, 64), (1, 2, 3, 4, 8), (1, 2, 4)):
        for shape, tp_dim in (((n, 6), 0), ((6, n), 1), ((n, 6), None), ((n,), None)):
            param = Param("w", shape, tp_dim)
            for rank in range(dp * tp):
                dp_rank, tp_rank = divmod(rank, tp)
                if tp == 1 or tp_dim is None:
                    mesh_shape, coords, placements = (dp,), [dp_rank], [Shard(0)]
                elif tp_dim == 0:
                    mesh_shape, coords = (dp, tp), [dp_rank, tp_rank]
                    placements = [_StridedShard(0, split_factor=tp), Shard(0)]
                else:
                    mesh_shape, coords, placements = (dp, tp), [dp_rank, tp_rank], [Shard(0), Shard(1)]
                expected = _compute_local_shape_and_global_offset(shape, mesh_shape, coords, placements)
                assert local_chunk(param, Layout(dp * tp, tp), rank) == expected, (shape, tp_dim, dp, tp, rank)


def test_issue_chunk_count_of_the_8b_shape() -> None:
    # Issue 16 counts 291 parameters x 3 (model, exp_avg, exp_avg_sq) per rank.
    params = MODELS["8B"].params()
    assert len(params) == 291
    assert MODELS["8B"].numel() == 8_030_261_248
    layout = Layout(64)
    shards = sum(1 for rank in range(2) for item in rank_save_plan(MODELS["8B"], layout, rank).items
                 if item.index.offset is not None and len(item.index.offset) > 0)
    assert shards == 2 * 291 * 3


def test_cli_runs_both_systems_in_process(capsys: pytest.CaptureFixture[str]) -> None:
    args = simulator.build_parser().parse_args(["--model", "tiny", "--ranks", "2,4", "--in-process", "--repeats", "1"])
    report = simulator.run(args)
    assert [(r["system"], r["ranks"], r["status"]) for r in report["rows"]] == [
        ("dcp_ext", 2, "ok"), ("torch", 2, "ok"), ("dcp_ext", 4, "ok"), ("torch", 4, "ok")]
    table = capsys.readouterr().out
    assert table.startswith("| model | ranks | chunks | system | plan s | plan CPU s | encode s | metadata bytes |")
    assert "| tiny | 4 | 273 | dcp_ext |" in table and "| tiny | 4 | 273 | torch |" in table
    # Every rank reads all 2 x 21 + 21 + 12 keys of its half: the resharded load plan is complete.
    assert report["rows"][2]["load"]["read_items"] == report["rows"][3]["load"]["read_items"] > 0


def test_forked_cases_report_time_and_memory_limits() -> None:
    case = Case("torch", "tiny", 4, reshard_to=2, repeats=1)
    row = simulator.run_case(case, simulator.Limits(timeout=600, memory_bytes=16 * simulator.GiB))
    assert row["status"] == "ok" and row["save"]["peak_rss_mib"] > 0 and row["load"]["read_items"] > 0
    slow = simulator.run_case(case, simulator.Limits(timeout=0.0, memory_bytes=16 * simulator.GiB))
    assert slow["status"].startswith("save: did not finish in 0 s"), slow["status"]
    big = simulator.run_case(case, simulator.Limits(timeout=600, memory_bytes=1))
    assert big["status"].startswith("save: exceeded"), big["status"]
    assert "did not finish" in render_table([slow])


@pytest.mark.parametrize("world_size,tp", [(3, 1), (4, 2), (12, 1)])
def test_array_synthesis_equals_the_object_path(world_size: int, tp: int) -> None:
    """bench.scale.fast builds, byte for byte, the compact plans, packed write
    results and frame indexes that the per-rank object path builds."""
    layout = Layout(world_size, tp)
    fast = sent_plans(TINY, layout)
    assert fast == [rank_sent_plan(TINY, layout, r) for r in range(world_size)]
    answers, _ = _simulated_planner(layout).create_global_plan(fast)
    local = (rank_save_plan(TINY, layout, r) for r in range(world_size))
    final = iter_final_plans(lambda: _simulated_planner(layout), local, answers)
    slow = dcp_ext_write_results(TINY, final, finish_data_file, pack_rank_results)
    quick = packed_results(TINY, layout, fast, answers)
    assert (quick.frames, quick.file_indexes) == (slow.frames, slow.file_indexes)
    assert [r[0] for r in quick.results] == [r[0] for r in slow.results]
