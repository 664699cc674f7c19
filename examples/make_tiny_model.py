"""Build a small Llama-architecture model with seeded random weights and a local tokenizer.

Nothing is downloaded: the model is ``transformers.LlamaForCausalLM`` built from a config, its weights drawn
from a seeded generator, and saved with ``save_pretrained`` (safetensors, bf16). The tokenizer is a
``tokenizers`` WordLevel model over a synthetic vocabulary (``<unk> <s> </s> <pad> w4 w5 ... w{V-1}``, one
token per whitespace-separated word), wrapped in ``transformers.PreTrainedTokenizerFast`` and saved next to
the model, so vLLM can serve the directory with or without ``skip_tokenizer_init``.

Presets (``PRESETS``):

- ``test``:  hidden 128, 2 layers, 4 heads, 2 KV heads (head_dim 32), vocab 2048 - fast enough for tests;
- ``demo``:  hidden 512, 4 layers, 8 heads, 2 KV heads (head_dim 64), vocab 4096 - what ``make demo`` serves;
- ``bench``: hidden 1024, 8 layers, 16 heads, 4 KV heads (head_dim 64), intermediate 2816, vocab 8192 - the
  model of ``benchmarks/e2e_cpu.py`` (tierkv issue 2, item 10).
- ``mla``: ``DeepseekV2ForCausalLM`` (MLA), hidden 128, 2 dense layers, 4 heads, ``kv_lora_rank`` 512,
  ``qk_rope_head_dim`` 64 (a 576-value latent per token and layer, the only width vLLM's CPU MLA kernel takes),
  vocab 2048 - the model of ``tests/e2e/test_vllm_mla.py``.
- ``gemma``: ``Gemma3ForCausalLM``, hidden 128, 4 layers alternating a 64-token sliding window and full attention,
  4 heads, 2 KV heads (head_dim 32), vocab 2048 - a hybrid model, the model of ``tests/e2e/test_vllm_hybrid.py``.

All are bf16 with ``max_position_embeddings`` large enough for the 2,048-token documents plus questions and
multi-turn chats used by the demo and benchmarks.

Idempotent: a directory that already holds a model made from the same preset spec (recorded in
``tierkv_model.json``) is left as is. Usage::

    python examples/make_tiny_model.py --preset bench            # -> models/bench
    python examples/make_tiny_model.py --preset test --out /tmp/m

or ``from make_tiny_model import make_model; make_model("models/test", "test")``.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
SPEC_FILE = "tierkv_model.json"
SPEC_VERSION = 1

# Special tokens occupy the first ids; the synthetic words follow.
SPECIAL_TOKENS = ["<unk>", "<s>", "</s>", "<pad>"]
UNK_ID, BOS_ID, EOS_ID, PAD_ID = 0, 1, 2, 3
NUM_SPECIAL = len(SPECIAL_TOKENS)

PRESETS: dict[str, dict] = {
    "test": dict(hidden_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                 intermediate_size=352, vocab_size=2048, max_position_embeddings=4096),
    "demo": dict(hidden_size=512, num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=2,
                 intermediate_size=1408, vocab_size=4096, max_position_embeddings=8192),
    "bench": dict(hidden_size=1024, num_hidden_layers=8, num_attention_heads=16, num_key_value_heads=4,
                  intermediate_size=2816, vocab_size=8192, max_position_embeddings=8192),
    # DeepSeek-V2 shape (MLA): a latent of kv_lora_rank 512 + qk_rope_head_dim 64 = 576 values per token and layer
    # (the only width vLLM's CPU MLA decode kernel takes); every layer dense (first_k_dense_replace = layers)
    "mla": dict(hidden_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4,
                intermediate_size=352, vocab_size=2048, max_position_embeddings=4096, kv_lora_rank=512,
                q_lora_rank=None, qk_rope_head_dim=64, qk_nope_head_dim=32, v_head_dim=32, n_routed_experts=4,
                n_shared_experts=1, moe_intermediate_size=64, num_experts_per_tok=2, first_k_dense_replace=2,
                arch="deepseek_v2"),
    # Gemma-3 text shape (``Gemma3ForCausalLM``): layers alternate sliding-window (64 tokens) and full attention
    "gemma": dict(hidden_size=128, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, head_dim=32,
                  intermediate_size=352, vocab_size=2048, max_position_embeddings=4096, sliding_window=64,
                  layer_types=["sliding_attention", "full_attention"] * 2, arch="gemma3_text"),
}
DTYPE = "bfloat16"
TOKENIZER_MAX_LEN = 8192
DEFAULT_SEED = 0


def preset_spec(preset: str, seed: int = DEFAULT_SEED) -> dict:
    """The full description of a preset's model (what ``tierkv_model.json`` records).

    Raises ``ValueError`` naming the allowed presets for an unknown ``preset``.
    """
    if preset not in PRESETS:
        raise ValueError(f"preset={preset!r}: allowed values are {sorted(PRESETS)}")
    return {"spec_version": SPEC_VERSION, "preset": preset, "seed": int(seed), "dtype": DTYPE,
            **PRESETS[preset]}


def _is_complete(path: Path, spec: dict) -> bool:
    try:
        recorded = json.loads((path / SPEC_FILE).read_text())
    except (OSError, ValueError):
        return False
    needed = ["config.json", "tokenizer.json", "model.safetensors"]
    return recorded == spec and all((path / n).exists() for n in needed)


def _build_tokenizer(vocab_size: int):
    """A WordLevel tokenizer over ``SPECIAL_TOKENS + ["w4", ..., "w{vocab_size-1}"]`` (token id = word index)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {tok: i for i, tok in enumerate(SPECIAL_TOKENS)}
    vocab.update({f"w{i}": i for i in range(NUM_SPECIAL, vocab_size)})
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.decoder = decoders.WordPiece(prefix="##", cleanup=False)  # joins words with single spaces
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, unk_token="<unk>", bos_token="<s>", eos_token="</s>", pad_token="<pad>",
        model_max_length=TOKENIZER_MAX_LEN, clean_up_tokenization_spaces=False,
    )


def _gemma3_config(preset: dict):
    """(``Gemma3TextConfig``, ``Gemma3ForCausalLM``) for a preset with ``arch="gemma3_text"``: its
    ``layer_types`` mix ``sliding_attention`` (window ``sliding_window`` tokens) and ``full_attention`` layers,
    so vLLM builds one KV cache spec per kind (a hybrid model)."""
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig

    kw = {k: v for k, v in preset.items() if k != "arch"}
    cfg = Gemma3TextConfig(**kw, hidden_activation="gelu_pytorch_tanh", rms_norm_eps=1e-6,
                           query_pre_attn_scalar=kw["head_dim"], initializer_range=0.02, tie_word_embeddings=True,
                           bos_token_id=BOS_ID, eos_token_id=EOS_ID, pad_token_id=PAD_ID, torch_dtype=DTYPE)
    return cfg, Gemma3ForCausalLM


def _deepseek_v2_config(preset: dict):
    """(``DeepseekV2Config``, ``DeepseekV2ForCausalLM``) for a preset with ``arch="deepseek_v2"``: attention is
    MLA, so vLLM caches one latent vector of ``kv_lora_rank + qk_rope_head_dim`` values per token and layer."""
    from transformers import DeepseekV2Config, DeepseekV2ForCausalLM

    kw = {k: v for k, v in preset.items() if k != "arch"}
    cfg = DeepseekV2Config(**kw, hidden_act="silu", rms_norm_eps=1e-5, initializer_range=0.02,
                           tie_word_embeddings=False, bos_token_id=BOS_ID, eos_token_id=EOS_ID, pad_token_id=PAD_ID,
                           torch_dtype=DTYPE)
    return cfg, DeepseekV2ForCausalLM


def make_model(path: str | os.PathLike | None = None, preset: str = "test", *, seed: int = DEFAULT_SEED,
               quiet: bool = False) -> str:
    """Create the ``preset`` model in ``path`` (default ``<repo>/models/<preset>``) unless already there.

    Returns the directory as a string. The directory is written atomically (built in a sibling temporary
    directory, then renamed), so concurrent callers or an interrupted run never leave a half-written model
    that would be taken as complete. Raises ``ValueError`` for an unknown preset.
    """
    spec = preset_spec(preset, seed)
    path = Path(path) if path is not None else REPO_ROOT / "models" / preset
    path = path.resolve()
    if _is_complete(path, spec):
        if not quiet:
            print(f"[make_tiny_model] {path} already holds preset {preset!r} (seed {seed}); kept")
        return str(path)

    import torch
    from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM

    if PRESETS[preset].get("arch") == "gemma3_text":
        cfg, LlamaForCausalLM = _gemma3_config(PRESETS[preset])  # noqa: N806 - the model class to build
    elif PRESETS[preset].get("arch") == "deepseek_v2":
        cfg, LlamaForCausalLM = _deepseek_v2_config(PRESETS[preset])  # noqa: N806 - the model class to build
    else:
        cfg = LlamaConfig(
            **PRESETS[preset], hidden_act="silu", rms_norm_eps=1e-5, rope_theta=10000.0, initializer_range=0.02,
            tie_word_embeddings=False, bos_token_id=BOS_ID, eos_token_id=EOS_ID, pad_token_id=PAD_ID,
            torch_dtype=DTYPE,
        )
    # Seeded initialisation, independent of the caller's global RNG state.
    devices = []
    with torch.random.fork_rng(devices=devices):
        torch.manual_seed(seed)
        model = LlamaForCausalLM(cfg)
    model = model.to(torch.bfloat16).eval()
    tokenizer = _build_tokenizer(cfg.vocab_size)

    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{path.name}.tmp-", dir=path.parent))
    os.chmod(tmp, 0o755)  # mkdtemp makes it private; the model is an ordinary readable directory
    try:
        model.save_pretrained(tmp, safe_serialization=True)
        GenerationConfig(bos_token_id=BOS_ID, eos_token_id=EOS_ID, pad_token_id=PAD_ID,
                         do_sample=False).save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        (tmp / SPEC_FILE).write_text(json.dumps(spec, indent=1, sort_keys=True) + "\n")
        if path.exists():
            shutil.rmtree(path)
        try:
            os.rename(tmp, path)
        except OSError:
            # Another process finished first with the same spec: keep theirs.
            if not _is_complete(path, spec):
                raise
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    if not quiet:
        n = sum(p.numel() for p in model.parameters())
        print(f"[make_tiny_model] wrote preset {preset!r} ({n / 1e6:.1f} M parameters, {DTYPE}) to {path}")
    return str(path)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--preset", default="test", choices=sorted(PRESETS))
    ap.add_argument("--out", default=None, help="output directory (default: models/<preset>)")
    ap.add_argument("--seed", type=int, default=DEFAULT_SEED)
    args = ap.parse_args(argv)
    print(make_model(args.out, args.preset, seed=args.seed))
    return 0


if __name__ == "__main__":
    sys.exit(main())
