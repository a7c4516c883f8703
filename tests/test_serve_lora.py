"""The server's LoRA manager: path safety under --lora-dir, name / path resolution, the LRU with pinned adapters,
the adapter switch (hot swap, scale 0 = base) and alpha folding."""

import os

import pytest
import torch

import omni_accel
from omni_accel.errors import AccelError
from omni_accel.serve.lora import LoraManager, LoraRequestError, fold_scaling, parse_lora_flags
from omni_accel.testing import run, tiny_pipeline
from omni_accel.testing.lora import random_lora


def _save(pipe, folder, rank, seed, **metadata):
    state = {k.removeprefix("transformer."): v for k, v in random_lora(pipe, rank=rank, seed=seed).items()}
    meta = {"r": rank, "lora_alpha": metadata.get("lora_alpha", rank), "target_modules": ["to_q"]} if metadata else None
    pipe.save_lora_weights(str(folder), transformer_lora_layers=state, transformer_lora_adapter_metadata=meta)
    return str(folder)


@pytest.fixture(scope="module")
def adapters(tmp_path_factory):
    root = tmp_path_factory.mktemp("loras")
    pipe, _ = tiny_pipeline("flux")
    (root / "sub").mkdir()
    paths = {"a": _save(pipe, root / "a", 4, 1), "b": _save(pipe, root / "sub" / "b", 2, 2),
             "c": _save(pipe, root / "c", 4, 3), "big": _save(pipe, root / "big", 32, 4)}
    outside = tmp_path_factory.mktemp("outside")
    os.symlink(outside, root / "escape")
    return root, paths


def test_paths_outside_the_root_are_refused(adapters):
    root, _ = adapters
    pipe, _ = tiny_pipeline("flux")
    manager = LoraManager(pipe, lora_dir=str(root))
    assert manager.resolve(None, {"path": "sub/b"}).path == os.path.realpath(root / "sub" / "b")
    for bad in ("../outside", "/etc", "escape", "sub/../../x", ".", ""):
        with pytest.raises(LoraRequestError) as err:
            manager.resolve(None, {"path": bad, "scale": 1.0})
        assert err.value.status == 400 and err.value.param == "lora.path", bad
    with pytest.raises(LoraRequestError, match=r"^lora.path='nope' does not exist under the server's adapter root.$"):
        manager.resolve(None, {"path": "nope"})
    with pytest.raises(LoraRequestError, match="resolves outside the server's adapter root"):
        manager.resolve(None, {"path": "../outside"})


def test_names_models_scales_and_bad_fields(adapters):
    root, paths = adapters
    pipe, _ = tiny_pipeline("flux")
    manager = LoraManager(pipe, {"a": paths["a"]})
    assert manager.resolve("a", None).as_dict() == {"name": "a", "path": paths["a"], "scale": 1.0}
    assert manager.resolve("base-model", None) is None and manager.resolve(None, None) is None
    assert manager.resolve(None, {"name": "a", "scale": 0.5}).scale == 0.5
    cases = [({"name": "zz"}, "lora.name='zz' is not an adapter of this server; known: ['a'].", 404),
             ({"name": "a", "path": "x"}, "lora needs exactly one of name", 400),
             ({"name": "a", "scale": "high"}, "lora.scale='high' must be a number in [-8, 8].", 400),
             ({"name": "a", "rank": 4}, "lora has unknown fields ['rank']; use name or path, and scale.", 400),
             ({"path": "a"}, "lora.path needs a server started with --lora-dir ROOT", 400)]
    for body, message, status in cases:
        with pytest.raises(LoraRequestError) as err:
            manager.resolve(None, body)
        assert str(err.value).startswith(message) and err.value.status == status, (body, str(err.value))
    with pytest.raises(AccelError, match=r"^--lora 'x' is not NAME=PATH"):
        parse_lora_flags(["x"])
    with pytest.raises(AccelError, match=r"^--lora 'y=/no/such' : '/no/such' does not exist".replace(" :", ":")):
        parse_lora_flags(["y=/no/such"])


def test_switching_adapters_gives_each_its_own_output_and_base_at_scale_zero(adapters):
    root, paths = adapters
    pipe, kwargs = tiny_pipeline("flux")
    references = {}
    for name in ("a", "b"):
        pipe.load_lora_weights(paths[name], adapter_name=name)
        references[name] = run(pipe, kwargs)
        pipe.set_adapters(name, adapter_weights=0.5)
        references[name + "@0.5"] = run(pipe, kwargs)
        pipe.unload_lora_weights()
    plain = run(pipe, kwargs)
    manager = LoraManager(pipe, {"a": paths["a"]}, lora_dir=str(root), max_loras=2, max_rank=8)
    manager.prepare()
    omni_accel.accelerate(pipe, attention="math")
    assert torch.equal(run(pipe, kwargs), plain)  # a server with adapters answers a plain request with the base
    for name, scale, ref in (("a", 1.0, "a"), ("sub/b", 1.0, "b"), ("a", 0.5, "a@0.5"), ("sub/b", 0.5, "b@0.5")):
        choice = manager.resolve(name if name == "a" else None, None if name == "a" else {"path": name})
        manager.activate(dict(choice.as_dict(), scale=scale))
        assert (run(pipe, kwargs) - references[ref]).abs().max() <= 1e-5, (name, scale)
    manager.activate(None)
    assert torch.equal(run(pipe, kwargs), plain)
    # the LRU holds 2: 'a' is pinned (--lora), so the directory adapters take turns in the other place
    manager.activate(manager.resolve(None, {"path": "c"}).as_dict())
    assert manager.stats()["cached"] == [paths["a"], os.path.realpath(paths["c"])]
    with pytest.raises(LoraRequestError, match=r"^lora 'big' has rank 32, above this server's --max-lora-rank 8; "
                                               r"restart it with --max-lora-rank 32 or more.$"):
        manager.activate(manager.resolve(None, {"path": "big"}).as_dict() | {"name": "big"})
    omni_accel.restore(pipe)


def test_alpha_is_folded_into_lora_b():
    state = {"transformer.x.lora_A.weight": torch.ones(4, 3), "transformer.x.lora_B.weight": torch.ones(5, 4)}
    folded = fold_scaling(state, {"transformer.lora_alpha": 8, "transformer.r": 4})
    assert torch.equal(folded["transformer.x.lora_B.weight"], torch.full((5, 4), 2.0))
    assert torch.equal(folded["transformer.x.lora_A.weight"], torch.ones(4, 3))
    assert fold_scaling(state, None)["transformer.x.lora_B.weight"].equal(torch.ones(5, 4))
    with pytest.raises(LoraRequestError, match="DoRA adapters cannot be hot-swapped"):
        fold_scaling(state, {"transformer.use_dora": True})
