"""apply_ddp on one gloo rank: the summing comm hook and no deprecation noise per run."""

from __future__ import annotations

import warnings

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

from scaletrain.parallel.ddp import apply_ddp


def test_ddp_wrap_prints_no_deprecation_warning() -> None:
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        mesh = init_device_mesh("cpu", (1,))
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            ddp = apply_ddp(torch.nn.Linear(4, 2), mesh, 25.0)
        assert not [w for w in seen if issubclass(w.category, FutureWarning)], \
            [str(w.message) for w in seen]
        x = torch.ones(3, 4)
        ddp(x).sum().backward()  # one rank: the summed gradient is the local one
        torch.testing.assert_close(ddp.module.weight.grad, torch.full((2, 4), 3.0))
    finally:
        dist.destroy_process_group()
