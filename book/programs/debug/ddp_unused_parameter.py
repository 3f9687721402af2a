"""Bug: a layer of a DDP model takes no part in the loss, so its gradient never arrives.

Run:  torchrun --standalone --nproc-per-node 2 ddp_unused_parameter.py
Fix:  ... ddp_unused_parameter.py --find-unused-parameters   (DDP looks for unused ones every step)
  or  ... ddp_unused_parameter.py --static-graph             (DDP learns the graph in step 1)
"""

import argparse
import datetime

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

TIMEOUT = datetime.timedelta(seconds=5)  # short on purpose; the default is 30 min (gloo), 10 (nccl)
JOIN_TIMEOUT = datetime.timedelta(seconds=120)


def start() -> torch.device:
    """Join torchrun's group on gloo and the CPU, on every machine, GPUs or not.

    What this program shows is gloo's behaviour: a collective that its peers do not join
    raises a RuntimeError on the waiting rank after TIMEOUT. With nccl under torchrun the
    watchdog aborts the process instead (chapter 10, "On real GPUs").
    """
    # Every rank imports torch before it joins, which can take longer than TIMEOUT on a busy
    # machine: the group is joined with a generous timeout, then the short one is set.
    dist.init_process_group("gloo", timeout=JOIN_TIMEOUT)
    dist.set_timeout(TIMEOUT)
    return torch.device("cpu")


class TwoHeads(nn.Module):
    """A classifier with an auxiliary head that this training run does not use."""

    def __init__(self):
        super().__init__()
        self.body = nn.Linear(8, 16)
        self.classifier = nn.Linear(16, 4)
        self.auxiliary = nn.Linear(16, 1)  # parameters 4 and 5 (weight, bias)

    def forward(self, x):
        return self.classifier(torch.relu(self.body(x)))  # the bug: self.auxiliary is never called


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--find-unused-parameters", action="store_true")
    parser.add_argument("--static-graph", action="store_true")
    args = parser.parse_args()
    device = start()
    rank = dist.get_rank()
    torch.manual_seed(0)  # the same initial weights on every rank
    model = DDP(TwoHeads().to(device), find_unused_parameters=args.find_unused_parameters,
                static_graph=args.static_graph)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    generator = torch.Generator().manual_seed(rank)  # each rank its own data
    try:
        for step in range(3):
            x = torch.randn(16, 8, generator=generator).to(device)
            y = torch.randint(0, 4, (16,), generator=generator).to(device)
            loss = nn.functional.cross_entropy(model(x), y)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            # One write per line: torchrun runs python -u, where print() writes the text and the
            # newline separately, and another rank's line can land between the two.
            print(f"[rank {rank}] step {step}: loss {loss.item():.4f}\n", end="", flush=True)
        weight = model.module.classifier.weight.detach().clone()
        replicas = [torch.zeros_like(weight) for _ in range(dist.get_world_size())]
        dist.all_gather(replicas, weight)
        same = all(torch.equal(replicas[0], other) for other in replicas)
        print(f"[rank {rank}] the ranks' classifier weights are identical: {same}\n",
              end="", flush=True)
    except RuntimeError as error:
        print(f"[rank {rank}] RuntimeError: {error}\n", end="", flush=True)
        raise SystemExit(1) from None
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
