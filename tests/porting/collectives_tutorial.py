# The collectives of "Writing Distributed Applications with PyTorch" (point-to-point, all_reduce,
# broadcast, all_gather, scatter), with the backend picked from the device as the current tutorials do; each
# rank saves what it received to argv[1] + its rank.
import sys

import torch
import torch.distributed as dist

device = torch.accelerator.current_accelerator() if torch.accelerator.is_available() else torch.device("cpu")


def run(rank, size):
    results = {}
    tensor = torch.zeros(1, device=device)
    if rank == 0:
        tensor += 1
        dist.send(tensor=tensor, dst=1)
    else:
        dist.recv(tensor=tensor, src=0)
    results["p2p"] = tensor.clone()

    group = dist.new_group([0, 1])
    tensor = torch.ones(3, device=device) * (rank + 1)
    dist.all_reduce(tensor, op=dist.ReduceOp.SUM, group=group)
    results["all_reduce"] = tensor

    tensor = torch.arange(4.0, device=device) + 10 * rank
    dist.broadcast(tensor, src=1)
    results["broadcast"] = tensor

    tensor_list = [torch.zeros(2, dtype=torch.int64, device=device) for _ in range(size)]
    dist.all_gather(tensor_list, torch.arange(2, dtype=torch.int64, device=device) + 1 + 2 * rank)
    results["all_gather"] = torch.stack(tensor_list)

    output = torch.zeros(2, device=device)
    scatter_list = [torch.full((2,), float(i + 7), device=device) for i in range(size)] if rank == 0 else None
    dist.scatter(output, scatter_list, src=0)
    results["scatter"] = output

    objects = [None] * size
    dist.all_gather_object(objects, {"rank": rank, "backend": dist.get_backend()})
    results["objects"] = objects
    results["initialized"] = dist.is_initialized() and dist.is_available()
    results["world_size"] = dist.get_world_size()
    results["launched_by_elastic"] = dist.is_torchelastic_launched()
    torch.save(results, f"{sys.argv[1]}{rank}")


def init_process():
    dist.init_process_group(backend=dist.get_default_backend_for_device(device))
    run(dist.get_rank(), dist.get_world_size())
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    init_process()
