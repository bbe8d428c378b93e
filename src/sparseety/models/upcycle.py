"""``smollm2-moe``: SmolLM2-135M upcycled into a Mixtral-layout mixture of experts, built locally.

No small trained MoE model ships on the package registries, so this one is made from the default model:
every layer's MLP is copied into ``experts`` identical experts and a router picks ``top_k`` of them per
token (softmax, top-k, weights renormalized to sum 1, as Mixtral does). Because the experts are equal and
the kept weights sum to 1, each MoE block returns the dense MLP's output (up to float rounding), so the
greedy text equals SmolLM2's; the routing itself is real and depends on the token: each layer's router
rows are the k-means centroids of that layer's MLP inputs on shipped text (a licence file), so the expert
load is uneven, as in trained MoE models. The checkpoint is a plain Hugging Face ``MixtralForCausalLM``
directory in the legacy expert layout (``block_sparse_moe.experts.E.w1/w2/w3``), which both transformers
and vLLM load.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

EXPERTS = 4  #: experts per MoE layer
TOP_K = 2  #: experts each token is routed to
ROUTER_LOGIT_SCALE = 4.0  #: router logits are ``scale * cos(x, centroid)``: softer than raw dot products
ROUTER_TEXT = Path("/usr/share/common-licenses/GPL-3")  #: the text whose MLP inputs place the centroids
ROUTER_TOKENS = 768  #: tokens of that text used
KMEANS_ITERATIONS = 25


def kmeans_centroids(points: torch.Tensor, k: int, iterations: int = KMEANS_ITERATIONS) -> torch.Tensor:
    """Deterministic k-means on unit directions.

    Parameters
    ----------
    points : ``[n, d]`` float tensor, ``n >= k``.
    k : number of centroids.

    Returns
    -------
    ``[k, d]`` unit-norm centroids. Initialised farthest-first from the point nearest the mean direction,
    so the result depends only on ``points``.
    """
    unit = torch.nn.functional.normalize(points.double(), dim=-1)
    first = int(torch.argmax(unit @ torch.nn.functional.normalize(unit.mean(0), dim=0)))
    chosen = [first]
    for _ in range(1, k):
        similarity = (unit @ unit[chosen].T).max(dim=1).values
        similarity[chosen] = float("inf")
        chosen.append(int(torch.argmin(similarity)))
    centroids = unit[chosen].clone()
    for _ in range(iterations):
        assign = torch.argmax(unit @ centroids.T, dim=1)
        for c in range(k):
            members = unit[assign == c]
            if len(members):
                centroids[c] = torch.nn.functional.normalize(members.mean(0), dim=0)
    return centroids.float()


def mlp_inputs(model: torch.nn.Module, input_ids: torch.Tensor) -> list[torch.Tensor]:
    """Per decoder layer, the MLP's input (the post-attention norm's output), ``[tokens, hidden]`` each."""
    captured: list[torch.Tensor] = []
    hooks = [
        layer.post_attention_layernorm.register_forward_hook(lambda _m, _i, out: captured.append(out[0].detach()))
        for layer in model.model.layers
    ]
    try:
        with torch.no_grad():
            model(input_ids=input_ids)
    finally:
        for hook in hooks:
            hook.remove()
    return captured


def router_weights(model: torch.nn.Module, tokenizer, text: str) -> list[torch.Tensor]:
    """Per layer, the ``[EXPERTS, hidden]`` router matrix placed on ``text``'s MLP inputs."""
    ids = tokenizer(text, return_tensors="pt").input_ids[:, :ROUTER_TOKENS]
    weights = []
    for inputs in mlp_inputs(model, ids):
        typical = float(inputs.norm(dim=-1).median())
        weights.append(kmeans_centroids(inputs, EXPERTS) * (ROUTER_LOGIT_SCALE / typical))
    return weights


def mixtral_config(llama: dict) -> dict:
    """A Mixtral ``config.json`` with the Llama model's shapes, ``EXPERTS`` experts and top-``TOP_K`` routing."""
    keep = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
            "num_key_value_heads", "head_dim", "hidden_act", "max_position_embeddings", "rms_norm_eps",
            "bos_token_id", "eos_token_id", "pad_token_id", "tie_word_embeddings", "initializer_range")
    config = {key: llama[key] for key in keep if key in llama}
    rope = llama.get("rope_parameters") or {"rope_theta": llama.get("rope_theta", 10000.0), "rope_type": "default"}
    config.update(architectures=["MixtralForCausalLM"], model_type="mixtral", num_local_experts=EXPERTS,
                  num_experts_per_tok=TOP_K, sliding_window=None, attention_dropout=0.0, router_jitter_noise=0.0,
                  output_router_logits=False, rope_parameters=rope, rope_theta=rope["rope_theta"], dtype="float32",
                  use_cache=True)
    return config


def upcycle(base_dir: Path, target: Path) -> Path:
    """Write ``smollm2-moe`` into ``target`` from the converted SmolLM2 directory ``base_dir``.

    Written into a temporary sibling and renamed, so an interrupted build never leaves half a model.
    """
    import shutil

    from safetensors.torch import load_file, save_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(base_dir, local_files_only=True)
    model = AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32, local_files_only=True).eval()
    routers = router_weights(model, tokenizer, ROUTER_TEXT.read_text(encoding="utf-8"))
    del model
    dense = load_file(str(base_dir / "model.safetensors"))
    tensors: dict[str, torch.Tensor] = {}
    for name, tensor in dense.items():
        if ".mlp." not in name:
            tensors[name] = tensor
            continue
        prefix, proj = name.split(".mlp.")
        legacy = {"gate_proj.weight": "w1.weight", "down_proj.weight": "w2.weight", "up_proj.weight": "w3.weight"}[proj]
        for expert in range(EXPERTS):
            tensors[f"{prefix}.block_sparse_moe.experts.{expert}.{legacy}"] = tensor.clone()
    for layer, weight in enumerate(routers):
        tensors[f"model.layers.{layer}.block_sparse_moe.gate.weight"] = weight.contiguous()
    staging = target.with_name(target.name + ".partial")
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir(parents=True)
    save_file(tensors, str(staging / "model.safetensors"), metadata={"format": "pt"})
    llama = json.loads((base_dir / "config.json").read_text())
    (staging / "config.json").write_text(json.dumps(mixtral_config(llama), indent=2) + "\n")
    for extra in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "generation_config.json"):
        if (base_dir / extra).is_file():
            shutil.copy2(base_dir / extra, staging / extra)
    shutil.rmtree(target, ignore_errors=True)
    staging.rename(target)
    return target
