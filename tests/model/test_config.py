"""ModelConfig presets and validation, and the typed YAML recipe loader."""

from dataclasses import dataclass, field
from typing import Literal

import pytest
import torch

from lathe.core.config import load_config
from lathe.core.errors import ConfigError
from lathe.model import PRESETS, ModelConfig, Transformer


@pytest.mark.parametrize("name, low, high", [
    ("tiny", 0.8e6, 1.2e6), ("nano", 10e6, 30e6), ("small", 110e6, 140e6),
    ("1b", 1.2e9, 1.3e9), ("8b", 8.0e9, 8.1e9),
])
def test_preset_sizes(name, low, high):
    config = ModelConfig.from_preset(name)
    assert low <= config.num_params() <= high
    with torch.device("meta"):
        model = Transformer(config)
    assert sum(p.numel() for p in model.parameters()) == config.num_params()


def test_presets_match_the_llama_shapes_they_name():
    llama8b = ModelConfig.from_preset("8b")
    assert (llama8b.ffn_hidden_dim, llama8b.n_kv_heads, llama8b.head_dim) == (14336, 8, 128)
    assert llama8b.num_params() == 8_030_261_248  # Meta-Llama-3-8B
    llama1b = ModelConfig.from_preset("1b")
    assert llama1b.ffn_hidden_dim == 8192 and llama1b.rope_scaling.factor == 32.0
    assert llama1b.num_params() == 1_235_814_400  # Llama-3.2-1B


def test_preset_overrides_rederive_the_ffn_width():
    config = ModelConfig.from_preset("tiny", dim=256, n_kv_heads=1)
    assert config.ffn_hidden_dim == 704 and config.n_kv_heads == 1
    assert ModelConfig.from_preset("tiny", ffn_hidden_dim=100).ffn_hidden_dim == 100


@pytest.mark.parametrize("overrides, message", [
    ({"dim": 130}, "dim=130 is not divisible by n_heads=4"),
    ({"n_kv_heads": 3}, "n_heads=4 is not divisible by n_kv_heads=3"),
    ({"dim": 132, "n_heads": 12, "n_kv_heads": 12}, "head_dim=11 is odd"),
    ({"n_layers": 0}, "ModelConfig.n_layers=0 must be a positive integer"),
    ({"norm_eps": -1.0}, "ModelConfig.norm_eps=-1.0 must be a positive number"),
    ({"rope_scaling": {"factor": 0.5}}, "rope_scaling.factor=0.5 must be >= 1"),
    ({"dimension": 64}, "unknown field(s) dimension"),
    ({"dim": "wide"}, "dim='wide' must be of type int"),
])
def test_invalid_configs_name_the_fields(overrides, message):
    with pytest.raises(ConfigError) as error:
        ModelConfig.from_preset("tiny", **overrides)
    assert message in str(error.value)


def test_unknown_preset():
    with pytest.raises(ConfigError, match="unknown model preset 'huge'; choose one of tiny"):
        ModelConfig.from_preset("huge")
    assert set(PRESETS) == {"tiny", "nano", "small", "1b", "8b"}


def test_hf_config_round_trip():
    for name in PRESETS:
        config = ModelConfig.from_preset(name)
        again = ModelConfig.from_hf_config(config.to_hf_config())
        assert again.__dict__ == {**config.__dict__, "multiple_of": again.multiple_of,
                                  "ffn_dim_multiplier": None}


def test_hf_configs_lathe_cannot_run_are_refused():
    hf = ModelConfig.from_preset("tiny").to_hf_config()
    with pytest.raises(ConfigError, match="model_type='mamba' is not supported; lathe loads "
                                          "llama, mistral, qwen2, qwen3, smollm3, phi3, gemma2, "
                                          "gemma3_text"):
        ModelConfig.from_hf_config({**hf, "model_type": "mamba"})
    with pytest.raises(ConfigError, match="use_bidirectional_attention=True is not supported"):
        ModelConfig.from_hf_config({**hf, "model_type": "gemma3_text",
                                    "use_bidirectional_attention": True})
    with pytest.raises(ConfigError, match="rope type 'mrope' is not supported"):
        ModelConfig.from_hf_config({**hf, "rope_scaling": {"rope_type": "mrope",
                                                           "mrope_section": [2, 3, 3]}})
    with pytest.raises(ConfigError, match="LongRoPE needs one positive factor per rotated "
                                          "frequency"):
        ModelConfig.from_hf_config({**hf, "rope_scaling": {
            "rope_type": "longrope", "short_factor": [1.0], "long_factor": [2.0]}})
    with pytest.raises(ConfigError, match="layer_types=.* is not supported for mistral"):
        ModelConfig.from_hf_config({**hf, "model_type": "mistral", "sliding_window": 64,
                                    "layer_types": ["full_attention"] * 4})
    with pytest.raises(ConfigError, match="num_local_experts=8 is not supported"):
        ModelConfig.from_hf_config({**hf, "num_local_experts": 8})
    with pytest.raises(ConfigError, match="hidden_act='gelu' is not supported"):
        ModelConfig.from_hf_config({**hf, "hidden_act": "gelu"})
    with pytest.raises(ConfigError, match="attn_softcap=50.0: family='llama' has no such"):
        ModelConfig.from_hf_config({**hf, "attn_logit_softcapping": 50.0})
    mistral = ModelConfig.from_hf_config({**hf, "model_type": "mistral", "sliding_window": 64})
    assert [mistral.window(i) for i in range(4)] == [64] * 4
    qwen = ModelConfig.from_hf_config({**hf, "model_type": "qwen2", "attention_bias": True,
                                       "use_sliding_window": True, "sliding_window": 64,
                                       "max_window_layers": 3})
    assert [qwen.window(i) for i in range(4)] == [None, None, None, 64]


def test_sliding_windows_only_where_the_family_has_them():
    with pytest.raises(ConfigError, match="family='llama' has no sliding window"):
        ModelConfig.from_preset("tiny", sliding_window=8)
    with pytest.raises(ConfigError, match="family='mistral' has no per-layer windows"):
        ModelConfig.from_preset("tiny", family="mistral", sliding_window=8,
                                layer_types=["sliding_attention"] * 4)
    with pytest.raises(ConfigError, match="layer_types=.* needs sliding_window"):
        ModelConfig.from_preset("tiny", family="qwen3", qk_norm=True,
                                layer_types=["full_attention"] * 3 + ["sliding_attention"])
    with pytest.raises(ConfigError, match="must name, for each of the 4 layers"):
        ModelConfig.from_preset("tiny", family="qwen3", qk_norm=True, sliding_window=8,
                                layer_types=["sliding_attention"] * 3)


def test_a_family_builds_its_own_switches():
    with pytest.raises(ConfigError, match="family='qwen2' builds qkv_bias=True, not "
                                          "qkv_bias=False"):
        ModelConfig.from_preset("tiny", family="qwen2", qkv_bias=False)
    with pytest.raises(ConfigError, match="family='gemma' is not one lathe takes"):
        ModelConfig.from_preset("tiny", family="gemma")
    qwen3 = ModelConfig.from_preset("tiny", family="qwen3", qk_norm=True, head_dim=64)
    assert qwen3.q_dim == 4 * 64 != qwen3.dim
    hf = qwen3.to_hf_config()
    assert hf["model_type"] == "qwen3" and hf["architectures"] == ["Qwen3ForCausalLM"]
    assert ModelConfig.from_hf_config(hf) == qwen3


@dataclass
class Optim:
    lr: float = 1e-3
    betas: tuple[float, float] = (0.9, 0.95)
    schedule: Literal["cosine", "wsd"] = "cosine"


@dataclass
class Run:
    name: str = "run"
    steps: int = 10
    optim: Optim = field(default_factory=Optim)
    model: ModelConfig | None = None
    tags: list[str] = field(default_factory=list)


def test_recipe_with_dotted_overrides(tmp_path):
    recipe = tmp_path / "run.yaml"
    recipe.write_text("name: demo\noptim:\n  lr: 3\n  schedule: wsd\nmodel:\n  dim: 64\n"
                      "  n_heads: 2\ntags: [a, b]\n")
    run = load_config(Run, recipe, ["--optim.lr=5e-4", "--steps", "20", "--model.n_layers=1"])
    assert run.name == "demo" and run.steps == 20 and run.tags == ["a", "b"]
    assert run.optim == Optim(lr=5e-4, schedule="wsd")
    assert isinstance(run.optim.lr, float)
    assert run.model.dim == 64 and run.model.n_layers == 1 and run.model.ffn_hidden_dim == 192
    assert load_config(Run) == Run()


@pytest.mark.parametrize("overrides, message", [
    (["--optim.lrr=1"], "unknown field(s) optim.lrr; valid fields of optim.: betas, lr, schedule"),
    (["--steps=ten"], "steps='ten' must be of type int"),
    (["--optim.lr=fast"], "optim.lr='fast' must be of type float"),
    (["--steps=true"], "steps=True must be of type int"),
    (["--optim.schedule=linear"], "optim.schedule='linear' must be one of 'cosine', 'wsd'"),
    (["--tags=a"], "tags='a' must be a list"),
    (["--steps"], "override --steps has no value"),
    (["steps=3"], "unexpected argument 'steps=3'"),
    (["--name.first=x"], "'name' is a value, not a section"),
])
def test_recipe_errors_name_the_field(overrides, message, tmp_path):
    recipe = tmp_path / "run.yaml"
    recipe.write_text("name: demo\n")
    with pytest.raises(ConfigError) as error:
        load_config(Run, recipe, overrides)
    assert message in str(error.value)


def test_missing_or_malformed_recipe(tmp_path):
    with pytest.raises(ConfigError, match="does not exist"):
        load_config(Run, tmp_path / "nope.yaml")
    (tmp_path / "list.yaml").write_text("- 1\n- 2\n")
    with pytest.raises(ConfigError, match="must be a YAML mapping"):
        load_config(Run, tmp_path / "list.yaml")


@pytest.mark.parametrize("family", ["llama", "mistral", "qwen2", "qwen3", "smollm3", "phi3",
                                    "gemma2", "gemma3_text", "mixtral", "qwen3_moe", "olmoe",
                                    "qwen2_moe", "glm4_moe", "olmo2", "olmo3", "gemma4_text"])
def test_a_preset_of_any_family_is_what_its_transformers_class_builds(family, tmp_path):
    """`lathe init --family F --preset P`: the preset's shape with the family's switches,
    exported as that family's class with lathe's logits and every weight it builds (a
    Qwen2-MoE without its shared expert loaded with a MISSING report)."""
    transformers = pytest.importorskip("transformers")
    from lathe.model import Transformer, save_checkpoint
    config = ModelConfig.from_preset("tiny", family=family, vocab_size=128, n_layers=2)
    torch.manual_seed(0)
    model = Transformer(config).eval()
    save_checkpoint(model, tmp_path / family)
    theirs, loading = transformers.AutoModelForCausalLM.from_pretrained(
        tmp_path / family, dtype=torch.float32, output_loading_info=True)
    theirs.eval()
    assert theirs.config.model_type == family
    assert not loading["missing_keys"] and not loading["unexpected_keys"], loading
    ids = torch.randint(0, 128, (1, 40))
    with torch.no_grad():
        torch.testing.assert_close(model(ids).logits, theirs(ids).logits, atol=1e-4, rtol=1e-4)


def test_lathe_init_writes_a_preset_as_a_family(tmp_path, capsys):
    import json

    from lathe.model.commands import init_main
    assert init_main(["--preset", "tiny", "--family", "gemma2", "--n_layers=2",
                      "--out", str(tmp_path / "g")]) == 0
    written = json.loads((tmp_path / "g" / "config.json").read_text())
    assert (written["model_type"], written["architectures"]) == ("gemma2", ["Gemma2ForCausalLM"])
    assert written["layer_types"] == ["sliding_attention", "full_attention"]
    assert "tiny gemma2 checkpoint" in capsys.readouterr().out


def test_gemma4_settings_are_refused_where_they_cannot_be_written():
    """The full layers' own shape is Gemma 4's alone, needs layer types to say which layers
    are full, and Gemma 4's class makes its last layer full: a config saying otherwise would
    export as another model."""
    with pytest.raises(ConfigError, match="global_head_dim=64: family='llama'.*Gemma 4's"):
        ModelConfig.from_preset("tiny", global_head_dim=64)
    with pytest.raises(ConfigError, match="layer_types ends 'sliding_attention'"):
        ModelConfig.from_preset("tiny", family="gemma4_text", n_layers=2,
                                layer_types=["full_attention", "sliding_attention"])
    with pytest.raises(ConfigError, match="need layer_types"):
        ModelConfig.from_preset("tiny", family="gemma4_text", layer_types=None,
                                rope_local_theta=None)
    with pytest.raises(ConfigError, match="global_n_kv_heads=3 does not divide n_heads=4"):
        ModelConfig.from_preset("tiny", family="gemma4_text", global_n_kv_heads=3)
    config = ModelConfig.from_preset("tiny", family="gemma4_text", n_layers=6)
    assert config.layer_types == ["sliding_attention"] * 5 + ["full_attention"]
    assert [config.attention_shape(i) for i in (0, 5)] == [(2, 32), (2, 64)]
    assert config.kv_channels() == 5 * 2 * 32 + 2 * 64
