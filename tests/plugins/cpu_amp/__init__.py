"""--amp with a working loss scaler on CPU, for tests/integration/test_fairseq_precision.py
(loaded with --user-dir, by adam's runs and oss_adam's alike).

fairseq's AMPOptimizer builds ``torch.cuda.amp.GradScaler``, which turns itself off where
there is no CUDA: ``scale()`` returns the loss as it is and nothing is unscaled or checked.
This plugin gives fairseq torch's CPU GradScaler instead, with fairseq's arguments, so that
a CPU run scales the loss, unscales the gradients, finds infs, skips steps and moves the
scale as a GPU run does (fairseq's autocast is CUDA's and stays off on CPU: the arithmetic
is fp32's).
"""
import functools

import torch
from fairseq.optim import amp_optimizer

if not torch.cuda.is_available():
    amp_optimizer.torch.cuda.amp.GradScaler = functools.partial(torch.amp.GradScaler, "cpu")


# An inf in one parameter's gradient, on one rank, at one forward: the criterion
# ``cross_entropy_inf_grad`` adds ``1e38 * p.sum()`` for the model's last parameter on rank
# ``--inf-grad-rank`` at its ``--inf-grad-call``-th forward (counted from 1), which any
# loss scale above 4 makes an inf in that parameter's gradient alone. Under the
# reduce-scatter that inf lands in one rank's shard: every rank must skip the step with it.
from dataclasses import dataclass, field  # noqa: E402

import torch.distributed as dist  # noqa: E402
from fairseq.criterions import register_criterion  # noqa: E402
from fairseq.criterions.cross_entropy import CrossEntropyCriterion, CrossEntropyCriterionConfig  # noqa: E402


@dataclass
class InfGradConfig(CrossEntropyCriterionConfig):
    inf_grad_call: int = field(default=0, metadata={"help": "the forward (from 1) that makes an inf gradient"})
    inf_grad_rank: int = field(default=0, metadata={"help": "the rank that makes it"})


@register_criterion("cross_entropy_inf_grad", dataclass=InfGradConfig)
class CrossEntropyInfGrad(CrossEntropyCriterion):
    def __init__(self, task, sentence_avg, inf_grad_call, inf_grad_rank):
        super().__init__(task, sentence_avg)
        self.inf_grad_call, self.inf_grad_rank, self.calls = inf_grad_call, inf_grad_rank, 0

    def forward(self, model, sample, reduce=True):
        loss, sample_size, logging_output = super().forward(model, sample, reduce)
        self.calls += 1
        rank = dist.get_rank() if dist.is_initialized() else 0
        if self.calls == self.inf_grad_call and rank == self.inf_grad_rank:
            loss = loss + 1e38 * list(model.parameters())[-1].sum()
        return loss, sample_size, logging_output
