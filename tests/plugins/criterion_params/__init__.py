"""A user's criterion for the end-to-end tests (tests/integration/), loaded with --user-dir:
cross-entropy of the model's logits times a learned scale plus a learned bias per word, so
that the criterion has parameters of its own, which fairseq's Trainer wraps for
data-parallel training and gives to the optimizer beside the model's."""
import torch
import torch.nn.functional as F
from fairseq.criterions import register_criterion
from fairseq.criterions.cross_entropy import CrossEntropyCriterion, CrossEntropyCriterionConfig


@register_criterion("scaled_cross_entropy", dataclass=CrossEntropyCriterionConfig)
class ScaledCrossEntropy(CrossEntropyCriterion):
    def __init__(self, task, sentence_avg):
        super().__init__(task, sentence_avg)
        self.scale = torch.nn.Parameter(torch.ones(1))
        self.bias = torch.nn.Parameter(torch.zeros(len(task.target_dictionary)))

    def compute_loss(self, model, net_output, sample, reduce=True):
        logits = net_output[0] * self.scale + self.bias
        lprobs = F.log_softmax(logits.float(), dim=-1).view(-1, logits.size(-1))
        target = model.get_targets(sample, net_output).view(-1)
        loss = F.nll_loss(lprobs, target, ignore_index=self.padding_idx, reduction="sum" if reduce else "none")
        return loss, loss
