"""Checkpoint contract: exact round trips, sharding, one clear error, atomic writes."""

import json
import time

import pytest
import torch
from safetensors.torch import load_file, save_file

import lathe.model.checkpoint as checkpoint_module
from lathe.core.checkpoint_files import read_eos_ids
from lathe.data.tokenizer import load_tokenizer
from lathe.model import CheckpointError, load_checkpoint, save_checkpoint
from tests.builders import build_tokenizer, tiny_model


def assert_same_weights(a, b):
    sa, sb = a.state_dict(), b.state_dict()
    assert sa.keys() == sb.keys()
    for name in sa:
        assert sa[name].dtype == sb[name].dtype, name
        assert torch.equal(sa[name], sb[name]), name


@pytest.mark.parametrize("tie", [True, False])
def test_save_load_is_bit_exact(tmp_path, tie):
    model = tiny_model(tie_embeddings=tie)
    save_checkpoint(model, tmp_path / "ck")
    loaded = load_checkpoint(tmp_path / "ck")
    assert loaded.config == model.config
    assert_same_weights(model, loaded)
    assert (loaded.lm_head.weight is loaded.model.embed_tokens.weight) == tie
    ids = torch.randint(0, 256, (2, 20))
    with torch.no_grad():
        assert torch.equal(model(ids).logits, loaded(ids).logits)
    stored = load_file(tmp_path / "ck" / "model.safetensors")
    assert ("lm_head.weight" in stored) == (not tie)
    assert "model.layers.0.self_attn.q_proj.weight" in stored


def test_folder_contents_follow_the_contract(tmp_path):
    save_checkpoint(tiny_model(), tmp_path / "ck", provenance={"stage": "test", "steps": 3})
    files = {p.name for p in (tmp_path / "ck").iterdir()}
    assert files == {"config.json", "model.safetensors", "generation_config.json", "lathe.json"}
    config = json.loads((tmp_path / "ck" / "config.json").read_text())
    assert config["model_type"] == "llama" and config["architectures"] == ["LlamaForCausalLM"]
    assert config["torch_dtype"] == "float32" and config["num_key_value_heads"] == 2
    provenance = json.loads((tmp_path / "ck" / "lathe.json").read_text())
    assert provenance["stage"] == "test" and provenance["steps"] == 3
    assert provenance["parameters"] == tiny_model().config.num_params()


def test_sharded_save_loads_exactly(tmp_path):
    model = tiny_model(tie_embeddings=False)
    save_checkpoint(model, tmp_path / "ck", max_shard_size="300KB")
    folder = tmp_path / "ck"
    index = json.loads((folder / "model.safetensors.index.json").read_text())
    shards = sorted(set(index["weight_map"].values()))
    assert len(shards) > 3 and not (folder / "model.safetensors").exists()
    assert set(index["weight_map"]) == set(model.state_dict())
    assert_same_weights(model, load_checkpoint(folder))


def test_bf16_keeps_its_dtype_unless_asked(tmp_path):
    model = tiny_model().to(torch.bfloat16)
    save_checkpoint(model, tmp_path / "ck")
    assert json.loads((tmp_path / "ck" / "config.json").read_text())["torch_dtype"] == "bfloat16"
    assert_same_weights(model, load_checkpoint(tmp_path / "ck"))
    as_fp32 = load_checkpoint(tmp_path / "ck", dtype=torch.float32)
    assert as_fp32.lm_head.weight.dtype == torch.float32
    assert torch.equal(as_fp32.lm_head.weight, model.lm_head.weight.float())


def test_missing_unexpected_and_mis_shaped_tensors_are_reported_together(tmp_path):
    save_checkpoint(tiny_model(), tmp_path / "ck")
    weights = tmp_path / "ck" / "model.safetensors"
    state = load_file(weights)
    del state["model.layers.1.mlp.up_proj.weight"]
    state["model.layers.9.extra.weight"] = torch.zeros(3)
    state["model.norm.weight"] = torch.ones(64)
    save_file(state, weights, metadata={"format": "pt"})
    with pytest.raises(CheckpointError) as error:
        load_checkpoint(tmp_path / "ck")
    message = str(error.value)
    assert "missing (1): model.layers.1.mlp.up_proj.weight" in message
    assert "unexpected (1): model.layers.9.extra.weight" in message
    assert "mis-shaped (1): model.norm.weight (64,) (config expects (128,))" in message


def test_config_that_disagrees_with_weights_is_a_clear_error(tmp_path):
    save_checkpoint(tiny_model(), tmp_path / "ck")
    config_file = tmp_path / "ck" / "config.json"
    config = json.loads(config_file.read_text())
    config["vocab_size"] = 300
    config_file.write_text(json.dumps(config))
    with pytest.raises(CheckpointError, match=r"model.embed_tokens.weight \(256, 128\) "
                                              r"\(config expects \(300, 128\)\)"):
        load_checkpoint(tmp_path / "ck")


def test_not_a_checkpoint_folder(tmp_path):
    with pytest.raises(CheckpointError, match="no config.json"):
        load_checkpoint(tmp_path)
    save_checkpoint(tiny_model(), tmp_path / "ck")
    (tmp_path / "ck" / "model.safetensors").unlink()
    with pytest.raises(CheckpointError, match="reads safetensors only"):
        load_checkpoint(tmp_path / "ck")


def test_failed_save_leaves_the_previous_checkpoint_untouched(tmp_path, monkeypatch):
    first = tiny_model()
    save_checkpoint(first, tmp_path / "ck")

    def crash(*args, **kwargs):
        raise OSError("disk full")

    monkeypatch.setattr(checkpoint_module, "save_torch_state_dict", crash)
    with pytest.raises(OSError, match="disk full"):
        save_checkpoint(tiny_model(n_layers=2), tmp_path / "ck")
    assert [p.name for p in tmp_path.iterdir()] == ["ck"]  # no temp folder left behind
    assert_same_weights(first, load_checkpoint(tmp_path / "ck"))


def test_overwriting_replaces_the_whole_folder(tmp_path):
    save_checkpoint(tiny_model(tie_embeddings=False), tmp_path / "ck", max_shard_size="300KB")
    save_checkpoint(tiny_model(), tmp_path / "ck")
    assert not (tmp_path / "ck" / "model.safetensors.index.json").exists()
    assert [p.name for p in tmp_path.iterdir()] == ["ck"]
    load_checkpoint(tmp_path / "ck")


def test_tokenizer_files_and_special_ids_travel_with_the_checkpoint(tmp_path):
    tokenizer = build_tokenizer(tmp_path / "tok")
    save_checkpoint(tiny_model(vocab_size=320), tmp_path / "ck", tokenizer=tokenizer)
    folder = tmp_path / "ck"
    assert (folder / "tokenizer.json").read_bytes() == (tokenizer / "tokenizer.json").read_bytes()
    assert (folder / "tokenizer_config.json").is_file()
    config = json.loads((folder / "config.json").read_text())
    generation = json.loads((folder / "generation_config.json").read_text())
    assert (config["bos_token_id"], config["eos_token_id"], config["pad_token_id"]) == (0, 1, 2)
    assert generation == {"bos_token_id": 0, "eos_token_id": 1, "pad_token_id": 2}  # no
    # sampling defaults invented for a model lathe creates


def test_an_export_keeps_its_source_checkpoints_end_of_turn_ids_and_sampling(tmp_path):
    """An instruct model lists several end ids (Phi-3.5 [32007, 32001, 32000], Gemma [1,
    106]) where its tokenizer names one eos_token: a stage's export, whose tokenizer folder
    is the source checkpoint, keeps the list and the source's sampling defaults, or the
    fine-tuned model never stops at the end of its turn."""
    source = tmp_path / "source"
    save_checkpoint(tiny_model(vocab_size=320), source, tokenizer=build_tokenizer(tmp_path / "t"))
    generation = {"bos_token_id": 0, "eos_token_id": [1, 7, 9], "pad_token_id": 2,
                  "do_sample": True, "temperature": 0.6, "top_p": 0.95, "top_k": 20,
                  "transformers_version": "4.51.0"}
    (source / "generation_config.json").write_text(json.dumps(generation))
    config = json.loads((source / "config.json").read_text())
    (source / "config.json").write_text(json.dumps({**config, "eos_token_id": [1, 7]}))
    save_checkpoint(tiny_model(vocab_size=320), tmp_path / "export", tokenizer=source)
    assert json.loads((tmp_path / "export" / "generation_config.json").read_text()) == generation
    assert json.loads((tmp_path / "export" / "config.json").read_text())["eos_token_id"] == [1, 7]
    assert read_eos_ids(tmp_path / "export", 320) == [1, 7, 9]


def test_tokenizer_larger_than_the_vocab_is_refused(tmp_path):
    tokenizer = build_tokenizer(tmp_path / "tok", vocab_size=300)
    with pytest.raises(CheckpointError, match="tokenizer has 300 tokens but the model's "
                                              "vocab_size is 256"):
        save_checkpoint(tiny_model(), tmp_path / "ck", tokenizer=tokenizer)
    assert not (tmp_path / "ck").exists()


@pytest.mark.parametrize("text,named", [
    ("[1, 2]", "must hold a JSON object, not a list"),
    ("{nope", "not valid JSON"),
    ('{"model_type": "llama", "hidden_size": "128"}', "hidden_size='128' must be an integer"),
    ('{"model_type": "llama", "hidden_size": 128}', "the field 'num_attention_heads' is missing"),
])
def test_a_malformed_config_json_is_one_error_naming_it(tmp_path, text, named):
    save_checkpoint(tiny_model(), tmp_path / "ck")
    (tmp_path / "ck" / "config.json").write_text(text)
    with pytest.raises(CheckpointError, match="config.json: ") as info:
        load_checkpoint(tmp_path / "ck")
    assert named in str(info.value)


def test_a_truncated_or_non_float_weights_file_is_a_checkpoint_error(tmp_path):
    save_checkpoint(tiny_model(), tmp_path / "ck")
    weights = tmp_path / "ck" / "model.safetensors"
    data = weights.read_bytes()
    weights.write_bytes(data[:len(data) // 2])
    with pytest.raises(CheckpointError, match="model.safetensors: not a readable safetensors "
                                              "file .* truncated or corrupt"):
        load_checkpoint(tmp_path / "ck")
    weights.write_bytes(b"\xff" * 64)
    with pytest.raises(CheckpointError, match="truncated or corrupt"):
        load_checkpoint(tmp_path / "ck")
    state = {k: v.to(torch.int32) if k.endswith("norm.weight") else v
             for k, v in tiny_model().state_dict().items() if k != "lm_head.weight"}
    save_file(state, weights)
    with pytest.raises(CheckpointError, match="not floating point .*norm.weight"):
        load_checkpoint(tmp_path / "ck")


@pytest.mark.parametrize("shard", ["../outside.safetensors", "/etc/passwd.safetensors",
                                   "sub/dir.safetensors", "model.bin"])
def test_weight_map_names_cannot_leave_the_checkpoint_folder(tmp_path, shard):
    model = tiny_model(tie_embeddings=False)
    save_checkpoint(model, tmp_path / "ck", max_shard_size="300KB")
    save_file({"x": torch.zeros(1)}, tmp_path / "outside.safetensors")
    index_file = tmp_path / "ck" / "model.safetensors.index.json"
    index = json.loads(index_file.read_text())
    index["weight_map"]["model.norm.weight"] = shard
    index_file.write_text(json.dumps(index))
    with pytest.raises(CheckpointError, match="must be the name of a .safetensors file in the "
                                              "checkpoint folder"):
        load_checkpoint(tmp_path / "ck")
    index["weight_map"] = ["not", "a", "map"]
    index_file.write_text(json.dumps(index))
    with pytest.raises(CheckpointError, match="weight_map must map parameter names"):
        load_checkpoint(tmp_path / "ck")


def set_config(folder, **fields) -> None:
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, **fields}))


@pytest.mark.parametrize(("fields", "named"), [
    ({"num_hidden_layers": 1_000_000}, "num_hidden_layers=1000000"),
    ({"vocab_size": 10**12}, "vocab_size=1000000000000"),
])
def test_a_config_too_large_for_memory_is_refused_before_anything_is_built(tmp_path, fields,
                                                                             named):
    folder = save_checkpoint(tiny_model(), tmp_path / "ckpt")
    set_config(folder, **fields)
    start = time.monotonic()
    with pytest.raises(CheckpointError, match=f"{named}.* GiB available"):
        load_checkpoint(folder)
    assert time.monotonic() - start < 2  # the million layers were never built


def test_a_config_nested_100k_deep_is_one_error(tmp_path):
    folder = save_checkpoint(tiny_model(), tmp_path / "ckpt")
    (folder / "config.json").write_text("[" * 100_000 + "]" * 100_000)
    with pytest.raises(CheckpointError, match="config.json: nested too deeply"):
        load_checkpoint(folder)
    (folder / "config.json").write_text('{"a": ' * 100_000 + "1" + "}" * 100_000)
    with pytest.raises(CheckpointError, match="config.json: nested too deeply"):
        load_checkpoint(folder)


def test_links_that_leave_the_folder_are_refused(tmp_path, capsys):
    folder = save_checkpoint(tiny_model(vocab_size=320), tmp_path / "ckpt",
                             tokenizer=build_tokenizer(tmp_path / "tok", vocab_size=300))
    (folder / "tokenizer.json").unlink()
    (folder / "tokenizer.json").symlink_to("/dev/zero")
    with pytest.raises(CheckpointError, match="tokenizer.json: is a link to /dev/zero"):
        load_tokenizer(folder)
    from lathe.core.cli import main
    assert main(["generate", str(folder), "--prompt", "hello", "--max-new-tokens", "2"]) != 0
    error = capsys.readouterr().err
    assert "tokenizer.json: is a link to /dev/zero" in error and "Traceback" not in error
    outside = tmp_path / "elsewhere.safetensors"
    (folder / "model.safetensors").rename(outside)
    (folder / "model.safetensors").symlink_to(outside)
    with pytest.raises(CheckpointError, match="model.safetensors: is a link to .*outside"):
        load_checkpoint(folder)
    inside = folder / "weights"
    inside.mkdir()
    outside.rename(inside / "w.safetensors")
    (folder / "model.safetensors").unlink()
    (folder / "model.safetensors").symlink_to("weights/w.safetensors")
    assert_same_weights(load_checkpoint(folder), tiny_model(vocab_size=320))


def test_a_hugging_face_cache_snapshot_loads_through_its_blob_links(tmp_path):
    """The hub cache keeps files in blobs/ and links them from snapshots/REV/."""
    source = save_checkpoint(tiny_model(vocab_size=320), tmp_path / "ckpt",
                             tokenizer=build_tokenizer(tmp_path / "tok", vocab_size=300))
    repo = tmp_path / "hub" / "models--lathe--tiny"
    snapshot = repo / "snapshots" / "0123abc"
    (repo / "blobs").mkdir(parents=True)
    snapshot.mkdir(parents=True)
    for i, file in enumerate(sorted(source.iterdir())):
        (repo / "blobs" / f"blob{i}").write_bytes(file.read_bytes())
        (snapshot / file.name).symlink_to(f"../../blobs/blob{i}")
    assert_same_weights(load_checkpoint(snapshot), tiny_model(vocab_size=320))
    assert load_tokenizer(snapshot).get_vocab_size() == load_tokenizer(source).get_vocab_size()


def test_a_config_error_names_config_json_once(tmp_path):
    save_checkpoint(tiny_model(), tmp_path / "ck")
    config = json.loads((tmp_path / "ck" / "config.json").read_text())
    (tmp_path / "ck" / "config.json").write_text(json.dumps({**config, "model_type": "bert"}))
    with pytest.raises(CheckpointError) as raised:
        load_checkpoint(tmp_path / "ck")
    assert str(raised.value).count("config.json") == 1, raised.value
    assert "config.json: model_type='bert' is not supported" in str(raised.value)


@pytest.mark.parametrize("value", ["NaN", "Infinity", "-1"])
def test_a_rope_theta_that_is_not_a_positive_number_is_refused(tmp_path, value):
    save_checkpoint(tiny_model(), tmp_path / "ck")
    text = (tmp_path / "ck" / "config.json").read_text()
    theta = json.dumps(json.loads(text)["rope_theta"])
    (tmp_path / "ck" / "config.json").write_text(text.replace(
        f'"rope_theta": {theta}', f'"rope_theta": {value}'))
    with pytest.raises(CheckpointError, match="rope_theta=.* must be a positive number"):
        load_checkpoint(tmp_path / "ck")
