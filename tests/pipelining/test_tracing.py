"""The tracing front end cuts a model as torch's does: `pipeline` at `pipe_split()` marks or a `split_spec` gives
the stages torch's `pipeline` gives (the same parameters under the same names, the same outputs), the pipe runs
as the model does (values a later stage needs travel through the stages between), and stages built from it train
on thread ranks to the same losses and parameters as one process, for a single-stage and a multi-stage schedule.

Also: keyword inputs, dict outputs, buffers updated in place, tied weights copied per stage, marks that would
leave a stage empty, the device written into the graph, and the models and specs that must be refused."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed.pipelining as torch_pipelining
from examples.gpt import GPT
from torch import Tensor, nn

from spmd.pipelining import (
    Pipe,
    PipelineStage,
    Schedule1F1B,
    ScheduleGPipe,
    ScheduleInterleaved1F1B,
    SplitPoint,
    build_stage,
    pipe_split,
    pipeline,
    stage_to_rank,
)
from spmd.testing import run_ranks
from tests.pipelining.test_runtime import ATOL, RTOL, batch, gpt, reference, train_pipelined

MICROBATCH = 2


def _spec(blocks: int, point: object = SplitPoint.BEGINNING) -> dict[str, object]:
    """A cut before every block but the first: one block per stage (`point` is ours or torch's BEGINNING)."""
    return {f"blocks.{i}": point for i in range(1, blocks)}


def test_the_stages_are_torchs_stages_and_the_pipe_runs_as_the_model() -> None:
    model = gpt(layers=3)
    tokens = batch(0, MICROBATCH)[0]
    ours = pipeline(copy.deepcopy(model), (tokens,), split_spec=_spec(3))
    theirs = torch_pipelining.pipeline(copy.deepcopy(model), (tokens,),
                                      split_spec=_spec(3, torch_pipelining.SplitPoint.BEGINNING))
    assert isinstance(ours, Pipe) and ours.num_stages == theirs.num_stages == 3
    value, expected = tokens, tokens
    for index in range(3):
        mine, torchs = ours.get_stage_module(index), theirs.get_stage_module(index)
        assert [n for n, _ in mine.named_parameters()] == [n for n, _ in torchs.named_parameters()]
        value, expected = mine(value), torchs(expected)
        torch.testing.assert_close(value, expected, rtol=0, atol=0)
    assert sorted(n for i in range(3) for n, _ in ours.get_stage_module(i).named_parameters()) == \
        sorted(n for n, _ in model.named_parameters())
    torch.testing.assert_close(ours(tokens), model(tokens), rtol=0, atol=0)
    with pytest.raises(ValueError, match=r"stage index 3 is out of range for 3 stages"):
        ours.get_stage_module(3)


def test_marks_in_forward_keyword_inputs_a_late_input_dict_outputs_and_buffers() -> None:
    class Marked(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a, self.norm, self.b = nn.Linear(4, 4), nn.BatchNorm1d(4), nn.Linear(4, 4)

        def forward(self, x: Tensor, mask: Tensor | None = None) -> dict[str, Tensor]:
            h = self.a(x).relu()
            pipe_split()
            h = self.norm(h) + torch.arange(4.0)
            pipe_split()
            return {"out": self.b(h) * mask, "total": h.sum()}

    torch.manual_seed(0)
    model, x, mask = Marked(), torch.randn(3, 4), torch.rand(3, 4)
    reference_model = copy.deepcopy(model)
    pipe = pipeline(model, (x,), {"mask": mask})
    assert pipe.num_stages == 3 and pipe.replicated_params == []
    assert [n for n, _ in pipe.get_stage_module(1).named_buffers()] == \
        ["norm.running_mean", "norm.running_var", "norm.num_batches_tracked"]
    first, middle = pipe.get_stage_module(0)(x, mask=mask), pipe.get_stage_module(1)
    assert isinstance(first, tuple) and first[0] is mask            # the mask travels to the stage that uses it
    got, want = pipe(x, mask=mask), reference_model(x, mask=mask)
    assert sorted(got) == ["out", "total"]
    for key in got:
        torch.testing.assert_close(got[key], want[key])
    torch.testing.assert_close(middle.norm.running_mean, reference_model.norm.running_mean)
    assert model.norm.num_batches_tracked.item() == reference_model.norm.num_batches_tracked.item() == 1
    assert pipe(x, mask=mask)["out"].grad_fn is not None


def test_marks_that_would_leave_a_stage_empty_are_dropped() -> None:
    model = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 4), nn.ReLU())
    x = torch.randn(3, 4)
    spec = {"0": SplitPoint.BEGINNING, "1": SplitPoint.END, "2": SplitPoint.BEGINNING, "3": SplitPoint.END}
    pipe = pipeline(model, (x,), split_spec=spec)
    assert pipe.num_stages == 2          # leading, doubled and trailing marks dropped
    assert [[n for n, _ in pipe.get_stage_module(i).named_parameters()] for i in range(2)] == \
        [["0.weight", "0.bias"], ["2.weight", "2.bias"]]
    assert all("forward" not in vars(layer) for layer in model)         # the model is left as it was
    torch.testing.assert_close(pipe(x), model(x), rtol=0, atol=0)


def test_tied_weights_are_copied_into_each_stage_that_uses_them() -> None:
    class Tied(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.embed, self.mid = nn.Embedding(8, 4), nn.Linear(4, 4)

        def forward(self, tokens: Tensor) -> Tensor:
            h = self.mid(self.embed(tokens))
            pipe_split()
            return h @ self.embed.weight.t()

    model, tokens = Tied(), torch.randint(0, 8, (2, 3))
    pipe = pipeline(model, (tokens,))
    assert pipe.replicated_params == [{"submod_0": "embed.weight", "submod_1": "embed.weight"}]
    first, last = pipe.get_stage_module(0), pipe.get_stage_module(1)
    assert first.embed.weight is model.embed.weight and last.embed.weight is not model.embed.weight
    torch.testing.assert_close(last.embed.weight, model.embed.weight, rtol=0, atol=0)
    torch.testing.assert_close(pipe(tokens), model(tokens), rtol=0, atol=0)


def test_a_split_policy_inserts_the_marks() -> None:
    def after_every_relu(traced: torch.fx.GraphModule) -> torch.fx.GraphModule:
        for node in list(traced.graph.nodes):
            if node.op == "call_function" and node.target is torch.ops.aten.relu.default:
                with traced.graph.inserting_after(node):
                    traced.graph.call_function(pipe_split)
        traced.recompile()
        return traced

    model = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 2))
    x = torch.randn(3, 4)
    pipe = pipeline(model, (x,), split_policy=after_every_relu)
    assert pipe.num_stages == 3
    assert [[n for n, _ in pipe.get_stage_module(i).named_parameters()] for i in range(3)] == \
        [["0.weight", "0.bias"], ["2.weight", "2.bias"], ["4.weight", "4.bias"]]
    torch.testing.assert_close(pipe(x), model(x), rtol=0, atol=0)


def test_build_stage_moves_the_stage_and_the_devices_written_into_its_graph() -> None:
    def body(rank: int, size: int) -> list[str]:
        model = gpt(layers=2)
        pipe = pipeline(model, (batch(0, MICROBATCH)[0],), split_spec=_spec(2))
        stage = pipe.build_stage(0, "meta")
        assert isinstance(stage, PipelineStage) and stage.stage_index == 0 and stage.num_stages == 2
        module = stage.submod
        assert all(p.is_meta for p in module.parameters())
        devices = [str(n.kwargs["device"]) for n in module.graph.nodes if "device" in n.kwargs]
        again = build_stage(module, 0, pipe.info(), "meta")        # meta parameters stay where they are
        assert again.submod is module and pipe.info().num_stages == 2
        return devices

    assert run_ranks(body, 1, timeout=60) == [["meta"]]      # the positions' arange


def _traced_stages(model: GPT, rank: int, num_ranks: int, per_rank: int,
                   style: str) -> tuple[list[PipelineStage], nn.Module]:
    """This rank's stages of a private copy of `model`, cut by the tracer before every block but the first."""
    local = copy.deepcopy(model)
    num_stages = num_ranks * per_rank
    pipe = pipeline(local, (batch(0, 8)[0][:8 // (2 * num_ranks)],), split_spec=_spec(num_stages))
    placement = stage_to_rank(num_ranks, num_stages, style)   # type: ignore[arg-type]
    return [pipe.build_stage(s, "cpu") for s in range(num_stages) if placement[s] == rank], local


@pytest.mark.parametrize("cls, per_rank", [(Schedule1F1B, 1), (ScheduleInterleaved1F1B, 2)],
                         ids=["1F1B", "Interleaved1F1B"])
def test_traced_stages_train_as_one_process(cls: type, per_rank: int) -> None:
    ranks = 2
    want_losses, want_params = reference(ranks * per_rank)
    results = train_pipelined(cls, ranks, per_rank, "loop", gpt(ranks * per_rank), n_microbatches=2 * ranks,
                              build=_traced_stages)
    losses = [r[0] for r in results if r[0]]
    torch.testing.assert_close(torch.tensor(losses[0]), torch.tensor(want_losses), rtol=RTOL, atol=ATOL)
    got = {name: value for _, params in results for name, value in params.items()}
    assert sorted(got) == sorted(want_params)
    for name, value in got.items():
        torch.testing.assert_close(value, want_params[name], rtol=RTOL, atol=ATOL, msg=name)


class _LateMask(nn.Module):
    """The mask, a model input, is used by the last stage only: it travels through the middle one."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(4, 4) for _ in range(3))

    def forward(self, x: Tensor, mask: Tensor) -> Tensor:
        x = self.layers[0](x).tanh()
        pipe_split()
        x = self.layers[1](x).tanh()
        pipe_split()
        return self.layers[2](x) * mask


def test_a_model_input_travels_to_the_stage_that_uses_it_during_training() -> None:
    torch.manual_seed(0)
    model, x, mask, target = _LateMask(), torch.randn(8, 4), (torch.rand(8, 4) > 0.3).float(), torch.randn(8, 4)
    expected = copy.deepcopy(model)
    torch.nn.functional.mse_loss(expected(x, mask), target).backward()

    def body(rank: int, size: int) -> dict[str, Tensor]:
        pipe = pipeline(copy.deepcopy(model), (x[:2],), {"mask": mask[:2]})
        stage = pipe.build_stage(rank, "cpu")
        schedule = ScheduleGPipe(stage, 4, loss_fn=torch.nn.functional.mse_loss)
        schedule.step(*((x,) if rank == 0 else ()), **({"mask": mask} if rank == 0 else {}),
                      target=target if rank == 2 else None)
        return {name: p.grad for name, p in stage.submod.named_parameters()}

    grads = {name: grad for result in run_ranks(body, 3, timeout=60) for name, grad in result.items()}
    assert sorted(grads) == sorted(n for n, _ in expected.named_parameters())
    for name, param in expected.named_parameters():
        torch.testing.assert_close(grads[name], param.grad, rtol=RTOL, atol=ATOL, msg=name)


class _Untraceable(nn.Module):
    def forward(self, x: Tensor) -> Tensor:
        return x * 2 if x.sum() > 0 else x


class _NumberAcrossTheCut(nn.Module):
    def forward(self, x: Tensor) -> Tensor:
        scale = x.sum().item()
        pipe_split()
        return x * scale


class _NothingTravels(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("count", torch.zeros(()))
        self.weight = nn.Parameter(torch.ones(2))

    def forward(self, x: Tensor) -> Tensor:
        self.count.add_(1)
        pipe_split()
        return self.weight * 2


BAD = [
    (lambda: pipeline(nn.Linear(2, 2), (torch.ones(1, 2),), split_spec={"missing": SplitPoint.END}),
     ValueError, r"split_spec names 'missing', which Linear lacks"),
    (lambda: pipeline(nn.Linear(2, 2), (torch.ones(1, 2),), split_spec={"": "END"}),
     ValueError, r"split_spec\[''\] must be SplitPoint.BEGINNING or SplitPoint.END"),
    (lambda: pipeline(nn.Linear(2, 2), (torch.ones(1, 2),), split_spec={}, split_policy=lambda g: g),
     ValueError, r"give split_spec or split_policy, not both"),
    (lambda: pipeline(nn.Linear(2, 2), (torch.ones(1, 2),), split_policy=lambda g: None),
     TypeError, r"split_policy must return a torch.fx.GraphModule, got NoneType"),
    (lambda: pipeline(_Untraceable(), (torch.ones(4, 2),)),
     RuntimeError, r"torch.export could not capture _Untraceable's forward as one graph .*PipelineStage"),
    (lambda: pipeline(_NumberAcrossTheCut(), (torch.ones(4, 2),)),
     ValueError, r"item \(SymFloat\), made in stage 0 and used in stage 1, would cross a cut .*only tensors travel"),
    (lambda: pipeline(_NothingTravels(), (torch.ones(4, 2),)),
     ValueError, r"stage 1 uses nothing that stage 0 or the stages before it compute"),
]


@pytest.mark.parametrize("make, error, says", BAD, ids=["missing-module", "not-a-split-point", "spec-and-policy",
                                                        "policy-result", "untraceable", "number-across-a-cut",
                                                        "nothing-travels"])
def test_models_and_specs_that_cannot_be_cut_are_refused(make: object, error: type[Exception], says: str) -> None:
    with pytest.raises(error, match=says):
        make()  # type: ignore[operator]
