"""Hostile model folders given to ``tim dequantize`` and ``tim export-hf``, and to the loader they share
(``HFCheckpoint``, tim_megatron/trainer/weights/model_files.py). Each attack was tried on the code before the
fix; what happened then and what happens now:

* An index whose ``weight_map`` names ``../other-model/model.safetensors`` (or an absolute path, or a shard
  that is a link to a file outside the folder): ``tim dequantize`` read the neighbouring model and, for ``../``,
  wrote its bf16 copy over it (exit 0). Now refused by name before anything is read; the neighbour is
  untouched and nothing is written.
* ``README.md`` and ``special_tokens_map.txt`` as links to a "secret" file outside the folder: both commands
  copied the secret into their output. Now refused by name (nothing is written). Refused, not skipped: a
  checkpoint whose side files are not its own is not the checkpoint the user meant, and an export or copy
  silently missing its tokenizer files would be a different model downstream (another chat template).
  Links inside the folder, and a Hugging Face hub snapshot's links into its own ``blobs/``, are read as the
  files they point to.
* NaN, inf and overflowing (finite but huge) ``weight_scale_inv`` scales: ``tim dequantize`` wrote NaN/inf
  bf16 weights (exit 0). Now refused, naming the tensor; no output folder is left.
* A truncated ``model.safetensors`` and one whose header length is a lie: a safetensors traceback. Now a
  named error that names the file, with no traceback.
* A FIFO named ``model.safetensors``, like a shard of the index, like the index itself or like a side file:
  the reader blocked forever, or the FIFO was skipped in silence. Now refused by name within seconds.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.test_fp8 import tiny_fp8  # noqa: F401 - the module-scoped fixture, built once for this file

ROOT = Path(__file__).resolve().parents[1]
TIM = [sys.executable, "-m", "tim_megatron.cli"]
SECRET = "ssh-ed25519 AAAAC3NzaC1lZDI1NTE5AAAAI-the-readers-private-key"
SHARDS = ("model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors")


def tim(*args, timeout: int = 300) -> subprocess.CompletedProcess:
    return subprocess.run([*TIM, *map(str, args)], capture_output=True, text=True, cwd=ROOT, timeout=timeout)


def refused(res: subprocess.CompletedProcess, *needles: str) -> None:
    """Exit 2 with a one-line error holding every needle, and no traceback."""
    out = res.stdout + res.stderr
    assert res.returncode == 2, out[-3000:]
    assert "Traceback" not in out, out[-3000:]
    for needle in needles:
        assert needle in out, (needle, out[-3000:])


def digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def all_text(folder: Path) -> str:
    """Every file under ``folder`` (not following links), as text."""
    return "".join(
        p.read_bytes().decode("latin-1") for p in folder.rglob("*") if p.is_file() and not p.is_symlink()
    )


def sharded(src: Path, dst: Path) -> Path:
    """A copy of the single-file checkpoint ``src`` in two shards with a ``model.safetensors.index.json``."""
    from safetensors.torch import load_file, save_file

    shutil.copytree(src, dst)
    tensors = load_file(dst / "model.safetensors")
    (dst / "model.safetensors").unlink()
    names = sorted(tensors)
    half = {n: SHARDS[0] if "layers.1." not in n else SHARDS[1] for n in names}
    for shard in SHARDS:
        save_file({n: tensors[n] for n in names if half[n] == shard}, dst / shard, metadata={"format": "pt"})
    (dst / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": half}))
    return dst


def set_weight_map(folder: Path, fn) -> None:
    index = folder / "model.safetensors.index.json"
    data = json.loads(index.read_text())
    data["weight_map"] = {k: fn(v) for k, v in data["weight_map"].items()}
    index.write_text(json.dumps(data))


# ------------------------------------------------------------------------------------ shards outside


@pytest.mark.parametrize("how", ["dotdot", "absolute", "link"])
def test_dequantize_refuses_a_shard_outside_the_model_folder(tiny_fp8, tmp_path, how):  # noqa: F811
    """The neighbour model stays as it was, the refusal names the shard, and nothing is written."""
    neighbour = tmp_path / "other-model"
    shutil.copytree(tiny_fp8[1], neighbour)
    before = digest(neighbour / "model.safetensors")
    model = tmp_path / "model"
    if how == "link":  # no index: model.safetensors itself is a link to the neighbour's
        model.mkdir()
        shutil.copy(neighbour / "config.json", model / "config.json")
        (model / "model.safetensors").symlink_to("../other-model/model.safetensors")
        name = "model.safetensors"
    else:
        sharded(tiny_fp8[1], model)
        name = "../other-model/model.safetensors" if how == "dotdot" else str(neighbour / "model.safetensors")
        set_weight_map(model, lambda _: name)
    listing = sorted(p.name for p in tmp_path.iterdir())
    res = tim("dequantize", model, tmp_path / "out")
    refused(res, name)
    assert digest(neighbour / "model.safetensors") == before
    assert sorted(p.name for p in tmp_path.iterdir()) == listing  # no out, no temporary folder beside it


# ------------------------------------------------------------------------------------- linked side files


@pytest.mark.parametrize("side", ["README.md", "special_tokens_map.txt"])
def test_dequantize_refuses_side_files_linked_out_of_the_folder(tiny_fp8, tmp_path, side):  # noqa: F811
    secret = tmp_path / "secret"
    secret.write_text(SECRET)
    model = tmp_path / "models" / "fp8"
    shutil.copytree(tiny_fp8[1], model)
    (model / side).symlink_to(secret)
    res = tim("dequantize", model, tmp_path / "models" / "bf16")
    refused(res, side, "symbolic link")
    assert sorted(p.name for p in (tmp_path / "models").iterdir()) == ["fp8"]
    assert SECRET not in res.stdout + res.stderr


def test_links_are_read_only_inside_the_folder_or_a_hub_snapshots_blobs(tiny_fp8, tmp_path):  # noqa: F811
    """A Hugging Face hub snapshot (``models--org--name/snapshots/REV/``) holds links into ``../../blobs/``: they
    are read. A look-alike link that climbs out of ``blobs/`` is refused, as is one through a ``blobs`` link."""
    repo = tmp_path / "hub" / "models--org--tiny-fp8"
    blobs, snap = repo / "blobs", repo / "snapshots" / "0123abc"
    blobs.mkdir(parents=True)
    snap.mkdir(parents=True)
    for f in sorted(tiny_fp8[1].iterdir()):
        blob = hashlib.sha256(f.name.encode()).hexdigest()
        shutil.copy(f, blobs / blob)
        (snap / f.name).symlink_to(f"../../blobs/{blob}")
    (snap / "config.copy.json").symlink_to("config.json")  # a link inside the folder
    secret = tmp_path / "secret"
    secret.write_text(SECRET)
    (snap / "README.md").symlink_to("../../blobs/../../../secret")
    res = tim("dequantize", snap, tmp_path / "out-1")
    refused(res, "README.md", "../../blobs/../../../secret")
    (snap / "README.md").unlink()
    fake = tmp_path / "fake" / "models--org--x"
    (fake / "snapshots" / "r").mkdir(parents=True)
    (fake / "blobs").symlink_to(tmp_path)  # blobs/ is itself a link out
    for f in snap.iterdir():
        shutil.copy(f, fake / "snapshots" / "r" / f.name)  # regular files, but README.md:
    (fake / "snapshots" / "r" / "README.md").symlink_to("../../blobs/secret")
    res = tim("dequantize", fake / "snapshots" / "r", tmp_path / "out-2")
    refused(res, "README.md")
    assert not (tmp_path / "out-1").exists() and not (tmp_path / "out-2").exists()
    ok = tim("dequantize", snap, tmp_path / "out")
    assert ok.returncode == 0, ok.stderr[-3000:]
    out = tmp_path / "out"
    assert json.loads((out / "config.copy.json").read_text()) == json.loads(
        (tiny_fp8[1] / "config.json").read_text()
    )
    assert all(not p.is_symlink() for p in out.iterdir())  # the copy holds files, not the hub's links


def test_export_hf_refuses_side_files_linked_out_of_the_model_folder(trained, tmp_path):
    """The model folder the run trained from holds a ``special_tokens_map.txt`` linked to a secret, then a FIFO
    named ``tokenizer_config.json``: each is refused by name before the model loads; no export is written.
    (``README.md`` is not among the files an export copies, linked or not.)"""
    import yaml

    from tim_megatron.recipe import load_recipe
    from tim_megatron.run_setup import model_path_for

    run = tmp_path / "runs" / "run"
    shutil.copytree(trained, run)
    model = tmp_path / "model"
    shutil.copytree(model_path_for(load_recipe(run / "recipe.yaml").recipe), model)
    recipe = yaml.safe_load((run / "recipe.yaml").read_text())
    recipe["model"]["path"] = str(model)
    (run / "recipe.yaml").write_text(yaml.safe_dump(recipe))
    secret = tmp_path / "secret"
    secret.write_text(SECRET)
    (model / "special_tokens_map.txt").symlink_to(secret)
    out = tmp_path / "hf"
    res = tim("export-hf", run, out)
    leaked = out.exists() and SECRET in all_text(out)
    assert not leaked, "the secret was copied into the export"
    refused(res, "special_tokens_map.txt", "symbolic link")
    assert not out.exists() and sorted(p.name for p in tmp_path.iterdir()) == ["model", "runs", "secret"]
    (model / "special_tokens_map.txt").unlink()
    (model / "tokenizer_config.json").unlink()
    os.mkfifo(model / "tokenizer_config.json")
    start = time.monotonic()
    res = tim("export-hf", run, out, timeout=120)
    refused(res, "tokenizer_config.json", "FIFO")
    assert time.monotonic() - start < 60 and not out.exists()


# ------------------------------------------------------------------------------------ non-finite scales


@pytest.mark.parametrize("scale", [float("nan"), float("inf"), 3e38])
def test_dequantize_refuses_non_finite_scales_and_results(tiny_fp8, tmp_path, scale):  # noqa: F811
    """NaN and inf scales, and a finite scale whose product with the FP8 values overflows float32."""
    from safetensors.torch import load_file, save_file

    from tim_megatron.trainer.weights import HFCheckpoint, WeightLoadError

    model = tmp_path / "fp8"
    shutil.copytree(tiny_fp8[1], model)
    tensors = load_file(model / "model.safetensors")
    name = "model.layers.0.self_attn.o_proj.weight"
    tensors[name + "_scale_inv"][0, 0] = scale
    save_file(tensors, model / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(WeightLoadError, match=rf"{name}.*non-finite"):
        HFCheckpoint(model).get(name)  # the trainer's loader refuses it too
    res = tim("dequantize", model, tmp_path / "out")
    refused(res, name, "non-finite")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["fp8"]


# ---------------------------------------------------------------------------------- truncated safetensors


@pytest.mark.parametrize("damage", ["truncated", "header length", "short"])
def test_a_damaged_safetensors_file_is_a_named_error(tiny_fp8, tmp_path, damage):  # noqa: F811
    from tim_megatron.trainer.weights import HFCheckpoint, WeightLoadError

    model = tmp_path / "fp8"
    shutil.copytree(tiny_fp8[1], model)
    f = model / "model.safetensors"
    data = f.read_bytes()
    if damage == "truncated":
        f.write_bytes(data[: len(data) // 2])
    elif damage == "header length":  # claims a header far longer than the file
        f.write_bytes((2**40).to_bytes(8, "little") + data[8:])
    else:
        f.write_bytes(data[:5])
    with pytest.raises(WeightLoadError, match=r"model\.safetensors"):
        ck = HFCheckpoint(model)
        ck.get(sorted(ck.keys())[0])
    res = tim("dequantize", model, tmp_path / "out")
    refused(res, str(f))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["fp8"]


# ----------------------------------------------------------------------------------------------- FIFOs


@pytest.mark.parametrize(
    "fifo", ["model.safetensors", SHARDS[1], "model.safetensors.index.json", "tokenizer.json"]
)
def test_dequantize_refuses_a_fifo_in_the_model_folder_within_seconds(tiny_fp8, tmp_path, fifo):  # noqa: F811
    model = tmp_path / "fp8"
    if fifo == "model.safetensors":
        shutil.copytree(tiny_fp8[1], model)
    else:
        sharded(tiny_fp8[1], model)
    if (model / fifo).exists():
        (model / fifo).unlink()
    os.mkfifo(model / fifo)
    start = time.monotonic()
    try:
        res = tim("dequantize", model, tmp_path / "out", timeout=120)
    except subprocess.TimeoutExpired:
        pytest.fail(f"tim dequantize blocked on the FIFO {fifo} for 120 s")
    refused(res, fifo, "FIFO")
    assert time.monotonic() - start < 60
    assert sorted(p.name for p in tmp_path.iterdir()) == ["fp8"]


def test_the_loader_refuses_special_files_and_links_by_name(tiny_fp8, tmp_path):  # noqa: F811
    """What the trainer and the rollout check read: a FIFO weights file and a linked config are named."""
    from tim_megatron.rollout.base import RolloutInputError, check_model_files
    from tim_megatron.safe_files import UnsafePathError
    from tim_megatron.trainer.weights import HFCheckpoint

    model = tmp_path / "fp8"
    shutil.copytree(tiny_fp8[1], model)
    (model / "model.safetensors").unlink()
    os.mkfifo(model / "model.safetensors")
    writer = os.open(model / "model.safetensors", os.O_RDWR | os.O_NONBLOCK)  # a reader's open cannot block
    try:
        with pytest.raises(UnsafePathError, match=r"model\.safetensors is a FIFO"):
            HFCheckpoint(model)
        with pytest.raises(RolloutInputError, match=r"model\.safetensors is a FIFO"):
            check_model_files(model)
    finally:
        os.close(writer)
    (model / "model.safetensors").unlink()
    shutil.copy(tiny_fp8[1] / "model.safetensors", model / "model.safetensors")
    secret = tmp_path / "secret.json"
    secret.write_text(json.dumps({"token": SECRET}))
    (model / "config.json").unlink()
    (model / "config.json").symlink_to(secret)
    with pytest.raises(UnsafePathError, match=r"config\.json is a symbolic link"):
        HFCheckpoint(model)
