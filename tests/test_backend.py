"""``torch.distributed.backend`` names the real backend when torch's own answer is ``undefined``."""

import os

import torch.distributed as dist

from commdebug_otel import semconv

from distributed import free_port, run_ranks


def _backends(rank, world_size):
    """The backend as seen by our resource, for groups made without naming a backend."""
    from torch.distributed.device_mesh import init_device_mesh

    from commdebug_otel.capture.ops import backend_name
    from commdebug_otel.core.job_identity import rank_info
    from commdebug_otel.otel.telemetry import build_resource

    seen = {"named": (str(dist.get_backend()), rank_info().backend)}
    dist.destroy_process_group()
    store = dist.TCPStore("127.0.0.1", free_port(), world_size, is_master=True)
    dist.init_process_group(store=store, rank=rank, world_size=world_size)  # no backend: one per device
    seen["default"] = (str(dist.get_backend()), rank_info().backend,
                       build_resource(rank_info()).attributes[semconv.BACKEND])
    dist.destroy_process_group()
    os.environ["MASTER_PORT"] = str(free_port())
    mesh = init_device_mesh("cpu", (world_size,), mesh_dim_names=("tp",))  # initializes the world group itself
    seen["mesh"] = (str(dist.get_backend()), rank_info().backend, backend_name(mesh.get_group("tp")))
    return seen


def test_backend_is_resolved_per_device_when_torch_says_undefined():
    assert run_ranks(_backends, 1) == [{
        "named": ("gloo", "gloo"),
        "default": ("undefined", "gloo", "gloo"),  # get_backend_config() is "cpu:gloo" on a CPU-only host
        "mesh": ("undefined", "gloo", "gloo"),
    }]


def test_several_backends_are_listed_per_device(monkeypatch):
    from commdebug_otel.capture.ops import backend_name

    monkeypatch.setattr(dist, "get_backend", lambda group=None: "undefined")
    monkeypatch.setattr(dist, "get_backend_config", lambda group=None: "cpu:gloo,cuda:nccl")
    assert backend_name() == "cpu:gloo,cuda:nccl"
    monkeypatch.setattr(dist, "get_backend_config", lambda group=None: "cpu:gloo,cuda:gloo")
    assert backend_name() == "gloo"
