"""Sharding rules for the matmul family: mm, addmm, bmm, baddbmm, dot, mv (and matmul / linear through them).

Layer: tensor. Pure decisions; dispatch redistributes and runs the local op.

Note: matmul strategies as einsum
Every op here is an einsum over named dims, e.g. mm is "mk,kn->mn" and bmm "bmk,bkn->bmn". On one mesh dim
the candidates are:
  - all Replicate -> Replicate;
  - a dim kept in the output (b, m or n): shard it on every input that has it (Replicate on the others) and
    the output keeps it sharded: no communication;
  - a contracted dim (k): shard it on both inputs; each rank multiplies its k-slices and the output is
    Partial(sum): the all-reduce is deferred to whoever needs the value (often never, e.g. Shard(1) x Shard(0)
    in a row-parallel linear feeding a reduce-scatter);
  - one input Partial (sum or avg) and the others Replicate -> Partial of that op (a product is linear in each
    factor). Two Partial factors are never multiplied: (a1 + a2)(b1 + b2) is not a1 b1 + a2 b2.
The framework picks the cheapest candidate per mesh dim, so Shard(0) x Replicate -> Shard(0), Replicate x
Shard(1) -> Shard(1) and Shard(1) x Shard(0) -> Partial() all cost nothing. An added term (the bias of
addmm / baddbmm) broadcasts against the output: it follows the output's Shard where it has that dim at full
size, is Replicate where it broadcasts, and becomes Partial (kept on one rank, zeros elsewhere: exact) when
the output is Partial. A plain (one-element) tensor argument can't be redistributed, so candidates that
would need it sharded or Partial are left out.
"""

from __future__ import annotations

from collections.abc import Sequence

from torch import Tensor, ops

from spmd.tensor.placement import Partial, Placement, Replicate, Shard
from spmd.tensor.rules import OpSchema, ShardingError, Strategy, register_strategy
from spmd.tensor.spec import DTensorSpec

aten = ops.aten


def _linear_partial_ops(specs: Sequence[DTensorSpec]) -> list[str]:
    """Partial reduce ops a product may stay in: "sum" always, "avg" when an input already is Partial(avg)."""
    found = ["sum"]
    for spec in specs:
        for placement in spec.placements:
            if isinstance(placement, Partial) and placement.is_linear and placement.reduce_op not in found:
                found.append(placement.reduce_op)
    return found


def _added_term_placement(term: str, size: Sequence[int], output: str, out_sizes: dict[str, int],
                          out_placement: Placement) -> Placement:
    """Placement of a broadcast added term (bias) with dims `term` when the output is `out_placement`."""
    if isinstance(out_placement, Partial):
        return out_placement
    if isinstance(out_placement, Shard):
        letter = output[out_placement.dim]
        position = term.find(letter)
        if position >= 0 and size[position] == out_sizes[letter]:
            return Shard(position)
    return Replicate()


def einsum_strategies(schema: OpSchema, factors: Sequence[str], output: str,
                      added: tuple[int, str] | None = None) -> list[Strategy]:
    """Per-mesh-dim candidates for the product of `factors` (einsum dims per tensor argument) giving `output`
    (see Note: matmul strategies as einsum).

    `factors[i]` names the dims of positional argument `first + i`, where `first` is 1 if `added` is given
    (an added term at `added[0]`, with dims `added[1]` right-aligned to the output) else 0.
    """
    first = 0 if added is None else 1
    args = [schema.args[first + i] for i in range(len(factors))]
    term_arg = schema.args[added[0]] if added is not None else None
    sizes: dict[str, int] = {}
    for dims, arg in zip(factors, args):
        shape = arg.shape
        if len(dims) != len(shape):
            raise ShardingError(f"expected {len(dims)}-d operands for '{','.join(factors)}->{output}', got "
                                f"shape {tuple(shape)}")
        sizes.update(zip(dims, shape))
    term_dims = ""
    if added is not None and isinstance(term_arg, (DTensorSpec, Tensor)):
        term_dims = added[1][len(added[1]) - len(term_arg.shape):]

    def make(factor_placements: list[Placement], out: Placement) -> Strategy | None:
        per_arg: list[Placement] = list(factor_placements)
        if added is not None and isinstance(term_arg, (DTensorSpec, Tensor)):
            per_arg.insert(0, _added_term_placement(term_dims, term_arg.shape, output, sizes, out))
        arg_list = ([term_arg] if added is not None else []) + args
        inputs: list[Placement] = []
        for arg, placement in zip(arg_list, per_arg):
            if isinstance(arg, DTensorSpec):
                inputs.append(placement)
            elif isinstance(arg, Tensor) and not isinstance(placement, Replicate):
                return None          # a plain tensor stays as it is on every rank
        return Strategy(tuple(inputs), out)

    candidates: list[Strategy | None] = [make([Replicate()] * len(factors), Replicate())]
    letters = list(dict.fromkeys("".join(factors)))
    for letter in letters:
        placements: list[Placement] = [Shard(dims.index(letter)) if letter in dims else Replicate()
                                       for dims in factors]
        if letter in output:
            candidates.append(make(placements, Shard(output.index(letter))))
        elif all(letter in dims for dims in factors):
            candidates.append(make(placements, Partial()))
    for reduce_op in _linear_partial_ops(schema.input_specs):
        for i in range(len(factors)):
            placements = [Partial(reduce_op) if j == i else Replicate() for j in range(len(factors))]
            candidates.append(make(placements, Partial(reduce_op)))
    return [c for c in candidates if c is not None]


@register_strategy(aten.mm.default)
def _mm(schema: OpSchema) -> list[Strategy]:
    return einsum_strategies(schema, ("mk", "kn"), "mn")


@register_strategy(aten.bmm.default)
def _bmm(schema: OpSchema) -> list[Strategy]:
    return einsum_strategies(schema, ("bmk", "bkn"), "bmn")


@register_strategy(aten.dot.default)
def _dot(schema: OpSchema) -> list[Strategy]:
    return einsum_strategies(schema, ("k", "k"), "")


@register_strategy(aten.mv.default)
def _mv(schema: OpSchema) -> list[Strategy]:
    return einsum_strategies(schema, ("mk", "k"), "m")


@register_strategy(aten.addmm.default)
def _addmm(schema: OpSchema) -> list[Strategy]:
    return einsum_strategies(schema, ("mk", "kn"), "mn", added=(0, "mn"))


@register_strategy(aten.baddbmm.default)
def _baddbmm(schema: OpSchema) -> list[Strategy]:
    return einsum_strategies(schema, ("bmk", "bkn"), "bmn", added=(0, "bmn"))
