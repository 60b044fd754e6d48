"""The torch tests share two cores with other work: one thread each keeps them quick and steady."""

import torch

torch.set_num_threads(1)
