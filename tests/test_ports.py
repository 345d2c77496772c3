"""Other projects' own gradient-accumulation tests, their assertions ported onto fastai Learners (each test names the
one it ports), and beside each the stricter oracle: every optimizer step against one float64 batch of the same
samples (relative 1e-10: float64's rounding of two summation orders, far below any accumulation error)."""
import warnings

import pytest
import torch
from fastai.callback.core import Callback

from accum_callback import GradientAccumulation, MicroBatching
from helpers import make_learner, make_data

def flat(model): return torch.cat([p.detach().reshape(-1).clone() for p in model.parameters()])

class Steps(Callback):
    "The weights after each optimizer step, and the loss of every training batch"
    order = 99
    def before_fit(self): self.weights,self.losses = [],[]
    def after_step(self): self.weights.append(flat(self.model))
    def after_batch(self):
        if self.training: self.losses.append(float(self.learn.loss))

def run(bs, cbs=(), n=48, dtype=None, n_epoch=1, opt_func=None, lr=0.1, **kw):
    from fastai.optimizer import SGD
    learn = make_learner(make_data(n, seed=3), bs, cbs=list(cbs) + [s := Steps()], dtype=dtype, lr=lr,
                         opt_func=opt_func or SGD, **kw)
    with learn.no_logging(), warnings.catch_warnings():
        warnings.simplefilter('ignore')
        learn.fit(n_epoch)
    return s

def worst(a, b)->float: return max(float((x-y).abs().max()/y.abs().max()) for x,y in zip(a, b))

def oracle(cbs, bs, big, n=48, **kw):
    "The stricter oracle: each step of the accumulated fit against the plain fit at the window's batch, float64"
    a,b = run(bs, cbs, n, dtype=torch.float64, **kw),run(big, (), n, dtype=torch.float64, **kw)
    assert len(a.weights) == len(b.weights) > 0 and worst(a.weights, b.weights) < 1e-10

def test_transformers_gradient_accumulation_loss_alignment():
    """Ports transformers' `test_gradient_accumulation_loss_alignment_with_model_loss` (tests/trainer/test_trainer.py):
    a fit with gradient accumulation and one with the same number of samples per step in one batch log losses whose
    relative difference stays below 0.01 (float32, as that test runs). Here: the window's loss (GradientAccumulation's
    log) against the large batch's loss, step by step"""
    ga = GradientAccumulation(n_step=4)
    a,b = run(4, [ga]),run(16)
    diffs = [abs(x - y)/abs(y) for x,y in zip(ga.window_losses, b.losses)]
    assert len(diffs) == len(b.losses) > 0 and max(diffs) < 0.01
    oracle([GradientAccumulation(n_step=4)], 4, 16)

def test_accelerate_sync_gradient_accumulation():
    """Ports accelerate's `test_gradient_accumulation` (src/accelerate/test_utils/scripts/test_sync.py): inside the
    accumulation the parameters do not change and at its boundary they equal the model trained on the batch whole
    (float32 there within its `torch.allclose`). Here: the weights after every micro-batch, unchanged between
    boundaries, and at each boundary the large batch's step"""
    class EveryBatch(Callback):
        order = 100
        def before_fit(self): self.w0,self.w = flat(self.model),[]
        def after_batch(self):
            if self.training: self.w.append(flat(self.model))
    eb = EveryBatch()
    a,b = run(4, [GradientAccumulation(n_step=3), eb], n=48),run(12, n=48)
    for i,w in enumerate(eb.w):
        if (i + 1) % 3: assert torch.equal(w, eb.w[i - i % 3 - 1] if i >= 3 else eb.w0), i   # (inside: unchanged)
        else: assert torch.allclose(w, b.weights[i//3], rtol=1e-5, atol=1e-6), i   # (the boundary: the large batch's)
    assert len(eb.w) == 12 and not torch.equal(eb.w[2], eb.w0)
    oracle([GradientAccumulation(n_step=3)], 4, 12)

@pytest.mark.parametrize('n,n_step', [(20, 8), (28, 8)])
def test_lightning_accumulate_grad_batches_last_partial_window(n, n_step):
    """Ports Lightning's `accumulate_grad_batches` tests (#19987: the last, partial window of an epoch is stepped, not
    lost; #21808: an epoch shorter than the window). An epoch of 5 (or 7) loader batches with n_step=8 steps once an
    epoch, on all of its batches: what one batch of the whole epoch gives"""
    a,b = run(4, [GradientAccumulation(n_step=n_step)], n=n, n_epoch=2),run(n, n=n, n_epoch=2)
    assert len(a.weights) == len(b.weights) == 2 and worst(a.weights, b.weights) < 1e-5
    oracle([GradientAccumulation(n_step=n_step)], 4, n, n=n, n_epoch=2)

def test_fastai_18a_gradient_accumulation():
    """Ports fastai's own `GradientAccumulation` test (nbs/18a_callback.training.ipynb): a synthetic Learner fitted with
    `GradientAccumulation(n_acc=2*bs)` at bs ends with the weights of the fit at bs*2 (fastai's `test_close`, 1e-5),
    and with `n_acc` larger than the data the weights never change (no step). Here with our callback, fastai's
    spelling (`n_acc=k`, which `learn.accumulate(n_acc=k)` maps to `target_bs=k, partial='carry'`)"""
    a,b = run(8, [GradientAccumulation(target_bs=16, partial='carry')], n=64, n_epoch=2),run(16, n=64, n_epoch=2)
    assert torch.allclose(a.weights[-1], b.weights[-1], atol=1e-5)
    big = run(8, [GradientAccumulation(target_bs=1000, partial='carry')], n=64)
    assert len(big.weights) == 0   # (fastai's: a window of more samples than the fit holds never steps)
    oracle([GradientAccumulation(target_bs=16)], 8, 16, n=64, n_epoch=2)

def test_composer_microbatching_equivalence():
    """Ports composer's microbatching equivalence (`device_train_microbatch_size` against the whole batch,
    tests/trainer/test_trainer.py): the same weights after training with the batch cut into micro-batches (float32
    there within its default `torch.testing.assert_close`). Here: micro-batches of 2 under loader batches of 8"""
    from fastai.optimizer import Adam
    a,b = run(8, [GradientAccumulation(n_step=1), MicroBatching(2)], opt_func=Adam, lr=1e-2),run(8, opt_func=Adam, lr=1e-2)
    torch.testing.assert_close(a.weights[-1], b.weights[-1])
    oracle([GradientAccumulation(n_step=1), MicroBatching(2)], 8, 8, opt_func=Adam, lr=1e-2)
