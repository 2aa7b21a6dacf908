"""ParamExchange's waits from several threads: a copy or a pickle of a parameter waits on
the thread that makes it, while the training thread may be waiting for the same
parameter. A wait must return only once the parameter has arrived, whichever thread
received it.

The exchange is a one-rank one with a message put in flight by hand, whose ``wait``
blocks until the test lets it land, so the interleaving is fixed, not raced.
"""
import threading

import pytest
import torch

from fairseq_oss.optim.param_exchange import _PointToPoint
from fairseq_oss.optim.sharded_adam import ShardedAdam


class HeldMessage:
    """A receive in flight into ``param``: its ``wait`` blocks until :attr:`land` is set,
    then writes ``value`` into the parameter (the message arriving)."""

    def __init__(self, param, value):
        self.param, self.value = param, value
        self.waiting, self.land = threading.Event(), threading.Event()

    def wait(self):
        self.waiting.set()
        assert self.land.wait(60), "the test never let the message land"
        with torch.no_grad():
            self.param.fill_(self.value)
        return True


@pytest.mark.parametrize("second_wait", ["wait", "wait_all"])
def test_a_second_thread_waits_until_the_first_has_received_the_parameter(second_wait):
    p = torch.nn.Parameter(torch.zeros(4))
    exchange = ShardedAdam([p]).param_exchange
    message = HeldMessage(p, 2.0)
    exchange._in_flight[0] = _PointToPoint({0: [message]}, [])
    exchange.unread.add(0)

    first = threading.Thread(target=exchange.wait, args=(0,), daemon=True)
    first.start()
    assert message.waiting.wait(60)  # the first thread is receiving it
    seen = []
    wait = (lambda: exchange.wait(0)) if second_wait == "wait" else exchange.wait_all
    second = threading.Thread(target=lambda: (wait(), seen.append(p.detach().clone())), daemon=True)
    second.start()
    second.join(0.5)
    still_waiting = second.is_alive() and not seen  # the parameter has not arrived
    message.land.set()
    assert still_waiting
    first.join(60)
    second.join(60)
    assert not first.is_alive() and not second.is_alive()
    assert torch.equal(seen[0], torch.full((4,), 2.0))  # what arrived, not what was there before
    assert not exchange.unread
