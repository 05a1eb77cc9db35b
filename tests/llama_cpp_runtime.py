"""llama.cpp itself as the tests' reference for an exported GGUF file: its tokenizer, its
detokenizer, the chat template it reads and its logits at every position.

The library is node-llama-cpp's prebuilt CPU build of llama.cpp (`recipes/setup.sh` unpacks
npm's `@node-llama-cpp/linux-x64@3.22.1` into `.venv/llama.cpp`), so CI checks GGUF files
against llama.cpp without compiling it. The structs below are that build's `llama.h`, and
its library names carry the release, so a different build is not found rather than
misread. A test that builds a `LlamaCpp` skips where the library is absent."""
from __future__ import annotations

import ctypes
import sys
from functools import cache
from pathlib import Path

import pytest
import torch

FOLDER = Path(sys.prefix) / "llama.cpp"
BUILD = "v0.5.0"  # the llama.cpp release node-llama-cpp 3.22.1 ships; the structs are its
GGML_F32 = 0
# ggml's CPU builds, best first, but for Sapphire Rapids': its AMX kernels (the q8_0 and bf16
# matmuls) killed pytest workers with SIGILL in llama_decode, after other tests had run in
# the same process (3 CI runs of 4 on an AMX Xeon), and what the tests check of a GGUF file
# does not depend on the instruction set. AMD's builds come after Intel's (-march=znver4
# may emit AMD-only instructions on an Intel CPU whose features otherwise qualify)
CPU_VARIANTS = ("icelake", "cooperlake", "cascadelake", "skylakex", "cannonlake", "alderlake",
                "haswell", "zen4", "piledriver", "ivybridge", "sandybridge", "sse42", "x64")


class ModelParams(ctypes.Structure):
    _fields_ = [("devices", ctypes.c_void_p), ("tensor_buft_overrides", ctypes.c_void_p),
                ("n_gpu_layers", ctypes.c_int32), ("split_mode", ctypes.c_int),
                ("load_mode", ctypes.c_int), ("lazy_mode", ctypes.c_int),
                ("main_gpu", ctypes.c_int32), ("tensor_split", ctypes.c_void_p),
                ("progress_callback", ctypes.c_void_p),
                ("progress_callback_user_data", ctypes.c_void_p),
                ("kv_overrides", ctypes.c_void_p)] + [
        (name, ctypes.c_bool) for name in ("vocab_only", "check_tensors", "use_extra_bufts",
                                           "no_host", "no_alloc", "load_mtp")]


class ContextParams(ctypes.Structure):
    _fields_ = [(name, ctypes.c_uint32) for name in (
        "n_ctx", "n_batch", "n_ubatch", "n_seq_max", "n_rs_seq", "n_outputs_max",
        "n_outputs_max_per_seq")] + [(name, ctypes.c_int32) for name in (
            "n_threads", "n_threads_batch", "ctx_type", "rope_scaling_type", "pooling_type",
            "attention_type", "flash_attn_type")] + [(name, ctypes.c_float) for name in (
                "rope_freq_base", "rope_freq_scale", "yarn_ext_factor", "yarn_attn_factor",
                "yarn_beta_fast", "yarn_beta_slow")] + [
        ("yarn_orig_ctx", ctypes.c_uint32), ("defrag_thold", ctypes.c_float),
        ("cb_eval", ctypes.c_void_p), ("cb_eval_user_data", ctypes.c_void_p),
        ("type_k", ctypes.c_int), ("type_v", ctypes.c_int),
        ("abort_callback", ctypes.c_void_p), ("abort_callback_data", ctypes.c_void_p)] + [
        (name, ctypes.c_bool) for name in ("embeddings", "offload_kqv", "no_perf",
                                           "op_offload", "swa_full", "kv_unified")] + [
        ("samplers", ctypes.c_void_p), ("n_samplers", ctypes.c_size_t),
        ("ctx_other", ctypes.c_void_p)]


class Batch(ctypes.Structure):
    _fields_ = [("n_tokens", ctypes.c_int32), ("token", ctypes.POINTER(ctypes.c_int32)),
                ("embd", ctypes.c_void_p), ("pos", ctypes.POINTER(ctypes.c_int32)),
                ("n_seq_id", ctypes.POINTER(ctypes.c_int32)),
                ("seq_id", ctypes.POINTER(ctypes.POINTER(ctypes.c_int32))),
                ("logits", ctypes.POINTER(ctypes.c_int8))]


@cache
def library() -> ctypes.CDLL:
    """libllama with its signatures declared and ggml's CPU backends loaded; skips the test
    where it was not installed."""
    path = FOLDER / f"libllama.{BUILD}.so"
    if not path.exists():
        pytest.skip(f"llama.cpp is not installed at {FOLDER} (recipes/setup.sh puts it there)")
    ggml = ctypes.CDLL(str(FOLDER / f"libggml.{BUILD}.so"), mode=ctypes.RTLD_GLOBAL)
    ggml.ggml_backend_load.restype, ggml.ggml_backend_load.argtypes = \
        ctypes.c_void_p, [ctypes.c_char_p]
    for variant in CPU_VARIANTS:  # ggml refuses (NULL) one this CPU cannot run
        if ggml.ggml_backend_load(str(FOLDER / f"libggml-cpu-{variant}.so").encode()):
            break
    lib = ctypes.CDLL(str(path), mode=ctypes.RTLD_GLOBAL)
    pointer, i32, text = ctypes.c_void_p, ctypes.c_int32, ctypes.c_char_p
    ids = ctypes.POINTER(ctypes.c_int32)
    for name, result, arguments in [
        ("llama_backend_init", None, []),
        ("llama_log_set", None, [pointer, pointer]),
        ("llama_model_default_params", ModelParams, []),
        ("llama_context_default_params", ContextParams, []),
        ("llama_model_load_from_file", pointer, [text, ModelParams]),
        ("llama_init_from_model", pointer, [pointer, ContextParams]),
        ("llama_model_get_vocab", pointer, [pointer]),
        ("llama_vocab_n_tokens", i32, [pointer]),
        ("llama_model_chat_template", text, [pointer, text]),
        ("llama_vocab_is_eog", ctypes.c_bool, [pointer, i32]),
        ("llama_tokenize", i32, [pointer, text, i32, ids, i32, ctypes.c_bool, ctypes.c_bool]),
        ("llama_detokenize", i32, [pointer, ids, i32, ctypes.c_char_p, i32, ctypes.c_bool,
                                   ctypes.c_bool]),
        ("llama_batch_init", Batch, [i32, i32, i32]),
        ("llama_batch_free", None, [Batch]),
        ("llama_decode", i32, [pointer, Batch]),
        ("llama_get_logits_ith", ctypes.POINTER(ctypes.c_float), [pointer, i32]),
        ("llama_free", None, [pointer]),
        ("llama_model_free", None, [pointer]),
    ]:
        function = getattr(lib, name)
        function.restype, function.argtypes = result, arguments
    lib.llama_log_set(silent, None)
    lib.llama_backend_init()
    return lib


silent = ctypes.CFUNCTYPE(None, ctypes.c_int, ctypes.c_char_p, ctypes.c_void_p)(
    lambda level, message, data: None)


class LlamaCpp:
    """One GGUF file as llama.cpp loads it: the vocabulary alone (`n_ctx` 0), or the model
    with a context of `n_ctx` positions."""

    def __init__(self, path: Path, n_ctx: int = 0):
        self.lib = library()
        params = self.lib.llama_model_default_params()
        params.vocab_only = n_ctx == 0
        self.model = self.lib.llama_model_load_from_file(str(path).encode(), params)
        assert self.model, f"llama.cpp could not load {path}"
        self.vocab = self.lib.llama_model_get_vocab(self.model)
        self.context = None
        if n_ctx:
            context = self.lib.llama_context_default_params()
            context.n_ctx = context.n_batch = context.n_ubatch = n_ctx
            context.n_threads = context.n_threads_batch = 2
            context.type_k = context.type_v = GGML_F32  # not llama.cpp's f16 cache: exact
            context.flash_attn_type = 0
            self.context = self.lib.llama_init_from_model(self.model, context)
            assert self.context, f"llama.cpp could not make a context for {path}"

    def tokenize(self, text: str, special: bool = False) -> list[int]:
        """llama.cpp's ids for `text`, with the BOS the file asks for; `special` parses
        special-token text (`<|im_end|>`) as that token, as a server's chat prompt does."""
        data = text.encode()
        room = len(data) + 8
        out = (ctypes.c_int32 * room)()
        count = self.lib.llama_tokenize(self.vocab, data, len(data), out, room, True, special)
        assert count >= 0, f"llama_tokenize returned {count}"
        return list(out[:count])

    def detokenize(self, ids: list[int], special: bool = False) -> str:
        """llama.cpp's text for `ids`: special tokens rendered as text only when `special`."""
        tokens = (ctypes.c_int32 * len(ids))(*ids)
        room = 16 * len(ids) + 16
        out = ctypes.create_string_buffer(room)
        count = self.lib.llama_detokenize(self.vocab, tokens, len(ids), out, room,
                                          not special, special)
        assert count >= 0, f"llama_detokenize returned {count}"
        return out.raw[:count].decode()

    def is_end(self, token: int) -> bool:
        """Whether llama.cpp ends a generation at `token` (an end-of-generation id)."""
        return self.lib.llama_vocab_is_eog(self.vocab, token)

    def chat_template(self, name: str | None = None) -> str | None:
        """The chat template llama.cpp reads from the file (the named one when `name`)."""
        found = self.lib.llama_model_chat_template(self.model, name.encode() if name else None)
        return found.decode() if found else None

    def logits(self, ids: list[int]) -> torch.Tensor:
        """llama.cpp's logits at every position of `ids`, one decode from an empty cache."""
        assert self.context, "logits need a context: LlamaCpp(path, n_ctx)"
        width = self.lib.llama_vocab_n_tokens(self.vocab)
        batch = self.lib.llama_batch_init(len(ids), 0, 1)
        try:
            batch.n_tokens = len(ids)
            for i, token in enumerate(ids):
                batch.token[i], batch.pos[i], batch.n_seq_id[i] = token, i, 1
                batch.seq_id[i][0], batch.logits[i] = 0, 1
            status = self.lib.llama_decode(self.context, batch)
            assert status == 0, f"llama_decode returned {status}"
            return torch.tensor([self.lib.llama_get_logits_ith(self.context, i)[:width]
                                 for i in range(len(ids))])
        finally:
            self.lib.llama_batch_free(batch)

    def __del__(self, finalizing=sys.is_finalizing):  # bound now: at exit `sys` is gone
        if finalizing():  # ggml's own teardown may have run: freeing then segfaults
            return
        if getattr(self, "context", None):
            self.lib.llama_free(self.context)
        if getattr(self, "model", None):
            self.lib.llama_model_free(self.model)

