"""Budget steps' row sharing: best-first by drafted reach, prefixes only, padding requests that take what the real
ones would not have had."""


import pytest
import torch

from specdec.runtime.row_budget import budget_lengths, budget_reach, compact_rows


def best_first_lengths(confidence: torch.Tensor, rows: int) -> list[int]:
    """The reference: grow one draft at a time, each time for the request whose next draft has the largest reach."""
    batch, n = confidence.shape
    lengths = [1] * batch
    reach = [0.0] * batch
    for _ in range(rows - batch):
        best = max((r for r in range(batch) if lengths[r] <= n),
                   key=lambda r: (reach[r] + confidence[r, lengths[r] - 1].item(), -r))
        reach[best] += confidence[best, lengths[best] - 1].item()
        lengths[best] += 1
    return lengths


@pytest.mark.parametrize("batch,n,per", [(1, 15, 1), (1, 15, 4), (3, 7, 2), (8, 15, 4), (5, 3, 4), (16, 7, 3)])
def test_lengths_are_the_best_first_allocation(batch, n, per):
    g = torch.Generator().manual_seed(batch * 100 + n * 10 + per)
    # distinct log-probabilities (no ties): the allocation is unique
    confidence = -torch.rand(batch, n, generator=g, dtype=torch.float64).float() * 3
    rows = batch * per
    lengths = budget_lengths(budget_reach(confidence, batch, per), rows)
    assert lengths.tolist() == best_first_lengths(confidence, rows)
    assert int(lengths.sum()) == rows and int(lengths.min()) >= 1 and int(lengths.max()) <= n + 1


def test_a_sure_request_takes_rows_an_unsure_one_would_waste():
    confidence = torch.tensor([[-0.01] * 7, [-3.0] * 7])
    assert budget_lengths(budget_reach(confidence, 2, 4), 8).tolist() == [7, 1]


def test_ties_keep_each_request_a_prefix():
    confidence = torch.zeros(4, 7)  # every draft certain: any four of them may be chosen
    lengths = budget_lengths(budget_reach(confidence, 4, 2), 8)
    assert int(lengths.sum()) == 8 and all(1 <= x <= 8 for x in lengths.tolist())


@pytest.mark.parametrize("batch,rung,per", [(3, 4, 2), (5, 8, 4), (1, 8, 3), (6, 8, 8)])
def test_padding_requests_leave_the_real_ones_what_they_get_alone(batch, rung, per):
    n = 7
    confidence = -torch.rand(batch, n, generator=torch.Generator().manual_seed(rung * per)) * 2
    alone = budget_lengths(budget_reach(confidence, batch, per), batch * per)
    padded = budget_lengths(budget_reach(confidence, rung, per), rung * per)
    assert padded[:batch].tolist() == alone.tolist()
    assert padded[batch:].tolist() == [per] * (rung - batch)


def test_compact_rows_walk_each_block_request_by_request():
    lengths = torch.tensor([3, 1, 4])
    request, column = compact_rows(lengths, 8)
    assert list(zip(request.tolist(), column.tolist())) == [(0, 0), (0, 1), (0, 2), (1, 0), (2, 0), (2, 1), (2, 2),
                                                            (2, 3)]


def test_a_budget_outside_the_batch_is_refused():
    reach = torch.zeros(2, 3)
    for rows in (1, 9):
        with pytest.raises(ValueError, match="cannot cover 2 requests"):
            budget_lengths(reach, rows)
    assert budget_lengths(reach, 2).tolist() == [1, 1] and budget_lengths(reach, 8).tolist() == [4, 4]
