"""A user's model for the end-to-end tests (tests/integration/), loaded with --user-dir:
``transformer_lm`` with a buffer that each rank sets from its own state at every training
forward, as BatchNorm's running statistics come from each rank's own batches (fairseq's
``--broadcast-buffers`` is off by default). Its values are the rank's number plus one, so a
checkpoint shows whose buffer it holds. It comes after the decoder in the state dict, and
is large, so that its record lies in other ranks' shares of the weights than rank 0's.
"""
import torch
import torch.distributed as dist
from fairseq.models import register_model
from fairseq.models.transformer_lm import TransformerLanguageModel, TransformerLanguageModelConfig

SIZE = 100_000


@register_model("lm_rank_buffers", dataclass=TransformerLanguageModelConfig)
class RankBufferLM(TransformerLanguageModel):
    def __init__(self, decoder):
        super().__init__(decoder)
        self.stats = torch.nn.Module()  # after the decoder in the state dict
        self.stats.register_buffer("rank", torch.zeros(SIZE))

    def forward(self, src_tokens, **kwargs):
        if self.training:
            self.stats.rank.fill_((dist.get_rank() if dist.is_initialized() else 0) + 1)
        return super().forward(src_tokens, **kwargs)
