"""The everyday matrix, drawn: loss x optimizer x tool x data, with our callbacks (`GradientAccumulation`, sometimes
`MicroBatching`, `BatchNormAccumulation` where the model has BatchNorm). Every cell runs without a traceback; where the
one-large-batch oracle applies (training, no BatchNorm, no dropout) the weights after the fit equal one plain fastai
Learner's at the window's batch on the same samples, within float32's rounding measured on that big fit (float32
against float64: `helpers.floor_tol`); a fit stopped and resumed by `Checkpoint` ends bitwise where the uninterrupted
one ends, for every optimizer."""
import math, warnings
from functools import partial

import numpy as np
import pytest
import torch, torch.nn as nn, torch.nn.functional as F
from hypothesis import HealthCheck, assume, example, given, settings, strategies as st
from torch.utils.data import TensorDataset
from fastai.callback.core import Callback
from fastai.data.core import DataLoaders, TfmdDL
from fastai.learner import Learner, load_learner
from fastai.losses import BCEWithLogitsLossFlat, CrossEntropyLossFlat, LabelSmoothingCrossEntropyFlat
from fastai.optimizer import Adam, OptimWrapper, SGD
from fastai.torch_core import params
from fastai.vision.all import ImageDataLoaders
from PIL import Image

from accum_callback import BatchNormAccumulation, Checkpoint, GradientAccumulation, MicroBatching
from helpers import Float64Batches, SmoothingInLossDtype, as64, flat, floor_tol, rel_err
from test_resume import Boom, RaiseAt
from test_resume_optimizers import _opt_tensors

PX,N_TRAIN,N_VALID,N_IN = 8,24,8,6   # image side; items; features of the tensor data

LOSSES = {'CrossEntropyLossFlat': CrossEntropyLossFlat(), 'nn.CrossEntropyLoss': nn.CrossEntropyLoss(),
          'F.cross_entropy': F.cross_entropy, 'LabelSmoothingCrossEntropyFlat': LabelSmoothingCrossEntropyFlat(),
          'BCEWithLogitsLossFlat': BCEWithLogitsLossFlat()}   # (the last on a multi-label target)
OPTS = {'Adam': Adam, 'SGD': SGD, 'torch-AdamW': partial(OptimWrapper, opt=torch.optim.AdamW),
        'torch-SGD': partial(OptimWrapper, opt=torch.optim.SGD)}
TOOLS = ('fit_one_cycle', 'fine_tune', 'lr_find', 'check_accumulation', 'noise_scale', 'get_preds', 'show_results',
         'export')
DATA = ('from_folder', 'TfmdDL', 'from_dsets')
TRAINS = ('fit_one_cycle', 'fine_tune')   # the tools the oracle compares

# -- data ----------------------------------------------------------------------------------------------------------
@pytest.fixture(scope='module')
def folder(tmp_path_factory):
    "fastai's `from_folder` layout: train/ and valid/, one sub-folder per class, random 8x8 RGB images"
    root,rng = tmp_path_factory.mktemp('imgs'),np.random.default_rng(0)
    for split,n in (('train', N_TRAIN//2), ('valid', N_VALID//2)):
        for c in ('a', 'b'):
            (root/split/c).mkdir(parents=True)
            for i in range(n):
                Image.fromarray((rng.random((PX, PX, 3))*255).astype('uint8')).save(root/split/c/f'{i}.png')
    return root

def _tensors(n, multi, seed):
    "`n` items of `N_IN` features; a class of 3, or (`multi`) a multi-hot target of 3 labels"
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, N_IN, generator=g)
    y = (torch.rand(n, 3, generator=g) > 0.5).float() if multi else torch.randint(0, 3, (n,), generator=g)
    return x,y

def make_dls(data, folder, bs, multi):
    "The loaders of `data`, unshuffled (a window of several loader batches holds the big batch's samples)"
    if data == 'from_folder':
        return ImageDataLoaders.from_folder(folder, bs=bs, num_workers=0, device='cpu', shuffle=False)
    (x,y),(xv,yv) = _tensors(N_TRAIN, multi, 0),_tensors(N_VALID, multi, 1)
    if data == 'from_dsets':
        return DataLoaders.from_dsets(TensorDataset(x, y), TensorDataset(xv, yv), bs=bs, shuffle=False, drop_last=False,
                                        device='cpu', num_workers=0)
    return DataLoaders(TfmdDL(list(zip(x, y)), bs=bs, shuffle=False, num_workers=0),
                       TfmdDL(list(zip(xv, yv)), bs=bs, num_workers=0), device='cpu')

# -- models: a conv net on the images, an MLP on the features; BatchNorm where drawn ---------------------------------
def make_model(data, bn, n_out, seed=0):
    torch.manual_seed(seed)
    if data == 'from_folder':
        return nn.Sequential(nn.Conv2d(3, 4, 3, stride=2, padding=1), *([nn.BatchNorm2d(4)] if bn else []), nn.Tanh(),
                             nn.Flatten(), nn.Linear(4*(PX//2)**2, n_out))
    return nn.Sequential(nn.Linear(N_IN, 8), *([nn.BatchNorm1d(8)] if bn else []), nn.Tanh(), nn.Linear(8, n_out))

def split_head(m): return [params(m[:-1]), params(m[-1])]   # (a module function: `export` pickles the Learner)

def n_out(data, loss): return 2 if data == 'from_folder' else 3

def learner(data, folder, loss, opt, bs, cbs=(), bn=False, dtype=None):
    multi = loss == 'BCEWithLogitsLossFlat'
    model = make_model(data, bn, n_out(data, loss))
    cbs = list(cbs)
    if dtype == torch.float64: model = model.double(); cbs += [Float64Batches(), SmoothingInLossDtype()]
    learn = Learner(make_dls(data, folder, bs, multi), model, loss_func=LOSSES[loss], opt_func=OPTS[opt], lr=1e-2,
                    splitter=split_head, cbs=cbs)
    learn.recorder.train_metrics = False
    return learn

def train(learn, tool):
    with learn.no_bar(), learn.no_logging(), warnings.catch_warnings():
        warnings.simplefilter('ignore')   # (the short epoch's advice, fastai's own remarks: not what the matrix checks)
        if tool == 'fit_one_cycle': learn.fit_one_cycle(2, 1e-2)
        else: learn.fine_tune(1, 1e-2, freeze_epochs=1)
    return learn

def weights(learn): return flat(learn.model.parameters()).detach()

# -- a cell ----------------------------------------------------------------------------------------------------------
def run_cell(folder, tmp, data, loss, opt, tool, bs, k, micro, bn):
    """Our callbacks: windows of `k` loader batches of `bs`, or (`micro`) loader batches of `bs*k` cut in pieces of
    `bs`, one step each; 'pool' for BatchNorm"""
    ours = ([GradientAccumulation(n_step=1), MicroBatching(bs)] if micro else [GradientAccumulation(n_step=k)]) + \
           ([BatchNormAccumulation()] if bn else [])
    big = bs*k
    learn = learner(data, folder, loss, opt, big if micro else bs, ours, bn=bn)
    if tool in TRAINS:
        train(learn, tool)
        ga = learn.gradient_accumulation
        assert ga.steps >= 2 and all(map(math.isfinite, ga.window_losses))
        if bn: return
        # the oracle: one plain fastai Learner at the window's batch, in float32 and float64
        b32,b64 = (train(learner(data, folder, loss, opt, big, dtype=d), tool) for d in (None, torch.float64))
        want = weights(b64)
        tol = floor_tol([rel_err(weights(b32).double(), want)])
        err = rel_err(weights(learn).double(), want)
        assert err <= tol, f'weights off the big batch: {err:.3e} > {tol:.3e}'
    elif tool == 'lr_find':
        w0 = weights(learn).clone()
        with learn.no_bar(), learn.no_logging(), warnings.catch_warnings():
            warnings.simplefilter('ignore')
            sug = learn.lr_find(num_it=6, stop_div=False, show_plot=False)
        assert math.isfinite(sug.valley) and learn.gradient_accumulation.steps == 6
        assert torch.equal(weights(learn), w0)
    elif tool == 'check_accumulation':
        r = learn.check_accumulation()
        assert bn or r.exact, r
    elif tool == 'noise_scale':
        w0 = weights(learn).clone()
        r = learn.noise_scale(n_windows=2, n_step=2)
        assert r.n_windows == 2 and math.isfinite(r.g2) and torch.equal(weights(learn), w0)
    else:
        train(learn, 'fit_one_cycle')
        with learn.no_bar(): inference(learn, folder, tmp, data, loss, opt, tool, ours)

def inference(learn, folder, tmp, data, loss, opt, tool, ours):
    if tool == 'get_preds':   # what fastai gives without our callbacks
        got = learn.get_preds()
        learn.remove_cbs(ours)
        assert all(torch.equal(a, b) for a,b in zip(got, learn.get_preds()))
        return
    if data != 'from_folder':
        # fastai shows and exports the Datasets of its data API only (a tensor has no `show`, a torch dataset no
        # `new_empty`): ours raise what fastai raises without them, nothing of their own
        with pytest.raises(AttributeError) as got: inference(learn, folder, tmp, 'from_folder', loss, opt, tool, ours)
        learn.remove_cbs(ours)
        with pytest.raises(AttributeError) as want: inference(learn, folder, tmp, 'from_folder', loss, opt, tool, ours)
        assert str(got.value) == str(want.value)
        return
    if tool == 'show_results':
        import matplotlib; matplotlib.use('Agg')
        import matplotlib.pyplot as plt
        try: learn.show_results(max_n=2)
        finally: plt.close('all')
        return
    learn.path = tmp
    learn.export('export.pkl')
    with warnings.catch_warnings():
        warnings.filterwarnings('ignore', message='load_learner` uses Python')
        loaded = load_learner(tmp/'export.pkl')
    with loaded.no_bar():
        got,want = loaded.get_preds(dl=learn.dls.valid)[0],learn.get_preds()[0]
    assert torch.equal(got, want)

def cell(data, loss, opt, tool, bs=4, k=2, micro=False, bn=False):
    "An explicit cell of the matrix"
    return example(data=data, loss=loss, opt=opt, tool=tool, bs=bs, k=k, micro=micro, bn=bn)

CELL = dict(data=st.sampled_from(DATA), loss=st.sampled_from(list(LOSSES)), opt=st.sampled_from(list(OPTS)),
            tool=st.sampled_from(TOOLS), bs=st.integers(3, 5), k=st.integers(2, 3), micro=st.booleans(),
            bn=st.booleans())

@pytest.mark.filterwarnings('ignore:GradientAccumulation. the epoch')   # a short toy epoch: said, and drawn here
@settings(max_examples=24, deadline=None, derandomize=True, suppress_health_check=list(HealthCheck))
@given(**CELL)
# every value of every axis at least once
@cell('from_folder', 'CrossEntropyLossFlat', 'Adam', 'fit_one_cycle')
@cell('TfmdDL', 'nn.CrossEntropyLoss', 'SGD', 'fine_tune', bs=3, k=3, micro=True)
@cell('from_dsets', 'F.cross_entropy', 'torch-AdamW', 'fit_one_cycle', bs=5)
@cell('from_folder', 'LabelSmoothingCrossEntropyFlat', 'torch-SGD', 'fine_tune', micro=True)
@cell('from_dsets', 'BCEWithLogitsLossFlat', 'Adam', 'fit_one_cycle', k=3)
@cell('from_dsets', 'BCEWithLogitsLossFlat', 'torch-AdamW', 'lr_find', micro=True, bn=True)
@cell('TfmdDL', 'CrossEntropyLossFlat', 'torch-SGD', 'check_accumulation')
@cell('from_folder', 'nn.CrossEntropyLoss', 'SGD', 'noise_scale', bn=True)
@cell('from_dsets', 'LabelSmoothingCrossEntropyFlat', 'Adam', 'get_preds', micro=True, bn=True)
@cell('from_folder', 'F.cross_entropy', 'torch-AdamW', 'show_results')
@cell('TfmdDL', 'BCEWithLogitsLossFlat', 'torch-SGD', 'export', micro=True, bn=True)
@cell('from_folder', 'CrossEntropyLossFlat', 'SGD', 'fit_one_cycle', bn=True)
def test_the_everyday_matrix(folder, tmp_path_factory, one_thread, data, loss, opt, tool, bs, k, micro, bn):
    assume(not (data == 'from_folder' and loss == 'BCEWithLogitsLossFlat'))   # (`from_folder`: one class an image)
    run_cell(folder, tmp_path_factory.mktemp('cell'), data, loss, opt, tool, bs, k, micro, bn)

# -- stopped and resumed -----------------------------------------------------------------------------------------------
def _fit(learn):
    with learn.no_bar(), learn.no_logging(), warnings.catch_warnings():
        warnings.simplefilter('ignore')
        try: learn.fit_one_cycle(2, 1e-2)
        except Boom: pass
    return learn

@pytest.mark.parametrize('opt', list(OPTS))
def test_a_fit_stopped_and_resumed_is_the_uninterrupted_one(folder, tmp_path, opt, one_thread):
    """The image folder, windows of two loader batches, `fit_one_cycle(2)` cut at training batch 7 (in the second epoch,
    mid-window) with checkpoints every 3, and run again: bitwise the uninterrupted fit's weights and optimizer state"""
    def mk(cbs): return learner('from_folder', folder, 'CrossEntropyLossFlat', opt, 4, [GradientAccumulation(n_step=2),
                                                                                          *cbs])
    ref = _fit(mk([]))
    _fit(mk([Checkpoint(tmp_path/'ck', every=('1ep', '3ba')), RaiseAt(7)]))
    again = _fit(mk([cb := Checkpoint(tmp_path/'ck', every=('1ep', '3ba'))]))
    assert cb.resumed_from is not None
    assert torch.equal(weights(ref), weights(again))
    a,b = _opt_tensors(ref),_opt_tensors(again)
    assert len(a) == len(b) and all(torch.equal(x, y) for x,y in zip(a, b))
