"""`accum_callback.core.losses`: what a loss averages over (`loss_items`, `micro_items`) and whether it sums
(`loss_reduction`), for torch's and fastai's losses; checked against the loss itself: a micro-batch's mean loss times
its count is its sum, so counts-weighted means of the parts equal the whole batch's mean (float64: 1e-12)"""
import pytest
import torch, torch.nn as nn
from fastai.losses import CrossEntropyLossFlat, FocalLoss, LabelSmoothingCrossEntropy

from accum_callback.core.losses import count_dtype, loss_items, loss_reduction, micro_items
from helpers import floor_tol

def _batch(n=12, c=4, seed=0):
    g = torch.Generator().manual_seed(seed)
    pred,y = torch.randn(n, c, generator=g, dtype=torch.float64),torch.randint(0, c, (n,), generator=g)
    y[::3] = -100 if n > 3 else y[::3]
    return pred,y

@pytest.mark.parametrize('lf', [nn.CrossEntropyLoss(), nn.CrossEntropyLoss(weight=torch.tensor([1., 2., .5, 3.], dtype=torch.float64)),
                                nn.CrossEntropyLoss(ignore_index=1), CrossEntropyLossFlat()],
                         ids=['plain', 'weighted', 'ignore_index=1', 'fastai flat'])
def test_counts_weighted_means_of_the_parts_are_the_whole(lf):
    pred,y = _batch()
    ignore = getattr(getattr(lf, 'func', lf), 'ignore_index', -100)
    y = torch.where(y == -100, torch.full_like(y, ignore), y)   # every third target ignored, whichever index means it
    parts = [(pred[:5], y[:5]), (pred[5:], y[5:])]
    counts = [loss_items(lf, (yy,)) if loss_items(lf, (yy,)) is not None else torch.tensor(float(len(yy))) for _,yy in parts]
    whole = lf(pred, y)
    weighted = sum(lf(p, yy)*n for (p,yy),n in zip(parts, counts))/sum(counts)
    tol = 1e-12
    if whole.dtype != torch.float64:   # fastai's flattened losses return float32: its rounding of the torch loss inside
        inner = getattr(lf, 'func', lf)
        tol = floor_tol([abs(float(lf(p, yy)) - float(inner(p, yy)))/abs(float(inner(p, yy))) for p,yy in parts + [(pred, y)]])
    assert abs(float(weighted - whole)) <= tol*abs(float(whole)), tol

def test_ignored_targets_are_not_counted():
    y = torch.tensor([0, -100, 2, -100, 1])
    assert float(loss_items(nn.CrossEntropyLoss(), (y,))) == 3
    assert loss_items(nn.CrossEntropyLoss(), (torch.rand(5, 3),)) is None                  # probability targets: per item
    assert loss_items(nn.MSELoss(), (torch.rand(5),)) is None                                # the batch size is right

@pytest.mark.parametrize('lf,want', [(nn.CrossEntropyLoss(reduction='sum'), 'sum'), (nn.MSELoss(), 'mean'),
                                     (CrossEntropyLossFlat(), 'mean'), (FocalLoss(reduction='sum'), 'sum'),
                                     (LabelSmoothingCrossEntropy(), 'mean'), (lambda p, y: (p - y).abs().sum(), None)],
                         ids=['ce sum', 'mse', 'fastai flat', 'focal sum', 'label smoothing', 'a plain function'])
def test_loss_reduction_is_known_for_torch_and_fastai_classes_only(lf, want):
    assert loss_reduction(lf) == want

def test_micro_items_takes_the_users_count_first_and_refuses_other_types():
    class L: loss_func,yb,loss_grad = nn.CrossEntropyLoss(),(torch.tensor([0, -100, 1]),),torch.zeros((), dtype=torch.float64)
    assert float(micro_items(L, default=3)) == 2 and micro_items(L, default=3).dtype == torch.float64 == count_dtype(L.loss_grad)
    assert micro_items(L, n_items=lambda learn: 7) == 7
    with pytest.raises(TypeError, match='`n_items` must return an int or a 0-d tensor, got str'): micro_items(L, n_items=lambda l: 'x')
