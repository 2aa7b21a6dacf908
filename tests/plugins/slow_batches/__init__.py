"""A user's task for tests/integration/test_fairseq_exit.py, loaded with --user-dir: the
language model's task, whose training batches take long to make once the first few are
made (``SLOW_AFTER`` batches, then ``SLOW_S`` seconds of torch ops each, as a heavy
collater's would), so that fairseq's background batch thread is inside a torch op when
training ends, whatever the machine's speed.
"""
import os
import time

import torch
from fairseq.data import BaseWrapperDataset
from fairseq.tasks import register_task
from fairseq.tasks.language_modeling import LanguageModelingConfig, LanguageModelingTask

SLOW_AFTER = int(os.environ.get("SLOW_AFTER", "4"))
SLOW_S = float(os.environ.get("SLOW_S", "2"))


class SlowCollater(BaseWrapperDataset):
    def __init__(self, dataset):
        super().__init__(dataset)
        self.made = 0

    def collater(self, samples):
        batch = super().collater(samples)
        self.made += 1
        if self.made > SLOW_AFTER:
            a = torch.rand(256, 256)
            end = time.monotonic() + SLOW_S
            while time.monotonic() < end:  # inside a torch op (the GIL released) nearly all the time
                torch.mm(a, a)
        return batch


@register_task("lm_slow_batches", dataclass=LanguageModelingConfig)
class SlowBatches(LanguageModelingTask):
    def load_dataset(self, split, epoch=1, combine=False, **kwargs):
        super().load_dataset(split, epoch=epoch, combine=combine, **kwargs)
        if split == "train":  # fairseq-train's default --train-subset
            self.datasets[split] = SlowCollater(self.datasets[split])
