"""Rank code and test data for test_smp_parity.py: SageMaker-API parity and Hugging Face import.

One 2-rank world (:func:`smp_world`) runs every multi-rank check:

1. the SMP v2 fine-tuning call ``resume_from_checkpoint(model_dir, tag="fullmodel.pt",
   partial=False)`` (no model: the registered one) into an FSDP2-sharded MiniLM on the
   meta device, from a plain ``torch.save(model.state_dict())``;
2. ``translate_function`` from MiniLM's names to a tensor-parallel model whose modules
   are named differently;
3. FP8 (DeepSeek-V3 style, 128x128 block scales) into an FSDP2-sharded bf16 MiniLM;
4. the same FP8 file into the tensor-parallel model (Shard(0) and Shard(1) weights).
"""

from __future__ import annotations

import os
import re
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

import dcp_ext

FULL = StateDictOptions(full_state_dict=True)  # every rank gets the full values (cpu_offload: rank 0 only)
BLOCK = 128

# MiniLM's names -> the renamed tensor-parallel model's.
_HF_FFN = re.compile(r"encoder\.layer\.(\d+)\.(intermediate\.dense|output\.dense|attention\.output\.dense)\.(weight|bias)")
_RENAMED = {"intermediate.dense": "up", "output.dense": "down", "attention.output.dense": "proj"}


def hf_to_renamed(keys: list[str]) -> dict[str, str]:
    """SMP's key-list form (a ``dcp_ext.KeyList`` key_map): all checkpoint keys in, ``{checkpoint key: model key}`` out."""
    table = {}
    for key in keys:
        match = _HF_FFN.fullmatch(key)
        if match:
            table[key] = f"blocks.{match[1]}.{_RENAMED[match[2]]}.{match[3]}"
    return table


class Block(nn.Module):
    def __init__(self, hidden: int, inter: int) -> None:
        super().__init__()
        self.up = nn.Linear(hidden, inter)      # intermediate.dense     (1536, 384): Colwise, Shard(0)
        self.down = nn.Linear(inter, hidden)    # output.dense           (384, 1536): Rowwise, Shard(1)
        self.proj = nn.Linear(hidden, hidden)   # attention.output.dense (384, 384):  Rowwise, Shard(1), 192 cols/rank


class Renamed(nn.Module):
    """MiniLM's feed-forward and attention-output layers under other module names."""

    def __init__(self, layers: int = 6, hidden: int = 384, inter: int = 1536) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(Block(hidden, inter) for _ in range(layers))


def renamed_tp(world_size: int, dtype: torch.dtype) -> Renamed:
    """The renamed model on the meta device, tensor parallel over all ranks."""
    with torch.device("meta"):
        model = Renamed().to(dtype)
    mesh = init_device_mesh("cpu", (world_size,))
    plan: dict[str, Any] = {}
    for i in range(len(model.blocks)):
        plan[f"blocks.{i}.up"] = ColwiseParallel()
        plan[f"blocks.{i}.down"] = RowwiseParallel()
        plan[f"blocks.{i}.proj"] = RowwiseParallel()
    parallelize_module(model, mesh, plan)
    return model


def sharded_minilm(model_dir: str, world_size: int, dtype: torch.dtype) -> nn.Module:
    """MiniLM on the meta device (SMP v2 delayed initialization), FSDP2-sharded."""
    from transformers import BertConfig, BertModel

    config = BertConfig.from_pretrained(model_dir)
    with torch.device("meta"):
        model = BertModel(config).to(dtype)
    mesh = init_device_mesh("cpu", (world_size,))
    for layer in model.encoder.layer:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


# -- test data: an FP8 checkpoint made from MiniLM --------------------------------------
def quantize_blocks(weight: torch.Tensor, block: int = BLOCK) -> tuple[torch.Tensor, torch.Tensor]:
    """``(fp8 weight, scale)`` with one float32 scale per ``block`` x ``block`` block (DeepSeek-V3 layout)."""
    rows, cols = weight.shape
    scale = torch.empty(-(-rows // block), -(-cols // block), dtype=torch.float32)
    fp8 = torch.empty(rows, cols, dtype=torch.float8_e4m3fn)
    for i in range(scale.shape[0]):
        for j in range(scale.shape[1]):
            part = weight[i * block : (i + 1) * block, j * block : (j + 1) * block].float()
            amax = float(part.abs().max())
            scale[i, j] = amax / 448.0 if amax > 0 else 1.0
            fp8[i * block : (i + 1) * block, j * block : (j + 1) * block] = (part / scale[i, j]).to(fp8.dtype)
    return fp8, scale


def reference_dequantize(fp8: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype, block: int = BLOCK) -> torch.Tensor:
    """The test's own dequantization, block by block (not dcp_ext's code)."""
    out = torch.empty(fp8.shape, dtype=dtype)
    for i in range(scale.shape[0]):
        for j in range(scale.shape[1]):
            rows, cols = slice(i * block, (i + 1) * block), slice(j * block, (j + 1) * block)
            out[rows, cols] = (fp8[rows, cols].to(torch.float32) * scale[i, j]).to(dtype)
    return out


def write_fp8_checkpoint(source: str, out_dir: str) -> tuple[str, str, int]:
    """Quantize every 2-D ``*.weight`` of MiniLM per 128x128 block (others to bf16, integer
    buffers as they are) into ``out_dir/fp8.safetensors``; the expected bf16 values of every
    tensor after dequantization into ``out_dir/expected.safetensors``.

    Returns:
        Both paths and how many weights were quantized.
    """
    from safetensors.torch import load_file, save_file

    tensors = load_file(source)
    stored: dict[str, torch.Tensor] = {}
    expected: dict[str, torch.Tensor] = {}
    quantized = 0
    for key, value in tensors.items():
        if value.dim() == 2 and key.endswith(".weight") and value.is_floating_point():
            fp8, scale = quantize_blocks(value)
            stored[key], stored[key + "_scale_inv"] = fp8, scale
            expected[key] = reference_dequantize(fp8, scale, torch.bfloat16)
            quantized += 1
        elif value.is_floating_point():
            stored[key] = expected[key] = value.to(torch.bfloat16)
        else:
            stored[key] = value
    fp8_path, expected_path = os.path.join(out_dir, "fp8.safetensors"), os.path.join(out_dir, "expected.safetensors")
    save_file(stored, fp8_path)
    save_file(expected, expected_path)
    return fp8_path, expected_path, quantized


# -- the world --------------------------------------------------------------------------
def _mismatches(model: nn.Module, reference: dict[str, torch.Tensor]) -> list[str]:
    """(all ranks: gathers) Keys of ``model`` or ``reference`` whose full values differ
    (or that only one of them has)."""
    full = get_model_state_dict(model, options=FULL)
    differ = {k for k, v in full.items() if k not in reference or not torch.equal(v, reference[k])}
    return sorted(differ | (set(reference) - set(full)))


def _full_tensors(model: nn.Module) -> dict[str, torch.Tensor]:
    """(all ranks: gathers) Every parameter's global value."""
    return {
        name: (p.full_tensor() if isinstance(p, DTensor) else p).detach().clone()
        for name, p in model.named_parameters()
    }


def smp_world(rank: int, world_size: int, minilm_dir: str, work: str, fp8_path: str, expected_path: str) -> dict[str, Any]:
    from safetensors.torch import load_file

    out: dict[str, Any] = {}
    source = os.path.join(minilm_dir, "model.safetensors")

    # 1. Seed 002: rank 0 saves the pretrained model with torch.save; every rank makes the
    # model on the meta device, shards it, registers it, and resumes with SMP's exact call.
    model_dir = os.path.join(work, "model_dir")
    if rank == 0:
        from transformers import AutoModel

        os.makedirs(model_dir, exist_ok=True)
        pretrained = AutoModel.from_pretrained(minilm_dir)
        torch.save(pretrained.state_dict(), os.path.join(model_dir, "fullmodel.pt"))
        del pretrained
    dist.barrier()
    model = sharded_minilm(minilm_dir, world_size, torch.float32)
    dcp_ext.register_model(model)
    result = dcp_ext.resume_from_checkpoint(model_dir, tag="fullmodel.pt", partial=False)
    saved = torch.load(os.path.join(model_dir, "fullmodel.pt"), weights_only=True)
    out["seed002_tag"], out["seed002_partial"] = result.tag, result.partial
    out["seed002_keys"] = len(saved)
    out["seed002_mismatches"] = _mismatches(model, saved)
    dcp_ext.register_model(None)
    del model, saved

    # 2. A key-list key_map into a tensor-parallel model with other module names.
    hf_dir = os.path.join(work, "hf")
    if rank == 0:
        os.makedirs(hf_dir, exist_ok=True)
        os.symlink(source, os.path.join(hf_dir, "model.safetensors"))
    dist.barrier()
    seen: list[int] = []

    def translate(keys: list[str]) -> dict[str, str]:
        seen.append(len(keys))
        return hf_to_renamed(keys)

    tp = renamed_tp(world_size, torch.float32)
    dcp_ext.resume_from_checkpoint(hf_dir, tp, tag="model.safetensors", partial=False, key_map=dcp_ext.KeyList(translate))
    original = load_file(source)
    table = hf_to_renamed(list(original))
    reference = {table[k]: v for k, v in original.items() if k in table}
    full = _full_tensors(tp)
    out["tp_keys_seen"] = seen
    out["tp_file_keys"] = len(original)
    out["tp_loaded"] = sorted(full)
    out["tp_placements"] = {k: str(p.placements) for k, p in tp.named_parameters() if k.startswith("blocks.0.")}
    out["tp_mismatches"] = sorted(k for k in reference if not torch.equal(full[k], reference[k]))
    del tp, full

    # 2b. SMP's state-dict translate_function into the same tensor-parallel model: every rank gets the
    # whole tensors and keeps its shard.
    tp = renamed_tp(world_size, torch.float32)
    dcp_ext.resume_from_checkpoint(hf_dir, tp, tag="model.safetensors", partial=False,
                                   translate_function=lambda sd: {table.get(k, k): v for k, v in sd.items()})
    full = _full_tensors(tp)
    out["tp_state_mismatches"] = sorted(k for k in reference if not torch.equal(full[k], reference[k]))
    out["tp_state_placements"] = {k: str(p.placements) for k, p in tp.named_parameters() if k.startswith("blocks.0.")}
    del tp, full, original

    # 3. FP8 into an FSDP2-sharded bf16 MiniLM on the meta device.
    expected = load_file(expected_path)
    model = sharded_minilm(minilm_dir, world_size, torch.bfloat16)
    report = dcp_ext.load_pretrained(model, fp8_path, dequantize_fp8=True)
    out["fp8_fsdp_dequantized"] = report.dequantized
    out["fp8_fsdp_unexpected"] = report.unexpected
    out["fp8_fsdp_bytes_read"] = report.bytes_read
    out["fp8_file_size"] = os.path.getsize(fp8_path)
    out["fp8_fsdp_mismatches"] = _mismatches(model, expected)
    out["fp8_fsdp_local_rows"] = model.embeddings.word_embeddings.weight.to_local().shape[0]
    del model

    # 4. The same FP8 file into the renamed tensor-parallel model (bf16), translated.
    tp = renamed_tp(world_size, torch.bfloat16)
    report = dcp_ext.load_pretrained(tp, fp8_path, key_map=dcp_ext.KeyList(hf_to_renamed), dequantize_fp8=True)
    table = hf_to_renamed(list(expected))
    reference = {table[k]: v for k, v in expected.items() if k in table}
    full = _full_tensors(tp)
    out["fp8_tp_dequantized"] = report.dequantized
    out["fp8_tp_mismatches"] = sorted(k for k in reference if not torch.equal(full[k], reference[k]))
    out["fp8_tp_proj_local"] = tuple(tp.blocks[0].proj.weight.to_local().shape)
    return out
