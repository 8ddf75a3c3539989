"""Build the tiny Llama model + tokenizer that the real-vLLM tests serve. Runs under `.venv-vllm`'s Python.

No hub access (HF_HUB_OFFLINE=1): the weights are random from a fixed seed and the tokenizer is a byte-level
BPE trained here on a fixed list of CPython stdlib sources, so two builds on the same machine give the same
files and the served text at temperature 0 is the same across restarts (gibberish, but deterministic).

Shape (REAL_VLLM.md): LlamaForCausalLM, hidden 128, intermediate 256, 2 layers, 4 heads, 2 KV heads,
vocab 2048 → ~0.8 M parameters; KV bytes/token = 2 · 2 layers · 2 kv_heads · 32 head_dim · 2 (bf16) = 512.

Usage: `.venv-vllm/bin/python tests/real_vllm/build_model.py OUT_DIR` — writes config, safetensors weights,
tokenizer files and `mosaic_model.json` (a manifest with the parameter count and a hash of the weights).
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
import sysconfig
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

SEED = 20261202
VOCAB_SIZE = 2048
MAX_POSITIONS = 2048
SPECIAL_TOKENS = ["<unk>", "<s>", "</s>", "<|user|>", "<|assistant|>", "<|system|>", "<|end|>"]
# Stable, mid-sized stdlib modules: ~1 MB of English prose + code, enough for 2048 merges.
CORPUS_MODULES = (
    "argparse.py",
    "asyncio/base_events.py",
    "collections/__init__.py",
    "csv.py",
    "dataclasses.py",
    "difflib.py",
    "email/message.py",
    "enum.py",
    "functools.py",
    "http/client.py",
    "json/decoder.py",
    "logging/__init__.py",
    "pathlib.py",
    "random.py",
    "shutil.py",
    "statistics.py",
    "string.py",
    "subprocess.py",
    "textwrap.py",
    "threading.py",
    "typing.py",
    "unittest/case.py",
    "urllib/parse.py",
)
# Jinja chat template: `<|role|>` header, content, `<|end|>`; the generation prompt opens the assistant turn.
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}"
    "<|{{ message['role'] }}|>\n{{ message['content'] }}<|end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)


def corpus_files() -> list[Path]:
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    files = [stdlib / name for name in CORPUS_MODULES]
    missing = [str(f) for f in files if not f.is_file()]
    if missing:
        raise SystemExit(f"stdlib sources missing (needed for the tokenizer corpus): {', '.join(missing)}")
    return files


def train_tokenizer() -> PreTrainedTokenizerFast:
    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    texts = [f.read_text(encoding="utf-8") for f in corpus_files()]
    tok.train_from_iterator(texts, trainer=trainer, length=len(texts))
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token="<s>",
        eos_token="</s>",
        unk_token="<unk>",
        pad_token="</s>",
        model_max_length=MAX_POSITIONS,
    )
    fast.chat_template = CHAT_TEMPLATE
    return fast


def build_model(tokenizer: PreTrainedTokenizerFast) -> LlamaForCausalLM:
    torch.manual_seed(SEED)
    config = LlamaConfig(
        vocab_size=VOCAB_SIZE,
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=MAX_POSITIONS,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        tie_word_embeddings=False,
        torch_dtype="bfloat16",
    )
    model = LlamaForCausalLM(config)
    # Larger-than-default init so the logits are not near-uniform (output then depends on the prompt).
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() > 1:
                p.normal_(0.0, 0.08)
    return model.to(torch.bfloat16)


def weights_hash(out: Path) -> str:
    digest = hashlib.sha256()
    for f in sorted(out.glob("*.safetensors")):
        digest.update(f.read_bytes())
    return digest.hexdigest()


def main(argv: list[str]) -> int:
    if len(argv) != 2:
        print(f"usage: {argv[0]} OUT_DIR", file=sys.stderr)
        return 2
    out = Path(argv[1])
    out.mkdir(parents=True, exist_ok=True)
    tokenizer = train_tokenizer()
    model = build_model(tokenizer)
    model.save_pretrained(out, safe_serialization=True)
    tokenizer.save_pretrained(out)
    manifest = {
        "seed": SEED,
        "parameters": sum(p.numel() for p in model.parameters()),
        "vocab_size": VOCAB_SIZE,
        "weights_sha256": weights_hash(out),
        "tokenizer_sha256": hashlib.sha256((out / "tokenizer.json").read_bytes()).hexdigest(),
    }
    (out / "mosaic_model.json").write_text(json.dumps(manifest, indent=2) + "\n", encoding="utf-8")
    print(json.dumps(manifest))
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv))
