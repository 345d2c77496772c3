"""The path every fastai user walks first, on a tiny image folder (`ImageDataLoaders.from_folder`): the check, the noise
scale and the other tools that run batches outside the training loop see each batch as the training step does
(`core.batches.prepare_batch`: fastai's casting, the device, the callbacks' `before_batch`), so a plain torch loss works
with them (the everyday matrix drawn, loss x optimizer x tool x data: tests/test_everyday_matrix.py)."""
from functools import partial
import warnings

import numpy as np
import pytest
import torch, torch.nn as nn, torch.nn.functional as F
from fastai.callback.core import Callback
from fastai.learner import Learner, before_batch_cb
from fastai.torch_core import TensorBase
from fastai.vision.all import ImageDataLoaders
from PIL import Image

from accum_callback import GradientAccumulation
from accum_callback.core.batches import prepare_batch
from accum_callback.micro.loader import loader_pieces

PX = 8   # pixels a side: the model is a linear layer over them

@pytest.fixture(scope='module')
def folder(tmp_path_factory):
    "fastai's `from_folder` layout: train/ and valid/, one sub-folder per class, random 8x8 RGB images"
    root,rng = tmp_path_factory.mktemp('imgs'),np.random.default_rng(0)
    for split,n in (('train', 12), ('valid', 4)):
        for c in ('a', 'b'):
            (root/split/c).mkdir(parents=True)
            for i in range(n): Image.fromarray((rng.random((PX, PX, 3))*255).astype('uint8')).save(root/split/c/f'{i}.png')
    return root

def _dls(folder, bs=8): return ImageDataLoaders.from_folder(folder, bs=bs, num_workers=0, device='cpu', shuffle=False)

def _model(seed=0):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Flatten(), nn.Linear(PX*PX*3, 2))

@pytest.mark.parametrize('loss', [nn.CrossEntropyLoss(), F.cross_entropy], ids=['nn.CrossEntropyLoss', 'F.cross_entropy'])
def test_check_and_noise_scale_run_on_a_plain_torch_loss(folder, loss, one_thread):
    "fastai's `TensorImage`/`TensorCategory` reach a torch loss cast, as training casts them, in the check and the noise scale"
    learn = Learner(_dls(folder), _model(), loss_func=loss, cbs=[GradientAccumulation(n_step=2)])
    r = learn.check_accumulation()
    assert r.exact, r
    ns = learn.noise_scale(n_windows=2, n_step=2)
    assert ns.n_windows == 2 and np.isfinite(ns.g2)

class _Seen(Callback):
    "The batch the training step's model receives (after every `before_batch`), per batch"
    order = 100
    def before_fit(self): self.xs,self.ys = [],[]
    def before_batch(self):
        if self.training: self.xs.append(self.xb); self.ys.append(self.yb)

def test_pieces_outside_training_are_the_batches_training_runs(folder, one_thread):
    """The pieces the check and the noise scale read (`loader_pieces`) are, in the loader's own order, the batches the
    training step runs: the same types (plain tensors after fastai's `CastToTensor`) and values, a user's
    `before_batch_cb` applied; nothing of that left on the Learner"""
    double = before_batch_cb(lambda self, xb, yb: (tuple(x*2 for x in xb), yb))
    seen = _Seen()
    learn = Learner(_dls(folder), _model(), loss_func=nn.CrossEntropyLoss(), lr=0., cbs=[double, seen])
    learn.fit(1)
    xs,ys = list(seen.xs),list(seen.ys)   # (the spy's own `before_batch` runs in `loader_pieces` too, as in training)
    got = [b for b,_ in loader_pieces(learn, None)]
    assert len(got) == len(xs) > 1
    for b,xb,yb in zip(got, xs, ys):
        assert [type(t) for t in b] == [type(t) for t in xb + yb] == [torch.Tensor]*2
        assert all(torch.equal(a, t) for a,t in zip(b, xb + yb))
    raw = next(iter(learn.dls.train))
    left = learn.xb   # (the fit's last batch, as fastai leaves it)
    xb,yb = prepare_batch(learn, raw)
    assert torch.equal(xb[0], raw[0].as_subclass(torch.Tensor)*2) and learn.xb is left
