"""Backend names as torch users write them: "gloo", "nccl", device maps, `Backend`, and the helpers
(get_default_backend_for_device, get_backend, is_*_available, device_id)."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as torch_dist

import spmd
from spmd.comm.backend import transport_for
from spmd.comm.world import default_group
from spmd.testing import run_ranks

NCCL_USABLE = torch.cuda.is_available() and torch_dist.is_nccl_available()


def test_backend_constants_match_torch() -> None:
    for name in ("GLOO", "NCCL", "MPI", "UCC", "FAKE", "UNDEFINED"):
        assert getattr(spmd.Backend, name) == getattr(torch_dist.Backend, name)
    assert spmd.Backend("GLOO") == torch_dist.Backend("GLOO") == "gloo"
    assert spmd.Backend("cpu:gloo,cuda:nccl") == torch_dist.Backend("cpu:gloo,cuda:nccl")
    for device in ("cpu", "cuda"):
        assert spmd.Backend.default_device_backend_map[device] == torch_dist.Backend.default_device_backend_map[device]
    with pytest.raises(ValueError, match="must be a string"):
        spmd.Backend(3)  # type: ignore[arg-type]


@pytest.mark.parametrize("device", ["cpu", "cuda", "cuda:1", torch.device("cpu"), torch.device("cuda", 0)])
def test_default_backend_for_device_matches_torch(device: str | torch.device) -> None:
    assert spmd.get_default_backend_for_device(device) == torch_dist.get_default_backend_for_device(device)


def test_default_backend_for_unknown_device() -> None:
    with pytest.raises(ValueError, match="no default backend for device type 'quantum'"):
        spmd.get_default_backend_for_device("quantum")


@pytest.mark.parametrize(("name", "transport"), [
    ("gloo", "auto"), ("GLOO", "auto"), (" Gloo ", "auto"), (None, "auto"), ("auto", "auto"), ("tcp", "tcp"),
    ("SHM", "shm"), ("cpu:gloo", "cpu:auto"), ("cpu:tcp", "cpu:tcp"), ("CPU:SHM", "cpu:shm"),
])
def test_names_translate_to_transports(name: str | None, transport: str) -> None:
    assert transport_for(name) == transport


def test_availability_helpers() -> None:
    assert spmd.is_available() and spmd.is_gloo_available()
    assert not spmd.is_mpi_available()
    assert spmd.is_nccl_available() is (torch_dist.is_nccl_available() and "torch:nccl" in
                                        spmd.comm.transports.base.available_backends())


def test_torchelastic_launched_reads_the_launchers_variable(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("TORCHELASTIC_RUN_ID", raising=False)
    assert not spmd.is_torchelastic_launched()
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "job")
    assert spmd.is_torchelastic_launched()


@pytest.mark.skipif(NCCL_USABLE, reason="nccl is usable here")
@pytest.mark.parametrize("name", ["nccl", "NCCL", "cpu:gloo,cuda:nccl"])
def test_nccl_without_cuda_says_why_and_what_instead(name: str) -> None:
    with pytest.raises(RuntimeError) as caught:
        spmd.init_process_group(name, store=spmd.HashStore(), rank=0, world_size=1)
    message = str(caught.value)
    assert "'nccl'" in message and "backend='gloo'" in message
    if not torch.cuda.is_available():
        assert "torch.cuda.is_available() is False" in message
    if not torch_dist.is_nccl_available():
        assert "built without NCCL" in message
    assert not spmd.is_initialized()


def test_mpi_is_refused_clearly() -> None:
    with pytest.raises(RuntimeError, match=r"'mpi' is not available.*use backend='gloo'"):
        spmd.init_process_group("mpi", store=spmd.HashStore(), rank=0, world_size=1)


@pytest.mark.parametrize(("name", "why"), [
    ("bogus", "unknown backend 'bogus'"), ("cpu:gloo,cpu:tcp", "names device type 'cpu' twice"),
    ("cpu:gloo,gpu:nccl", "entry 'gpu:nccl' must be '<device type>:<backend>'"), ("cpu:", "must be"),
    ("cpu:bogus", "unknown backend 'bogus'"), ("ucc", "'ucc' is not supported"),
])
def test_bad_names_are_refused_before_any_rendezvous(name: str, why: str) -> None:
    with pytest.raises((ValueError, RuntimeError), match=why):
        spmd.init_process_group(name, init_method="tcp://127.0.0.1:1", rank=0, world_size=2)


def test_gloo_runs_on_spmds_fastest_cpu_transport_and_get_backend_prints_gloo() -> None:
    def body(rank: int, world_size: int) -> tuple[str, str, float]:
        t = torch.tensor([rank + 1.0])
        spmd.all_reduce(t)
        return spmd.get_backend(), default_group().transport.name, t.item()

    assert run_ranks(body, world_size=2, timeout=60, backend="GLOO") == [("gloo", "shm", 3.0)] * 2


def test_spmd_names_keep_printing_the_transport() -> None:
    def body(rank: int, world_size: int) -> str:
        return spmd.get_backend()

    assert run_ranks(body, world_size=2, timeout=60, backend="tcp") == ["tcp", "tcp"]


def test_new_group_accepts_torch_names() -> None:
    def body(rank: int, world_size: int) -> tuple[str, str, float]:
        group = spmd.new_group([0, 1], backend="Gloo")
        t = torch.tensor([float(rank)])
        spmd.all_reduce(t, group=group)
        return spmd.get_backend(group), group.transport.name, t.item()

    assert run_ranks(body, world_size=2, timeout=60) == [("gloo", "shm", 1.0)] * 2


@pytest.mark.parametrize(("device_map", "transport"), [
    ("cpu:gloo", "cpu:shm"), ("cpu:tcp", "cpu:tcp"), ("CPU:SHM", "cpu:shm"), ("cpu:threads", "cpu:threads"),
])
def test_device_map_group_runs_every_op_kind_on_its_cpu_entry(device_map: str, transport: str) -> None:
    def body(rank: int, world_size: int) -> tuple[str, str, list[float], list[float], float, list[float]]:
        t = torch.tensor([rank + 1.0, 10.0])
        spmd.all_reduce(t)
        gathered = torch.empty(4)
        spmd.all_gather_into_tensor(gathered, torch.tensor([rank, rank + 0.5]))
        sent = torch.tensor([float(rank)])
        if rank == 0:
            spmd.send(torch.tensor([42.0]), dst=1)
        else:
            spmd.recv(sent, src=0)
        objects = [None, None]
        spmd.all_gather_object(objects, {"rank": rank})
        spmd.barrier()
        return (spmd.get_backend(), default_group().transport.name, t.tolist(), gathered.tolist(), sent.item(),
                [o["rank"] for o in objects])

    results = run_ranks(body, world_size=2, timeout=60, backend=device_map)
    expected_name = device_map.lower() if "gloo" in device_map else transport
    assert results[0] == (expected_name, transport, [3.0, 20.0], [0.0, 0.5, 1.0, 1.5], 0.0, [0, 1])
    assert results[1][3:] == ([0.0, 0.5, 1.0, 1.5], 42.0, [0, 1])


def test_device_map_entry_whose_transport_cannot_move_its_device_is_refused() -> None:
    def body(rank: int, world_size: int) -> None:
        spmd.new_group([0, 1], backend="cpu:tcp,cuda:tcp")

    with pytest.raises(ValueError, match="'cuda:tcp': the tcp transport moves only cpu tensors, not cuda"):
        run_ranks(body, world_size=2, timeout=60)


def test_device_map_refuses_ops_on_devices_it_has_no_entry_for_and_mixed_devices() -> None:
    from spmd.comm.transports.device_map import DeviceMapTransport

    def body(rank: int, world_size: int) -> list[str]:
        group = spmd.new_group([0, 1], backend="cpu:gloo")
        transport = group.transport
        assert isinstance(transport, DeviceMapTransport)
        errors = []
        for tensors in ((torch.empty(2, device="meta"),), (torch.empty(4), torch.empty(2, device="meta"))):
            try:
                transport._for("all_gather", *tensors)
            except ValueError as error:
                errors.append(str(error))
        return errors

    errors = run_ranks(body, world_size=2, timeout=60)[0]
    assert "no entry for meta" in errors[0]
    assert "mixes tensors on cpu and meta" in errors[1]


def test_device_id_cpu_is_recorded_and_bad_ones_refused() -> None:
    from spmd.comm.world import current_world

    def body(rank: int, world_size: int) -> torch.device | None:
        return current_world().device

    assert run_ranks(body, world_size=1, timeout=30) == [None]
    spmd.init_process_group("gloo", store=spmd.HashStore(), rank=0, world_size=1, device_id=torch.device("cpu"))
    try:
        assert current_world().device == torch.device("cpu")
    finally:
        spmd.destroy_process_group()
    with pytest.raises(TypeError, match=r"device_id must be a torch\.device or an int"):
        spmd.init_process_group("gloo", store=spmd.HashStore(), rank=0, world_size=1, device_id="cpu")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="not mps"):
        spmd.init_process_group("gloo", store=spmd.HashStore(), rank=0, world_size=1, device_id=torch.device("mps"))


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
def test_device_id_on_a_cuda_device_without_cuda_says_so() -> None:
    for device_id in (0, torch.device("cuda", 0)):
        with pytest.raises(ValueError, match=r"torch\.cuda\.is_available\(\) is False"):
            spmd.init_process_group("gloo", store=spmd.HashStore(), rank=0, world_size=1, device_id=device_id)
    assert not spmd.is_initialized()


def test_init_device_mesh_backend_override_builds_that_dims_groups_on_the_named_backend() -> None:
    from spmd.device_mesh import init_device_mesh

    def body(rank: int, world_size: int) -> tuple[str, str, str, str, float]:
        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"), backend_override={"tp": "GLOO"})
        t = torch.tensor([float(rank)])
        spmd.all_reduce(t, group=mesh.get_group("tp"))
        plain = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
        return (spmd.get_backend(mesh.get_group("tp")), mesh.get_group("tp").transport.name,
                spmd.get_backend(mesh["dp"].get_group()), spmd.get_backend(plain.get_group("tp")), t.item())

    results = run_ranks(body, world_size=4, timeout=60)
    assert [r[4] for r in results] == [1.0, 1.0, 5.0, 5.0]
    assert {r[:4] for r in results} == {("gloo", "shm", "threads", "threads")}


@pytest.mark.parametrize(("override", "why"), [
    ({"pp": "gloo"}, "keys \\['pp'\\] are not dims"), ({0: "gloo", "dp": "tcp"}, "names dim 0 twice"),
])
def test_init_device_mesh_bad_backend_override(override: dict, why: str) -> None:
    from spmd.device_mesh import init_device_mesh

    def body(rank: int, world_size: int) -> None:
        init_device_mesh("cpu", (2,), mesh_dim_names=("dp",), backend_override=override)

    with pytest.raises(ValueError, match=why):
        run_ranks(body, world_size=2, timeout=60)


@pytest.mark.skipif(NCCL_USABLE, reason="nccl is usable here")
def test_a_refused_new_group_leaves_the_world_as_it_was() -> None:
    def body(rank: int, world_size: int) -> tuple[str, int]:
        with pytest.raises(RuntimeError, match="'nccl'"):
            spmd.new_group([0, 1], backend="nccl")
        group = spmd.new_group([0, 1], backend="tcp")
        t = torch.tensor([1.0])
        spmd.all_reduce(t, group=group)
        return spmd.get_backend(group), int(t.item())

    assert run_ranks(body, world_size=2, timeout=60) == [("tcp", 2)] * 2


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_device_id_binds_the_rank_to_its_cuda_device() -> None:
    from spmd.comm.world import current_world

    index = torch.cuda.device_count() - 1
    spmd.init_process_group("gloo", store=spmd.HashStore(), rank=0, world_size=1, device_id=index)
    try:
        assert current_world().device == torch.device("cuda", index)
        assert torch.cuda.current_device() == index
    finally:
        spmd.destroy_process_group()
