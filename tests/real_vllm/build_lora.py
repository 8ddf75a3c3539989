"""Build tiny LoRA adapters for the tiny test model (build_model.py), in PEFT's on-disk layout.

No peft, no hub: `adapter_config.json` (the fields vLLM's `PEFTHelper` reads, as PEFT writes them) and
`adapter_model.safetensors` with PEFT's tensor names, which vLLM's loader (`vllm/lora/lora_model.py`,
`parse_fine_tuned_lora_name`) maps by stripping `base_model.model.`:

    base_model.model.model.layers.{i}.self_attn.{q_proj,v_proj}.lora_A.weight   [r, in_features]
    base_model.model.model.layers.{i}.self_attn.{q_proj,v_proj}.lora_B.weight   [out_features, r]

Rank 8, alpha 16 (scaling 2), both A and B random from a fixed seed: PEFT initialises B to zeros (an
untrained adapter changes nothing); a nonzero B makes the adapter change the output at temperature 0, and
each seed gives a different adapter. Shapes come from the model's config.json (q: hidden → heads·head_dim,
v: hidden → kv_heads·head_dim). Same seed, same files (float32 tensors, CPU generator).

Two ways in:
- `write_adapters(out_dir, {"name": seed, ...})` from the test venv: runs `build` under `.venv-vllm`'s Python
  (torch + safetensors live there) and returns {name: adapter dir}; ~2 s; RuntimeError with its stderr if it fails.
- `.venv-vllm/bin/python tests/real_vllm/build_lora.py MODEL_DIR OUT_DIR SEED`: one adapter into OUT_DIR.
"""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Mapping
from pathlib import Path

RANK = 8
ALPHA = 16
TARGET_MODULES = ("q_proj", "v_proj")
INIT_STD = 0.1  # A and B: the delta is ~0.6 per q element against ~0.9 of the base projection


def adapter_config(model_dir: Path) -> dict[str, object]:
    """PEFT's LoraConfig as `save_pretrained` writes it (the subset vLLM reads, plus PEFT's bookkeeping)."""
    return {
        "base_model_name_or_path": str(model_dir),
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "inference_mode": True,
        "r": RANK,
        "lora_alpha": ALPHA,
        "lora_dropout": 0.0,
        "target_modules": list(TARGET_MODULES),
        "bias": "none",
        "fan_in_fan_out": False,
        "init_lora_weights": True,
        "modules_to_save": None,
        "use_rslora": False,
        "use_dora": False,
        "layers_to_transform": None,
        "layers_pattern": None,
        "rank_pattern": {},
        "alpha_pattern": {},
        "revision": None,
    }


def build(model_dir: Path, out_dir: Path, seed: int) -> None:
    """Write one adapter (runs under `.venv-vllm`: imports torch and safetensors)."""
    import torch
    from safetensors.torch import save_file

    config = json.loads((model_dir / "config.json").read_text(encoding="utf-8"))
    hidden = int(config["hidden_size"])
    head_dim = int(config.get("head_dim") or hidden // int(config["num_attention_heads"]))
    out_features = {
        "q_proj": int(config["num_attention_heads"]) * head_dim,
        "v_proj": int(config["num_key_value_heads"]) * head_dim,
    }
    gen = torch.Generator(device="cpu").manual_seed(seed)
    tensors: dict[str, torch.Tensor] = {}
    for layer in range(int(config["num_hidden_layers"])):
        for module in TARGET_MODULES:
            prefix = f"base_model.model.model.layers.{layer}.self_attn.{module}"
            tensors[f"{prefix}.lora_A.weight"] = torch.randn(RANK, hidden, generator=gen) * INIT_STD
            tensors[f"{prefix}.lora_B.weight"] = (
                torch.randn(out_features[module], RANK, generator=gen) * INIT_STD
            )
    out_dir.mkdir(parents=True, exist_ok=True)
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(out_dir / "adapter_model.safetensors"))
    (out_dir / "adapter_config.json").write_text(
        json.dumps(adapter_config(model_dir), indent=2) + "\n", encoding="utf-8"
    )


def write_adapters(out_dir: Path, seeds: Mapping[str, int], model_dir: Path | None = None) -> dict[str, Path]:
    """Write one adapter per name into `out_dir/<name>` with `.venv-vllm`'s Python; {name: adapter dir}."""
    import vllm_env  # the test side only (sys.path has this folder: conftest)

    model = model_dir or vllm_env.MODEL_DIR
    dirs = {name: out_dir / name for name in seeds}
    jobs = [[str(dirs[name]), str(seed)] for name, seed in seeds.items()]
    script = (
        "import json, sys; from pathlib import Path; sys.path.insert(0, sys.argv[1]); import build_lora;"
        "[build_lora.build(Path(sys.argv[2]), Path(d), int(s)) for d, s in json.loads(sys.argv[3])]"
    )
    cmd = [str(vllm_env.VENV_PYTHON), "-c", script, str(Path(__file__).parent), str(model), json.dumps(jobs)]
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise RuntimeError(f"{vllm_env.VENV_PYTHON}: {exc}") from None
    if done.returncode != 0:
        raise RuntimeError(f"exit {done.returncode}: {done.stderr[-2000:]}")
    return dirs


def main(argv: list[str]) -> int:
    if len(argv) != 4:
        print(f"usage: {argv[0]} MODEL_DIR OUT_DIR SEED", file=sys.stderr)
        return 2
    build(Path(argv[1]), Path(argv[2]), int(argv[3]))
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv))
