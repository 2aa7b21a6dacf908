"""A user's task for the end-to-end tests (tests/integration/), loaded with --user-dir: it
reads every parameter through ``p.data`` right after fairseq's optimizer step (outside any
module, as a user's code may), then again once oss_adam's exchange of them is surely
done, and appends to ``READS_OUT/rank<R>.jsonl`` one line per update: whether the
exchange still had pieces in flight at the first read, and whether the two reads agree.
"""
import json
import os

import torch
import torch.distributed as dist
from fairseq.tasks import register_task
from fairseq.tasks.language_modeling import LanguageModelingConfig, LanguageModelingTask


@register_task("lm_reads_after_step", dataclass=LanguageModelingConfig)
class ReadsAfterStep(LanguageModelingTask):
    def optimizer_step(self, optimizer, model, update_num):
        super().optimizer_step(optimizer, model, update_num)
        sharded = getattr(optimizer, "optimizer", None)  # oss_adam's ShardedAdam
        exchange = getattr(sharded, "param_exchange", None)
        in_flight = exchange is not None and bool(exchange.unread)
        early = [p.data.clone() for p in model.parameters()]
        if exchange is not None:
            exchange.wait_all()
        late = [p.data.clone() for p in model.parameters()]
        rank = dist.get_rank() if dist.is_initialized() else 0
        with open(os.path.join(os.environ["READS_OUT"], f"rank{rank}.jsonl"), "a") as f:
            f.write(json.dumps({"update": update_num, "in_flight": in_flight,
                                "same": all(torch.equal(a, b) for a, b in zip(early, late))}) + "\n")
