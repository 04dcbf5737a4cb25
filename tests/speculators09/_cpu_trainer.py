"""``speculators train`` (speculators 0.9.0, unmodified) on a machine with no accelerator.

Run with speculators' own Python: ``python _cpu_trainer.py <speculators train flags>``.
speculators 0.9's Trainer moves the draft to torch device ``local_rank`` (an accelerator
index) and its step timer calls ``torch.accelerator.synchronize()``; with no accelerator
both raise. Here the first is the CPU and the second does nothing; the trainer, dataset,
hidden-state transfer, model and loss are speculators' own.
"""

import sys

import torch

import speculators.train.trainer as trainer
from speculators.train.cli import main
from speculators.train.config import TrainConfig

if not torch.accelerator.is_available():
    trainer.get_local_rank = lambda: "cpu"
    torch.accelerator.synchronize = lambda device=None: None

main(TrainConfig.resolve(sys.argv[1:]))
