"""Steps that pair rows of their batch by position are found at split time (graphsplit.row_pairing).

A cache's loader regroups rows, so ``split.paired_rows`` must name every step whose stage 2
combines rows by where they stand (a preference loss over ``[chosen; rejected]``, a prior-
preservation loss over ``[instance; class]`` halves) and no step that treats its batch as a set
(a mean loss, in-batch negatives, a mean per label, rows a mask leaves out). Both paths.
"""

from __future__ import annotations

import collections
import inspect

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

import graphsplit
from graphsplit.row_pairing import MAX_ROWS, MIN_ROWS

PATHS = ("trace", "calls")


class Scored(torch.nn.Module):
    """A frozen encoder (cached) and a trainable head: one score per row."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.encoder = torch.nn.Linear(4, 8).requires_grad_(False)
        self.head = torch.nn.Linear(8, 1)

    def score(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.tanh(self.encoder(x))).squeeze(-1)


class Preference(Scored):
    def forward(self, x):
        chosen, rejected = self.score(x).chunk(2)
        return -F.logsigmoid(chosen - rejected).mean()  # rows i and i + B meet here


class Adjacent(Scored):
    def forward(self, x):
        pairs = self.score(x).view(-1, 2)  # [a0, b0, a1, b1, ...]
        return -F.logsigmoid(pairs[:, 0] - pairs[:, 1]).mean()


class PriorPreservation(Scored):
    """DreamBooth's ``[instance; class]`` halves, each a mean of its own, weighted apart."""

    def forward(self, x):
        instance, prior = self.score(x).chunk(2)
        return instance.square().mean() + 0.5 * prior.square().mean()


class RowWise(Scored):
    def forward(self, x):
        return self.score(x).square().mean()


class InBatchNegatives(Scored):
    def forward(self, x):
        features = torch.tanh(self.encoder(x))
        logits = self.head.weight * features @ features.T
        return F.cross_entropy(logits, torch.arange(len(x)))


class MeanPerLabel(Scored):
    """Each row against the mean of its label's rows: rows meet by what they hold."""

    def forward(self, x, labels):
        features = self.head.weight * torch.tanh(self.encoder(x))
        sums = torch.zeros(3, 8).index_add(0, labels, features)
        counts = torch.zeros(3).index_add(0, labels, torch.ones(len(x)))
        means = sums / counts.clamp(min=1)[:, None]
        return (features - means[labels]).square().mean()


class MaskedRows(Scored):
    """Rows without a label never reach the loss (a cross-entropy's ignore_index)."""

    def forward(self, x, keep):
        scores = self.score(x)
        return torch.where(keep, scores.square(), 0.0).sum() / keep.sum()


class Noisy(Scored):
    def forward(self, x):
        noisy = torch.tanh(self.encoder(x)) + 0.1 * torch.randn(len(x), 8)
        chosen, rejected = self.head(noisy).squeeze(-1).chunk(2)
        return -F.logsigmoid(chosen - rejected).mean()


def _line_of(cls: type, text: str) -> str:
    lines, start = inspect.getsourcelines(cls)
    return f"test_row_pairing.py:{start + next(i for i, s in enumerate(lines) if text in s)}"


X = torch.randn(8, 4)


@pytest.mark.parametrize("path", PATHS)
def test_a_preference_loss_over_chosen_then_rejected_rows_is_found(path):
    split = graphsplit.split(Preference(), (X,), path=path)
    paired = split.paired_rows
    assert paired is not None
    assert paired.groups == ((0, 4), (1, 5), (2, 6), (3, 7)) and paired.rows == 8
    assert paired.op == "sub.Tensor"
    assert _line_of(Preference, "chosen - rejected") in paired.source
    assert "chosen - rejected" in paired.describe()


@pytest.mark.parametrize("path", PATHS)
def test_adjacent_pairs_are_found(path):
    paired = graphsplit.split(Adjacent(), (X,), path=path).paired_rows
    assert paired is not None and paired.groups == ((0, 1), (2, 3), (4, 5), (6, 7))


@pytest.mark.parametrize("path", PATHS)
def test_halves_weighted_apart_are_found(path):
    paired = graphsplit.split(PriorPreservation(), (X,), path=path).paired_rows
    # The first half's mean is where rows first meet by position.
    assert paired is not None and paired.groups == ((0, 1, 2, 3),) and paired.op == "mean.default"
    assert _line_of(PriorPreservation, "instance.square().mean()") in paired.source


@pytest.mark.parametrize("path", PATHS)
def test_a_pairing_under_per_row_noise_is_found(path):
    paired = graphsplit.split(Noisy(), (X,), path=path).paired_rows
    assert paired is not None and paired.groups == ((0, 4), (1, 5), (2, 6), (3, 7))


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("step", [RowWise, InBatchNegatives], ids=lambda s: s.__name__)
def test_a_batch_taken_as_a_set_is_not_paired(step, path):
    assert graphsplit.split(step(), (X,), path=path).paired_rows is None


@pytest.mark.parametrize("path", PATHS)
def test_rows_that_meet_by_their_labels_are_not_paired(path):
    labels = torch.tensor([0, 1, 0, 2, 1, 0, 2, 1])
    assert graphsplit.split(MeanPerLabel(), (X, labels), path=path).paired_rows is None


@pytest.mark.parametrize("path", PATHS)
def test_rows_a_mask_leaves_out_are_not_paired(path):
    keep = torch.tensor([True, False, True, True, False, True, True, True])
    assert graphsplit.split(MaskedRows(), (X, keep), path=path).paired_rows is None


class Leftovers(Scored):
    """A row-wise loss that keeps its last value in a scratch tensor and slices the scratch on
    the next call. The slice shows the last call's leftovers, which no row of this batch wrote:
    TRL's chunked log-prob kernel slices a ``torch.empty`` buffer the allocator may hand back
    holding a freed tensor's NaN, so a NaN run's leftovers showed in the next run's slice."""

    def __init__(self) -> None:
        super().__init__()
        self.scratch = torch.zeros(len(X), 8)

    def forward(self, x):
        self.scratch[: len(x)]  # a view of what the last call left: nothing of this batch
        loss = self.score(x).square().mean()
        with torch.no_grad():
            self.scratch.fill_(loss)
        return loss


def test_a_view_of_memory_no_row_wrote_is_not_a_meeting():
    step = Leftovers()
    assert graphsplit.split(step, (X,), path="calls").paired_rows is None
    assert not step.scratch.isnan().any()  # the runs' NaN put back


def test_below_three_rows_nothing_is_claimed():
    assert MIN_ROWS == 3
    assert graphsplit.split(Preference(), (X[:2],)).paired_rows is None


class Checked(Scored):
    """A step that refuses a NaN itself: its runs under NaN are left out, never raised."""

    def forward(self, x):
        features = torch.tanh(self.encoder(x))
        if torch.isnan(features).any():
            raise ValueError("NaN in the features")
        chosen, rejected = self.head(features).squeeze(-1).chunk(2)
        return -F.logsigmoid(chosen - rejected).mean()


def test_a_step_that_refuses_nan_is_split_and_claims_nothing():
    step = Checked()
    split = graphsplit.split(step, (X,), path="calls")  # the trace refuses the branch on values
    assert split.paired_rows is None
    graphsplit.verify(step, split, (X,))


class Normalised(Scored):
    """A trainable BatchNorm in train mode: its running statistics must not take a NaN."""

    def __init__(self) -> None:
        super().__init__()
        self.norm = torch.nn.BatchNorm1d(8)

    def forward(self, x):
        features = torch.tanh(self.encoder(x))
        chosen, rejected = self.head(features).squeeze(-1).chunk(2)
        # After BatchNorm every row reads every other: a pairing there would be hidden.
        spread = self.norm(features).square().mean()
        return -F.logsigmoid(chosen - rejected).mean() + 0.1 * spread


@pytest.mark.parametrize("path", PATHS)
def test_buffers_the_runs_write_are_put_back(path):
    step = Normalised()
    split = graphsplit.split(step, (X,), path=path)
    assert split.paired_rows is not None
    assert torch.isfinite(step.norm.running_mean).all()
    assert torch.isfinite(step.norm.running_var).all()
    assert int(step.norm.num_batches_tracked) < 8  # only the split's own runs counted


def _grouped(rows: int, size: int, adjacent: bool) -> list[tuple[int, ...]]:
    groups = rows // size
    if adjacent:
        return [tuple(range(g * size, g * size + size)) for g in range(groups)]
    return [tuple(g + k * groups for k in range(size)) for g in range(groups)]


class Grouped(Scored):
    """Rows met in groups of ``size`` by position: stacked ``[a; b; ...]`` or side by side."""

    def __init__(self, size: int, adjacent: bool) -> None:
        super().__init__()
        self.size, self.adjacent = size, adjacent

    def forward(self, x):
        scores = self.score(x)
        table = scores.view(-1, self.size) if self.adjacent else scores.view(self.size, -1).T
        return torch.logsumexp(table, dim=1).sub(table[:, 0]).mean()


@settings(max_examples=12, deadline=None)
@given(
    groups=st.integers(2, 4),
    size=st.integers(2, 3),
    adjacent=st.booleans(),
    path=st.sampled_from(PATHS),
)
def test_groups_met_by_position_are_found_as_they_are(groups, size, adjacent, path):
    rows = groups * size
    x = torch.randn(rows, 4, generator=torch.Generator().manual_seed(rows))
    paired = graphsplit.split(Grouped(size, adjacent), (x,), path=path).paired_rows
    assert paired is not None and paired.rows == rows
    assert list(paired.groups) == sorted(_grouped(rows, size, adjacent))


# Row-wise ops a step applies to (rows, 8) features: none of them lets one row read another.
ROW_WISE = {
    "tanh": lambda h: torch.tanh(h),
    "noise": lambda h: h + 0.1 * torch.randn_like(h),
    "dropout": lambda h: F.dropout(h, 0.3, training=True),
    "in_place": lambda h: h.clone().mul_(2).add_(1),
    "softmax": lambda h: h.softmax(dim=-1),
    "norm": lambda h: F.layer_norm(h, (8,)),
    "mask": lambda h: torch.where(h > 0, h, torch.zeros_like(h)),
    "sort": lambda h: h.sort(dim=-1).values,
    "cumsum": lambda h: h.cumsum(dim=-1),
}


class RowWiseProgram(Scored):
    def __init__(self, ops: list[str], reduce: str) -> None:
        super().__init__()
        self.ops, self.reduce = ops, reduce

    def forward(self, x):
        h = torch.tanh(self.encoder(x)) * self.head.weight
        for op in self.ops:
            h = ROW_WISE[op](h)
        per_row = h.square().sum(dim=-1)
        return per_row.mean() if self.reduce == "mean" else per_row.logsumexp(0)


@settings(max_examples=15, deadline=None)
@given(
    ops=st.lists(st.sampled_from(sorted(ROW_WISE)), max_size=5),
    reduce=st.sampled_from(["mean", "logsumexp"]),
    rows=st.integers(MIN_ROWS, 7),
    path=st.sampled_from(PATHS),
)
def test_row_wise_programs_with_draws_and_in_place_ops_are_never_paired(ops, reduce, rows, path):
    x = torch.randn(rows, 4, generator=torch.Generator().manual_seed(rows))
    step = RowWiseProgram(ops, reduce)
    split = graphsplit.split(step, (x,), path=path)
    assert split.paired_rows is None, split.paired_rows


class Remembers(Scored):
    """A step that keeps what it saw as attributes (a rotary table's length, a last batch)."""

    def forward(self, x):
        features = torch.tanh(self.encoder(x))
        self.last_features = features
        self.saw_nan = bool(torch.isnan(features).any())
        chosen, rejected = self.head(features).squeeze(-1).chunk(2)
        return -F.logsigmoid(chosen - rejected).mean()


def test_the_runs_leave_the_steps_attributes_and_batch_as_they_found_them(monkeypatch):
    step = Remembers()
    x = X.clone()
    found = graphsplit.api.find_paired_rows
    around: list[dict] = []

    def watched(*args, **kwargs):
        around.append(dict(vars(step)))
        paired = found(*args, **kwargs)
        around.append(dict(vars(step)))
        return paired

    monkeypatch.setattr(graphsplit.api, "find_paired_rows", watched)
    split = graphsplit.split(step, (x,), path="calls")  # the trace refuses bool() on a value
    assert split.paired_rows is not None
    assert torch.equal(x, X)
    before, after = around
    assert before.keys() == after.keys()
    assert all(after[name] is value for name, value in before.items())


class CompiledHead(Scored):
    """The trainable head compiled (backend "eager": no compiler needed): the runs use its
    Python, as the module-level path's probes do."""

    def __init__(self) -> None:
        super().__init__()
        self.head = torch.compile(self.head, backend="eager")

    def forward(self, x):
        chosen, rejected = self.score(x).chunk(2)
        return -F.logsigmoid(chosen - rejected).mean()


def test_a_compiled_module_in_stage2_is_watched_in_its_python():
    paired = graphsplit.split(CompiledHead(), (X,), path="calls").paired_rows
    assert paired is not None and paired.groups == ((0, 4), (1, 5), (2, 6), (3, 7))


class AllPairs(Scored):
    """Every chosen row against every rejected one (a pairwise ranking loss)."""

    def forward(self, x):
        chosen, rejected = self.score(x).chunk(2)
        return -F.logsigmoid(chosen[:, None] - rejected[None, :]).mean()


@pytest.mark.parametrize("path", PATHS)
def test_every_chosen_row_against_every_rejected_one_is_found(path):
    paired = graphsplit.split(AllPairs(), (X,), path=path).paired_rows
    assert paired is not None
    assert set(paired.groups) == {(i, 4 + j) for i in range(4) for j in range(4)}


def test_a_large_example_is_watched_on_its_first_rows():
    x = torch.randn(40, 4, generator=torch.Generator().manual_seed(1))
    paired = graphsplit.split(Preference(), (x,)).paired_rows
    assert paired is not None and paired.rows == MAX_ROWS
    assert paired.groups == tuple((i, i + MAX_ROWS // 2) for i in range(MAX_ROWS // 2))


class Counted(torch.nn.Module):
    """A frozen encoder that counts the rows it saw in a buffer, and a step that keeps its
    losses in a list: both left as the split found them."""

    def __init__(self) -> None:
        super().__init__()
        self.encoder = torch.nn.Linear(4, 8).requires_grad_(False)
        self.register_buffer("seen", torch.zeros(()))
        self.head = torch.nn.Linear(8, 1)
        self.history: list[torch.Tensor] = []

    def forward(self, x):
        self.seen.add_(len(x))
        chosen, rejected = self.head(torch.tanh(self.encoder(x))).squeeze(-1).chunk(2)
        loss = -F.logsigmoid(chosen - rejected).mean()
        self.history.append(loss.detach())
        return loss


def test_buffers_stage1_writes_and_lists_the_step_fills_are_put_back():
    step = Counted()
    split = graphsplit.split(step, (X,))  # the trace refuses the write: the module-level path
    seen, history = step.seen.clone(), list(step.history)
    assert split.paired_rows is not None
    assert torch.equal(step.seen, seen)
    assert len(step.history) == len(history)
    assert all(a is b for a, b in zip(step.history, history))


def test_an_interrupted_first_read_is_made_again(monkeypatch):
    split = graphsplit.split(Preference(), (X,))
    find = split._find_paired_rows
    calls = []

    def interrupted():
        calls.append(1)
        if len(calls) == 1:
            raise KeyboardInterrupt
        return find()

    split._find_paired_rows = interrupted
    with pytest.raises(KeyboardInterrupt):
        _ = split.paired_rows
    assert split.paired_rows is not None and len(calls) == 2
    assert split.paired_rows is split.paired_rows and len(calls) == 2  # made once


class ReadOnlyConfig(collections.OrderedDict):
    """A library's frozen config (diffusers' ``FrozenDict``): ``update`` raises."""

    def update(self, *args, **kwargs):
        raise TypeError("frozen")


class Configured(Preference):
    def __init__(self) -> None:
        super().__init__()
        self.config = ReadOnlyConfig(scale=1.0)


def test_an_attribute_that_refuses_to_be_refilled_never_fails_the_check():
    paired = graphsplit.split(Configured(), (X,)).paired_rows
    assert paired is not None and paired.groups == ((0, 4), (1, 5), (2, 6), (3, 7))
