"""The fleet the pooling-model tests run against: a generative model on one simulated pool and an embedding
model (`runner: pooling`, vLLM's `--runner pooling`) on another of two workers."""

from __future__ import annotations

from server.config import MosaicConfig, validate_config

CHAT, EMBED = "llama-3-8b", "embed-mistral"
HIDDEN = 4096  # the catalog's mistral-7b hidden size: the simulated worker's embedding dimension
CONTEXT = 64  # the embedding model's max_model_len


def pooling_fleet() -> MosaicConfig:
    def sim(replicas: int, seed: int) -> dict[str, object]:
        return {"simulated": {"replicas": replicas, "time_scale": 200.0, "seed": seed}}

    return validate_config(
        {
            "models": [{"name": CHAT}, {"name": EMBED, "spec": "mistral-7b", "max_model_len": CONTEXT}],
            "pools": [
                {"name": "chat-l4", "model": CHAT, "gpu": "L4", "endpoints": sim(1, 0)},
                {
                    "name": "embed-l4",
                    "model": EMBED,
                    "gpu": "L4",
                    "runner": "pooling",
                    "endpoints": sim(2, 10),
                },
            ],
            "limits": {"queue_deadline_s": 2},
        },
        "test",
    )
