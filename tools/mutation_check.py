"""Break the library on purpose and see whether the tests notice: a small mutation check.

Each mutation replaces one exact snippet of one source file (it must occur exactly once, so the list stays
true as the code moves) in a scratch copy of src/ and tests/, then runs the tests that ought to catch it.
A mutation is caught when those tests fail. Every mutation must be caught by at least one test: one that
survives means a rule, reduction or protocol could be wrong without any test saying so.

    python tools/mutation_check.py [--only NAME ...] [--list]

The last line printed is `caught N of M mutations`. Slow (a pytest run per mutation), so not part of
`make test`; run it after changing a rule, a reduction or a test helper that builds inputs.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import pathlib
import shutil
import subprocess
import sys
import tempfile
import time

ROOT = pathlib.Path(__file__).resolve().parents[1]


@dataclasses.dataclass(frozen=True)
class Mutation:
    """One deliberate bug: in `path`, `old` becomes `new`; `tests` are the pytest arguments that must fail."""

    name: str
    path: str
    old: str
    new: str
    tests: tuple[str, ...]


_POINTWISE = ("tests/tensor/test_pointwise_view.py",)
_NORMS = ("tests/tensor/test_ops_embedding_norm_loss.py",)
_POWERSGD = ("tests/parity/test_powersgd_oracle.py", "tests/parity/test_ddp.py", "-k", "powersgd or PowerSGD")
_REDUCE = ("tests/comm/test_reduce_op.py", "tests/comm/test_matrix.py")
_FSDP_PARITY = ("tests/fsdp/test_parity.py", "-k", "matches_one_process")
_AMP = ("tests/tensor/test_amp_and_clipping.py",)

MUTATIONS: tuple[Mutation, ...] = (
    # DTensor rules: each passed every test while Partial inputs were the value on one rank and zeros elsewhere
    Mutation("pointwise: tanh, gelu, relu, abs and clamp treated as linear in a Partial",
             "src/spmd/tensor/ops/pointwise.py",
             "aten.neg_.default, aten.clone.default,",
             "aten.neg_.default, aten.tanh.default, aten.gelu.default, aten.relu.default, aten.abs.default, "
             "aten.clamp.default, aten.clone.default,",
             _POINTWISE),
    Mutation("pointwise: Partial x Partial kept Partial",
             "src/spmd/tensor/ops/pointwise.py",
             "                inputs = tuple(placement if j == k else Replicate() for j in range(len(specs)))",
             "                inputs = tuple(placement if j == k or isinstance(specs[j].placements[mesh_dim], Partial)"
             " else Replicate() for j in range(len(specs)))",
             _POINTWISE),
    Mutation("redistribute: Partial -> Replicate keeps rank 0's term",
             "src/spmd/tensor/redistribute.py",
             "        return all_reduced(local, source.comm_op, group)",
             "        return all_reduced(local * (1 if group.rank() == 0 else 0), source.comm_op, group)",
             ("tests/tensor/test_redistribute.py",)),
    Mutation("reductions: prod passes a Partial(sum) through",
             "src/spmd/tensor/ops/reduction.py",
             '"product", ("product",))',
             '"product", ("product", "sum"))',
             ("tests/tensor/test_ops_reduction.py",)),
    Mutation("reductions: amax / amin pass a Partial(sum) through",
             "src/spmd/tensor/ops/reduction.py",
             "reduction_strategies(spec, reduced, keepdim, reduce_op, (reduce_op,))",
             'reduction_strategies(spec, reduced, keepdim, reduce_op, (reduce_op, "sum"))',
             ("tests/tensor/test_ops_reduction.py",)),
    Mutation("GradScaler: found_inf not reduced across ranks (only the rank with the inf skips the step)",
             "src/spmd/tensor/ops/foreach.py",
             "            all_reduce(found_inf, ReduceOp.MAX, group=group)",
             "            pass",
             _AMP),
    Mutation("GradScaler: found_inf reduced over the last mesh dim only (a replica's inf stops only its row)",
             "src/spmd/tensor/ops/foreach.py",
             "    groups = [whole] if whole is not None else",
             "    groups = [mesh.get_group(mesh.ndim - 1)] if whole is not None else",
             _AMP),
    # a missing rule must fail the rule tests (the fallback computes the right values, slowly)
    Mutation("rules: softmax and log_softmax removed",
             "src/spmd/tensor/ops/norm.py",
             "@register_strategy(aten._softmax.default, aten._log_softmax.default, aten._safe_softmax.default)",
             "@(lambda fn: fn)",
             _NORMS),
    Mutation("rules: layer_norm removed",
             "src/spmd/tensor/ops/norm.py",
             "@register_strategy(aten.native_layer_norm.default)",
             "@(lambda fn: fn)",
             _NORMS),
    Mutation("rules: embedding backward removed",
             "src/spmd/tensor/ops/embedding.py",
             "@register_strategy(aten.embedding_dense_backward.default)",
             "@(lambda fn: fn)",
             _NORMS),
    # reductions of the comm layer
    Mutation("reduce_into: AVG not divided",
             "src/spmd/comm/reduce_op.py",
             "    if op is ReduceOp.AVG:\n        dst.div_(len(sources))",
             "    if op is ReduceOp.AVG:\n        pass",
             _REDUCE),
    Mutation("reduce_into: sources past the second ignored",
             "src/spmd/comm/reduce_op.py",
             "    for source in sources[2:]:\n        kernel(dst, source, out=dst)",
             "    for source in sources[2:2]:\n        kernel(dst, source, out=dst)",
             _REDUCE),
    Mutation("finish_average: a multi-step AVG not divided",
             "src/spmd/comm/reduce_op.py",
             "    if op is ReduceOp.AVG and count > 1:\n        tensor.div_(count)",
             "    if op is ReduceOp.AVG and count > 1:\n        pass",
             ("tests/comm/test_matrix.py",)),
    # data parallel
    Mutation("ddp: gradients summed, not averaged",
             "src/spmd/ddp/reducer.py",
             "                torch.div(grad, self.div_factor, out=view)",
             "                view.copy_(grad)",
             ("tests/parity/test_ddp.py",)),
    Mutation("powersgd: error feedback dropped",
             "src/spmd/ddp/powersgd.py",
             "            buffer.add_(state.error_dict[index])",
             "            pass",
             _POWERSGD),
    Mutation("powersgd: warm start ignored",
             "src/spmd/ddp/powersgd.py",
             "if state.warm_start and memory is not None",
             "if False and memory is not None",
             _POWERSGD),
    Mutation("monitored_barrier: the others wait no longer than the first rank",
             "src/spmd/comm/collectives.py",
             "        grace = max(1.0, 0.5 * seconds)",
             "        grace = 0.0",
             ("tests/comm/test_init_and_monitoring.py",)),
    # FSDP2: wrong gradients that still train (no error, no hang): only parity against one process shows them
    Mutation("fsdp: reduced gradients not averaged",
             "src/spmd/fsdp/collectives.py",
             "        if divide_factor != 1:\n            output.div_(divide_factor)",
             "        if divide_factor == 0:\n            output.div_(divide_factor)",
             _FSDP_PARITY),
    Mutation("fsdp: the tail rows of an uneven gradient dropped",
             "src/spmd/fsdp/param.py",
             "pieces[full_pieces, :tail].copy_(moved[full_pieces * self.rows_pad:])",
             "pieces[full_pieces, :tail].zero_()",
             _FSDP_PARITY),
    Mutation("fsdp: HSDP gradients not all-reduced over the replicate dim",
             "src/spmd/fsdp/collectives.py",
             "    if replicate_group is not None and replicate_group.size() > 1:",
             "    if replicate_group is not None and replicate_group.size() > 99:",
             ("tests/fsdp/test_parity.py", "-k", "hsdp")),
    Mutation("fsdp: every rank keeps the first piece after forward (reshard_after_forward=int)",
             "src/spmd/fsdp/api.py",
             "mesh.get_local_rank(mesh.ndim - 1) % small)",
             "0)",
             ("tests/fsdp/test_parity.py", "-k", "reshard_after_forward")),
    Mutation("fsdp: a gradient arriving after its group's reduction is dropped",
             "src/spmd/fsdp/param_group.py",
             "            self._late_grads = True          # a nested (reentrant) backward reached a parameter again",
             "            self._late_grads = False",
             ("tests/fsdp/test_parity.py", "-k", "two_backwards")),
    Mutation("fsdp: recomputation under reentrant checkpointing skips pre-backward",
             "src/spmd/fsdp/state.py",
             "                self.group.pre_backward()     # reentrant checkpointing: no output hook ran pre-backward",
             "                self.group.wait_for_unshard()",
             ("tests/fsdp/test_parity.py", "-k", "checkpointing")),
)


def scratch_copy() -> pathlib.Path:
    """src/, tests/ and the pytest configuration, copied without caches."""
    folder = pathlib.Path(tempfile.mkdtemp(prefix="spmd-mutation-"))
    ignore = shutil.ignore_patterns("__pycache__", "*.egg-info")
    for name in ("src", "tests"):
        shutil.copytree(ROOT / name, folder / name, ignore=ignore)
    shutil.copy(ROOT / "pyproject.toml", folder / "pyproject.toml")
    return folder


def apply(folder: pathlib.Path, mutation: Mutation) -> str:
    """Write the mutation into the copy; returns the original text of the file."""
    path = folder / mutation.path
    text = path.read_text()
    count = text.count(mutation.old)
    if count != 1:
        raise SystemExit(f"mutation {mutation.name!r}: the snippet occurs {count} times in {mutation.path}; "
                         f"update tools/mutation_check.py to the code as it is now")
    path.write_text(text.replace(mutation.old, mutation.new))
    return text


def caught(folder: pathlib.Path, mutation: Mutation, timeout: float) -> tuple[bool, str]:
    """Run the mutation's tests on the mutated copy: (whether they failed, the summary line)."""
    env = {**os.environ, "PYTHONPATH": str(folder / "src")}
    command = [sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider", *mutation.tests]
    try:
        done = subprocess.run(command, cwd=folder, env=env, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return True, f"timed out after {timeout:.0f}s (counts as caught: the suite would fail)"
    lines = [line for line in done.stdout.splitlines() if line.strip()]
    summary = lines[-1] if lines else done.stderr.strip().splitlines()[-1:]
    if done.returncode == 5:
        raise SystemExit(f"mutation {mutation.name!r}: its tests {mutation.tests} select nothing")
    return done.returncode != 0, str(summary)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--only", nargs="*", default=None, help="run only mutations whose name contains these")
    parser.add_argument("--list", action="store_true", help="list the mutations and exit")
    parser.add_argument("--timeout", type=float, default=600.0, help="seconds per mutation's test run")
    args = parser.parse_args()
    chosen = [m for m in MUTATIONS if not args.only or any(word in m.name for word in args.only)]
    if args.list:
        for mutation in chosen:
            print(f"{mutation.name}  ({mutation.path}; {' '.join(mutation.tests)})")
        return
    folder = scratch_copy()
    survivors = []
    try:
        for mutation in chosen:
            original = apply(folder, mutation)
            start = time.monotonic()
            was_caught, summary = caught(folder, mutation, args.timeout)
            (folder / mutation.path).write_text(original)
            verdict = "caught  " if was_caught else "SURVIVED"
            print(f"{verdict} {mutation.name} ({time.monotonic() - start:.0f}s): {summary}", flush=True)
            if not was_caught:
                survivors.append(mutation.name)
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    if survivors:
        print(f"survived: {survivors}")
    print(f"caught {len(chosen) - len(survivors)} of {len(chosen)} mutations")
    if survivors:
        raise SystemExit(1)


if __name__ == "__main__":
    main()
