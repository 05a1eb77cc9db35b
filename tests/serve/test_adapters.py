"""Many LoRA adapters on one base: in one batch, every row's tokens and logits are those of
its adapter's merged checkpoint served alone; the prefix cache never shares a block across
adapters; adapters load and unload while requests run; a folder that does not fit the
base is refused by name."""

from __future__ import annotations

import contextlib
import dataclasses
import json
import shutil
from pathlib import Path

import pytest
import torch
from torch.profiler import ProfilerActivity, profile

from lathe.core.errors import CheckpointError
from lathe.kernels.cpu_native import cpu_kernels_loaded
from lathe.kernels.dispatch import kernels_off
from lathe.model import load_checkpoint, save_checkpoint
from lathe.model.lora import LoraSection, apply_lora, load_adapter, merge_lora, save_adapter
from lathe.serve.config import EngineConfig
from lathe.serve.engine import LLMEngine
from lathe.serve.request_checks import AdapterError
from lathe.serve.sampling_params import SamplingParams

PROMPTS = ["The river flows past the old mill", "A garden of", "The river flows"]


def trained_adapter(checkpoint, folder, r: int, targets: list[str], seed: int):
    """An adapter of rank `r` with random (non-zero) A and B, saved as peft writes it."""
    model = apply_lora(load_checkpoint(checkpoint), LoraSection(
        enabled=True, r=r, alpha=2.0 * r, target_modules=targets))
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if ".lora_" in name:
                parameter.copy_(torch.randn(parameter.shape, generator=generator) * 0.2)
    return save_adapter(model, LoraSection(enabled=True, r=r, alpha=2.0 * r,
                                           target_modules=targets), folder, checkpoint)


@pytest.fixture(scope="module")
def adapters(checkpoint, tmp_path_factory):
    root = tmp_path_factory.mktemp("adapters")
    small = trained_adapter(checkpoint, root / "small", 4, ["q_proj", "v_proj"], 1)
    large = trained_adapter(checkpoint, root / "large", 12,
                            ["q_proj", "k_proj", "o_proj", "gate_proj", "down_proj"], 2)
    merged = {}
    for name, folder in (("small", small), ("large", large)):
        model = merge_lora(load_adapter(load_checkpoint(checkpoint), folder))
        merged[name] = save_checkpoint(model, root / f"merged-{name}", tokenizer=checkpoint)
    return {"small": small, "large": large}, merged


def served(checkpoint, adapters, **config) -> LLMEngine:
    engine = LLMEngine.from_checkpoint(checkpoint, EngineConfig(
        num_blocks=256, max_loras=2, max_lora_rank=16, **config))
    for name, folder in adapters.items():
        engine.add_adapter(name, folder)
    return engine


def generate(engine: LLMEngine, requests: list[tuple[str, str | None]], tokens: int = 24):
    ids = [engine.add_request(engine.encode(prompt), SamplingParams(
        max_tokens=tokens, temperature=0, logprobs=1), adapter=adapter)
        for prompt, adapter in requests]
    out = {i: ([], []) for i in ids}
    while engine.has_unfinished():
        for delta in engine.step():
            out[delta.request_id][0].extend(delta.token_ids)
            out[delta.request_id][1].extend(lp.logprob for lp in delta.logprobs)
    return [out[i] for i in ids]


def equal_to_merged(checkpoint: Path, folders: dict[str, Path], merged: dict[str, Path],
                    engine: LLMEngine, tokens: int = 24) -> list[list[int]]:
    """Every prompt on the base and on each adapter, mixed in `engine`'s batches: the tokens
    and log-probs of the base, or of the adapter's merged checkpoint, served alone."""
    requests = [(p, a) for p in PROMPTS for a in (None, *folders)]
    mixed = generate(engine, requests, tokens)
    alone = {None: LLMEngine.from_checkpoint(checkpoint, EngineConfig(num_blocks=256)),
             **{name: LLMEngine.from_checkpoint(path, EngineConfig(num_blocks=256))
                for name, path in merged.items()}}
    for (prompt, adapter), (got, logprobs) in zip(requests, mixed, strict=True):
        (expected, expected_logprobs), = generate(alone[adapter], [(prompt, None)], tokens)
        assert got == expected, (prompt, adapter)
        torch.testing.assert_close(torch.tensor(logprobs), torch.tensor(expected_logprobs),
                                   atol=1e-4, rtol=0)
    return [t for t, _ in mixed]


@pytest.mark.parametrize(("decode_steps", "way", "compiled"), [
    (1, "native", False), (4, "native", False), (1, "gathered", False),
    (1, "segments", False), (1, "native", True), (4, "native", True)])
def test_mixed_adapters_in_one_batch_equal_their_merged_checkpoints(checkpoint, adapters,
                                                                    decode_steps, way,
                                                                    compiled, monkeypatch):
    """One native call per projection (CPU), gathered per row (BGMV) or looped per adapter
    (segments), multi-step or not; and in compiled decode steps (one native call on CPU,
    else buckets of up to 2 rows (the slots) gather each row's adapter and larger ones read
    every slot once) — all built at warm-up."""
    monkeypatch.setattr("lathe.serve.adapters.GATHER_ELEMENTS",
                        0 if way == "segments" else 1 << 23)
    folders, merged = adapters
    # compiled, 4 rows a step: buckets of 1 and 2 rows (the slots) and one larger is every
    # case, in 3 graphs a width where 16 rows would compile 5
    engine = served(checkpoint, folders, decode_steps=decode_steps, compile_decode=compiled,
                    max_num_seqs=4 if compiled else 16)
    if compiled:
        engine.warm_up()
    with (kernels_off("lora_bgmv") if way != "native" else contextlib.nullcontext()), \
            profile(activities=[ProfilerActivity.CPU]) as prof:
        mixed = equal_to_merged(checkpoint, folders, merged, engine)
    native = any(e.key == "lathe::lora_bgmv_cpu" for e in prof.key_averages())
    assert native == (way == "native" and cpu_kernels_loaded())
    assert len({tuple(t) for t in mixed[:3]}) == 3  # the adapters do change the output
    assert engine.block_manager.usage == 0
    if compiled:
        assert engine.runner.graphs.steps > 0 and engine.runner.graphs.late == 0


@pytest.mark.parametrize("way", ["native", "segments"])
def test_adapters_follow_the_rows_a_kv_sharing_step_keeps(way, tmp_path, monkeypatch):
    """Gemma 4 E2B's KV-sharing layers run on the rows a step samples alone: each of those
    rows keeps its own adapter there (a prefill of several prompts on different adapters),
    by one native call or by segments (reading the whole step's slots, rows took other
    rows' adapters)."""
    from tests.builders import GEMMA4_E2B, build_tokenizer, serve_model
    monkeypatch.setattr("lathe.serve.adapters.GATHER_ELEMENTS", 0)
    checkpoint = save_checkpoint(serve_model(512, **GEMMA4_E2B), tmp_path / "ck",
                                 tokenizer=build_tokenizer(tmp_path / "tok"))
    folders = {"small": trained_adapter(checkpoint, tmp_path / "small", 4,
                                        ["q_proj", "o_proj"], 1),
               "large": trained_adapter(checkpoint, tmp_path / "large", 8,
                                        ["q_proj", "gate_proj", "down_proj"], 2)}
    merged = {name: save_checkpoint(merge_lora(load_adapter(load_checkpoint(checkpoint),
                                                            folder)),
                                    tmp_path / f"merged-{name}", tokenizer=checkpoint)
              for name, folder in folders.items()}
    with kernels_off("lora_bgmv") if way == "segments" else contextlib.nullcontext():
        equal_to_merged(checkpoint, folders, merged, served(checkpoint, folders), tokens=8)


def test_no_prefix_cache_block_is_shared_across_adapters(checkpoint, adapters):
    engine = served(checkpoint, adapters[0])
    prompt = engine.encode(" ".join(PROMPTS) * 3)
    for adapter in (None, "small", "large", "small"):
        engine.add_request(prompt, SamplingParams(max_tokens=1, temperature=0),
                           adapter=adapter)
        while engine.has_unfinished():
            engine.step()
    # each adapter computes its own prefix; only the repeat of "small" reads the cache
    full_blocks = (len(prompt) - 1) // engine.config.block_size
    assert engine.block_manager.prefix_hits == full_blocks * engine.config.block_size


def test_adapters_load_and_unload_while_requests_run(checkpoint, adapters):
    folders, merged = adapters
    engine = served(checkpoint, {"small": folders["small"]})
    first = engine.add_request(engine.encode(PROMPTS[0]), SamplingParams(
        max_tokens=24, temperature=0), adapter="small")
    tokens: list[int] = []
    for _ in range(3):
        tokens += [t for d in engine.step() if d.request_id == first for t in d.token_ids]
    engine.remove_adapter("small")  # the running request keeps it
    with pytest.raises(AdapterError, match="no adapter named 'small'"):
        engine.add_request(engine.encode(PROMPTS[1]), SamplingParams(), adapter="small")
    with pytest.raises(AdapterError, match="being unloaded while requests finish on it"):
        engine.add_adapter("small", folders["small"])
    engine.add_adapter("large", folders["large"])
    while engine.has_unfinished():
        tokens += [t for d in engine.step() if d.request_id == first for t in d.token_ids]
    (expected, _), = generate(LLMEngine.from_checkpoint(
        merged["small"], EngineConfig(num_blocks=256)), [(PROMPTS[0], None)])
    assert tokens == expected
    assert "small" not in engine.adapters.resident  # gone with its last request
    engine.add_adapter("small", folders["small"])
    assert sorted(engine.adapters.names) == ["large", "small"]


def test_more_adapters_than_slots_take_turns_in_the_least_recently_used_slot(
        checkpoint, adapters):
    folders, merged = adapters
    engine = LLMEngine.from_checkpoint(checkpoint, EngineConfig(num_blocks=256, max_loras=1))
    for name, folder in folders.items():
        engine.add_adapter(name, folder)
    requests = [(p, a) for p in PROMPTS for a in ("small", "large", None)]
    served_alone = generate(engine, requests)
    for (prompt, adapter), (tokens, _) in zip(requests, served_alone, strict=True):
        path = merged[adapter] if adapter else checkpoint
        (expected, _), = generate(LLMEngine.from_checkpoint(path, EngineConfig(
            num_blocks=256)), [(prompt, None)])
        assert tokens == expected, (prompt, adapter)
    assert engine.adapters.resident in (["small"], ["large"])
    assert all(entry.users == 0 for entry in engine.adapters.loaded.values())


def break_config(folder, **fields):
    config = json.loads((folder / "adapter_config.json").read_text())
    (folder / "adapter_config.json").write_text(json.dumps({**config, **fields}))


@pytest.mark.parametrize(("damage", "named"), [
    (lambda f: break_config(f, r=32, lora_alpha=64), "rank 32 is above --max-lora-rank 16"),
    (lambda f: break_config(f, r=8), "the adapter belongs to another base"),
    (lambda f: break_config(f, use_dora=True), "use_dora=True is not served"),
    (lambda f: (f / "adapter_model.safetensors").write_bytes(b"junk"),
     "not a readable safetensors file"),
    (lambda f: (f / "adapter_config.json").unlink(), "is not a LoRA adapter folder"),
])
def test_an_adapter_that_does_not_fit_is_refused_by_name(checkpoint, adapters, tmp_path,
                                                          damage, named):
    folder = tmp_path / "adapter"
    shutil.copytree(adapters[0]["small"], folder)
    damage(folder)
    engine = LLMEngine.from_checkpoint(checkpoint, EngineConfig(num_blocks=64, max_loras=1))
    with pytest.raises(CheckpointError, match=named):
        engine.add_adapter("bad", folder)
    assert engine.adapters.names == []


def test_the_server_serves_adapters_by_model_name_and_loads_them_live(checkpoint, adapters):
    import httpx
    import openai

    from tests.serve.conftest import start_server, wait_healthy

    folders, merged = adapters
    server, thread, url = start_server(
        checkpoint, loras={"small": folders["small"]},
        engine=EngineConfig(num_blocks=256, max_loras=2),
        lora_roots=[folders["large"].parent], allow_unauthenticated_lora_loading=True)
    try:
        wait_healthy(url)
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0)
        models = {m.id: m for m in client.models.list().data}
        assert set(models) == {"tiny", "small"}
        assert models["small"].parent == "tiny" and models["tiny"].parent is None

        def complete(model: str) -> str:
            return client.completions.create(model=model, prompt=PROMPTS[0], max_tokens=12,
                                              temperature=0).choices[0].text

        expected = LLMEngine.from_checkpoint(merged["small"], EngineConfig(
            num_blocks=64)).generate([PROMPTS[0]], SamplingParams(
                max_tokens=12, temperature=0))[0].outputs[0].text
        assert complete("small") == expected != complete("tiny")
        with pytest.raises(openai.NotFoundError, match="`large` does not exist"):
            complete("large")
        load = httpx.post(f"{url}/v1/load_lora_adapter",
                          json={"lora_name": "large", "lora_path": str(folders["large"])})
        assert load.status_code == 200 and "added successfully" in load.text
        assert complete("large") != complete("small")
        bad = httpx.post(f"{url}/v1/load_lora_adapter",
                         json={"lora_name": "third", "lora_path": str(merged["small"])})
        assert bad.status_code == 400 and "is not a LoRA adapter folder" in bad.text
        outside = httpx.post(f"{url}/v1/load_lora_adapter",
                             json={"lora_name": "third", "lora_path": str(checkpoint)})
        assert outside.status_code == 403 and "is not inside a --lora-root" in outside.text
        with client.completions.create(model="small", prompt=PROMPTS[1], max_tokens=40,
                                       temperature=0, stream=True) as stream:
            first = next(iter(stream))  # running on "small" when it is unloaded
            unload = httpx.post(f"{url}/v1/unload_lora_adapter", json={"lora_name": "small"})
            assert unload.status_code == 200
            text = first.choices[0].text + "".join(c.choices[0].text for c in stream)
        assert text == LLMEngine.from_checkpoint(merged["small"], EngineConfig(
            num_blocks=64)).generate([PROMPTS[1]], SamplingParams(
                max_tokens=40, temperature=0))[0].outputs[0].text
        assert {m.id for m in client.models.list().data} == {"tiny", "large"}
        metrics = httpx.get(f"{url}/metrics").text
        assert 'lathe:lora_requests_total{lora_name="small",model_name="tiny"} 3.0' in metrics
        gone = httpx.post(f"{url}/v1/unload_lora_adapter", json={"lora_name": "small"})
        assert gone.status_code == 404
    finally:
        server.should_exit = True
        thread.join(timeout=10)


def test_speculation_and_structured_outputs_work_per_adapter(checkpoint, adapters):
    from lathe.serve.config import SpeculativeConfig
    from lathe.serve.structured import StructuredOutput

    folders, _ = adapters
    plain = served(checkpoint, folders)
    spec = served(checkpoint, folders, speculative=SpeculativeConfig("ngram", 3))
    requests = [(p, a) for p in PROMPTS for a in (None, "small", "large")]
    assert [t for t, _ in generate(spec, requests, 32)] == \
        [t for t, _ in generate(plain, requests, 32)]
    assert spec.stats()["spec_decode_num_draft_tokens"] > 0
    choice = StructuredOutput(choice=("north", "south", "east or west"))
    for adapter in ("small", "large"):
        done = spec.generate(PROMPTS, SamplingParams(max_tokens=8, temperature=1.0, seed=3,
                                                     structured=choice), adapter=adapter)
        assert all(d.outputs[0].text in choice.choice for d in done)


def test_an_adapter_on_a_module_the_base_lacks_is_refused(checkpoint, tmp_path):
    from lathe.model.lora import save_adapter

    head = save_adapter(apply_lora(load_checkpoint(checkpoint), LoraSection(
        enabled=True, r=4, target_modules=["q_proj", "lm_head"])),
        LoraSection(enabled=True, r=4, target_modules=["q_proj", "lm_head"]),
        tmp_path / "head", checkpoint)
    engine = LLMEngine.from_checkpoint(checkpoint, EngineConfig(num_blocks=64, max_loras=1))
    with pytest.raises(CheckpointError, match="'lm_head' is not a projection"):
        engine.add_adapter("head", head)


def test_an_adapter_whose_named_base_is_another_model_is_refused(checkpoint, adapters,
                                                                  tmp_path):
    shallow = tmp_path / "shallow"
    model = load_checkpoint(checkpoint)
    save_checkpoint(type(model)(dataclasses.replace(model.config, n_layers=1)), shallow,
                    tokenizer=checkpoint)
    folder = tmp_path / "adapter"
    shutil.copytree(adapters[0]["small"], folder)
    break_config(folder, base_model_name_or_path=str(shallow))
    engine = LLMEngine.from_checkpoint(checkpoint, EngineConfig(num_blocks=64, max_loras=1))
    with pytest.raises(CheckpointError, match="num_hidden_layers 1 vs 2"):
        engine.add_adapter("shallow", folder)
    break_config(folder, base_model_name_or_path="some-org/some-model")  # not on disk
    engine.add_adapter("hub", folder)


def test_adapters_over_a_half_base_run_in_float32(checkpoint, adapters):
    """On the CPU a bf16 base computes in float32, and so do its adapters' slots (not the
    base weights' bf16): each row of a mixed batch is its adapter's output alone."""
    folders, _ = adapters
    engine = LLMEngine.from_checkpoint(checkpoint, EngineConfig(
        num_blocks=256, max_loras=2, max_lora_rank=16), dtype=torch.bfloat16, device="cpu")
    for name, folder in folders.items():
        engine.add_adapter(name, folder)
    layers = engine.adapters.layers.values()
    assert {layer.lora_a.dtype for layer in layers} == {torch.float32}
    assert {layer.base.weight.dtype for layer in layers} == {torch.bfloat16}
    requests = [(p, a) for p in PROMPTS[:2] for a in (None, "small", "large")]
    mixed = generate(engine, requests)
    for request, (tokens, logprobs) in zip(requests, mixed, strict=True):
        (expected_tokens, expected_logprobs), = generate(engine, [request])
        assert tokens == expected_tokens, request
        # 1e-2: where bf16 dot products round each linear's input, a batch of another size
        # (summed in another order) can move a rounding by an ulp, and the next layers carry
        # it (measured up to 4e-3)
        torch.testing.assert_close(torch.tensor(logprobs), torch.tensor(expected_logprobs),
                                   atol=1e-2, rtol=0)
    assert len({tuple(t) for t, _ in mixed[:3]}) == 3


def corrupted(folder: Path, to: Path, value: float) -> Path:
    """A copy of an adapter folder with one of its B matrices set to `value`."""
    from safetensors.torch import load_file, save_file
    shutil.copytree(folder, to)
    tensors = load_file(to / "adapter_model.safetensors")
    key = next(k for k in sorted(tensors) if k.endswith("lora_B.weight"))
    tensors[key] = torch.full_like(tensors[key], value)
    save_file(tensors, to / "adapter_model.safetensors")
    return to


def test_runtime_adapter_loading_is_keyed_rooted_checked_and_capped(checkpoint, adapters,
                                                                    tmp_path):
    """Without --api-key (the default) anyone reaching the port could load any server path:
    refused unless --allow-unauthenticated-lora-loading; only inside --lora-root; NaN, Inf
    or absurd weights refused at load (one such adapter made every later request return
    ''); --max-loaded-loras unloads the least recently used idle adapter."""
    import httpx

    from tests.serve.conftest import API_KEY, start_server, wait_healthy

    folders, _ = adapters
    root = tmp_path / "root"
    shutil.copytree(folders["small"], root / "small")
    shutil.copytree(folders["large"], root / "large")
    corrupted(folders["small"], root / "nan", float("nan"))
    corrupted(folders["small"], root / "huge", 1e38)

    def load(url: str, name: str, key: str | None = None) -> httpx.Response:
        return httpx.post(f"{url}/v1/load_lora_adapter", headers={"Authorization": f"Bearer {key}"}
                          if key else {}, json={"lora_name": name,
                                                "lora_path": str(root / name)}, timeout=60)

    engine = EngineConfig(num_blocks=256, max_loras=1, max_loaded_loras=1)
    for settings, why in (({}, "needs the server's --api-key"),
                          ({"api_key": API_KEY}, "start the server with --lora-root")):
        server, thread, url = start_server(checkpoint, engine=engine, **settings)
        try:
            wait_healthy(url)
            refused = load(url, "small", settings.get("api_key"))
            assert refused.status_code == 403 and why in refused.text
        finally:
            server.should_exit = True
            thread.join(timeout=10)
    server, thread, url = start_server(checkpoint, engine=engine, api_key=API_KEY,
                                       lora_roots=[root])
    try:
        wait_healthy(url)
        assert load(url, "small").status_code == 401  # the key is checked first
        for name, why in (("nan", "holds NaN or Inf"), ("huge", "holds a weight of magnitude")):
            refused = load(url, name, API_KEY)
            assert refused.status_code == 400 and why in refused.text
        assert load(url, "small", API_KEY).status_code == 200
        assert load(url, "large", API_KEY).status_code == 200  # unloads the idle "small"
        models = httpx.get(f"{url}/v1/models", headers={"Authorization": f"Bearer {API_KEY}"})
        assert {m["id"] for m in models.json()["data"]} == {"tiny", "large"}
    finally:
        server.should_exit = True
        thread.join(timeout=10)
