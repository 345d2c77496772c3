"""`accum_callback.check.replay`: training replayed on a copy of the model. The window accumulated by the window's rule equals
one batch of it on a per-sample model (float64, 1e-12), the Learner is left exactly as it was (weights, buffers,
gradients, modes; each pass starts from the RNG as it was), and the modes it sets touch each norm layer's own flag only"""
import pytest
import torch, torch.nn as nn
from torch.utils.data import TensorDataset
from fastai.learner import Learner

from accum_callback import GradientAccumulation
from accum_callback.check.replay import Replay, micro_batches, training_model
from helpers import Float64Smoothing, make_dls

def _learner(bn=False):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(5, 8), nn.BatchNorm1d(8) if bn else nn.Identity(), nn.Tanh(), nn.Dropout(0.), nn.Linear(8, 3)).double()
    g = torch.Generator().manual_seed(1)
    ds = TensorDataset(torch.randn(24, 5, generator=g, dtype=torch.float64), torch.randint(0, 3, (24,), generator=g))
    return Learner(make_dls(ds, 4), model, loss_func=nn.CrossEntropyLoss(), cbs=[GradientAccumulation(n_step=3), Float64Smoothing()])

def _replay(learn):
    ga = learn.gradient_accumulation
    batches,where,dl = micro_batches(learn, 3, None)
    return Replay(learn, batches, training_model(learn), ga, None, where, dl)

def test_the_window_accumulated_is_one_batch_of_it_and_the_learner_is_untouched():
    learn = _learner()
    state = {k: v.clone() for k,v in learn.model.state_dict().items()}
    modes = [m.training for m in learn.model.modules()]
    r = _replay(learn)
    acc,big = r.grads(True),r.grads(False)
    assert acc.finite and big.finite and acc.names == big.names
    assert float((acc.flat - big.flat).norm()/big.flat.norm()) <= 1e-12
    assert all(torch.equal(v, learn.model.state_dict()[k]) for k,v in state.items())
    assert all(p.grad is None for p in learn.model.parameters())
    assert [m.training for m in learn.model.modules()] == modes
    assert torch.equal(r.grads(True).flat, acc.flat)   # each pass from the model and the RNG as they were (`fresh`)

def test_modes_set_the_norm_layers_own_flag_only():
    learn = _learner(bn=True)
    r = _replay(learn)
    m = r.fresh()
    r.modes(m, bn=False, drop=True)
    assert m.training and not m[1].training and m[3].training   # BatchNorm in eval, the rest (dropout) in training
    r.modes(m, bn=True, drop=False)
    assert not m.training and m[1].training and not m[3].training
