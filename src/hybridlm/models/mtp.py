"""The multi-token-prediction (MTP) head of Qwen3.5 and Qwen3-Next checkpoints (`mtp.*` tensors).

Published structure (the heads vLLM and SGLang run as drafters): for position i the head reads the
target's final-normed hidden state h_i and the embedding of token i+1, RMS-normalises each
(`pre_fc_norm_hidden`, `pre_fc_norm_embedding`), concatenates them embedding first, projects 2d -> d
(`fc`), runs one full-attention decoder layer (`layers.0`, the family's gated attention with its own
KV cache) and its own final norm (`norm`); the target's LM head turns the result into logits for
token i+2. The head's output hidden state stands in for h at the next position when it drafts
further ahead. Embedding and LM head are the target's: the checkpoint holds only the rest.
"""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

from hybridlm.batch import Batch
from hybridlm.cache.kv import KVCache
from hybridlm.models.checkpoint import CheckpointError, check_tensors, read_tensors, weight_files
from hybridlm.models.fused import fuse_projections
from hybridlm.ops.linear import Linear

# Config fields naming the number of MTP layers: Qwen3.5, Qwen3-Next.
LAYER_COUNT_FIELDS = ("mtp_num_hidden_layers", "num_nextn_predict_layers")


class MTPHead(nn.Module):
    """The head's own weights, named as in the checkpoint without the `mtp.` prefix.

    layer: the decoder layer (`layers.0`); norm: the family's RMSNorm class (Qwen: zero-centred).
    """

    def __init__(self, layer: nn.Module, norm: type[nn.Module], hidden: int, eps: float):
        super().__init__()
        self.pre_fc_norm_embedding = norm(hidden, eps=eps)
        self.pre_fc_norm_hidden = norm(hidden, eps=eps)
        self.fc = Linear(2 * hidden, hidden, bias=False)
        self.layers = nn.ModuleList([layer])
        self.norm = norm(hidden, eps=eps)

    @property
    def dtype(self) -> torch.dtype:
        return self.fc.weight.dtype

    @property
    def device(self) -> torch.device:
        return self.fc.weight.device

    def make_cache(self) -> KVCache:
        """The KV cache of the head's attention layer (B = 1)."""
        return self.layers[0].make_cache(1, self.dtype, self.device)

    @torch.no_grad()
    def forward(
        self, embeds: torch.Tensor, hidden: torch.Tensor, batch: Batch, cache: KVCache
    ) -> torch.Tensor:
        """embeds: [B, L, d] embeddings of tokens i+1; hidden: [B, L, d] hidden states at positions i
        (the batch's positions) -> [B, L, d] the head's final-normed hidden states; advances `cache`."""
        x = torch.cat([self.pre_fc_norm_embedding(embeds), self.pre_fc_norm_hidden(hidden)], dim=-1)
        return self.norm(self.layers[0](self.fc(x), batch, cache))


def load_mtp_head(path: str | Path, target) -> MTPHead:
    """The MTP head of the checkpoint directory `path` that `target` (a loaded `CausalLM`) was loaded
    from, in the target's dtype and on its device. Raises `CheckpointError` when the family has no
    MTP head, the checkpoint holds no `mtp.*` tensors, or any tensor is missing or misshapen."""
    root = Path(path)
    config = target.config
    with torch.device("meta"):
        head = target.mtp_head()
    if head is None:
        raise CheckpointError(
            f"{root}: model_type {config.get('model_type')!r} has no multi-token-prediction head "
            "(MTP heads: qwen3_5, qwen3_5_text, qwen3_next, qwen3_5_moe, qwen3_5_moe_text)"
        )
    layers = next((config[f] for f in LAYER_COUNT_FIELDS if f in config), 1)
    if layers != 1:
        raise CheckpointError(f"{root}: the config asks for {layers} MTP layers; hybridlm runs heads of one")
    state, source = read_tensors(weight_files(root), lambda name: name if name.startswith("mtp.") else None)
    if not state:
        raise CheckpointError(
            f"{root}: no mtp.* tensors: this checkpoint carries no multi-token-prediction head "
            "(some conversions and quantizations drop it)"
        )
    # The family's conversion knows the layouts of its checkpoints, the head's layer included.
    state = type(target).convert(state, config)
    check_tensors(state, {f"mtp.{k}": v.shape for k, v in head.state_dict().items()}, source, root)
    state = {k.removeprefix("mtp."): v.to(device=target.device, dtype=target.dtype) for k, v in state.items()}
    head.load_state_dict(state, assign=True)
    return fuse_projections(head.eval())
