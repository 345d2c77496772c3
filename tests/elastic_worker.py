"""Runs for tests/test_global_order.py on 1 process or on gloo processes (`launch_gloo`): a float64 MLP trained with
`fit_one_cycle` and `GradientAccumulation(target_bs=..., global_window=True)`, shuffled, through fastai's distributed
path; each returns the final weights and, for each optimizer step, the ids of the samples this rank put in its window"""
import warnings
import torch
from torch.utils.data import TensorDataset
from fastai.callback.core import Callback, CancelValidException

from accum_callback import GradientAccumulation
from accum_callback.testing import regression_data
from helpers import MLP, make_learner
from resume_worker import CutAt, _Cut   # (the job dies at a micro-batch's end, after any checkpoint there)

LR = 0.05

class WindowIds(Callback):
    "The ids (the data's first input column) of the samples of each stepped window on this rank; validation skipped"
    order = 100
    def before_fit(self):
        self.windows,self.cur = [],[]
        self.learn.gradient_accumulation.on_window_close(self.closed)
    def after_backward(self):   # (a padding micro-batch, run with zero weight, holds none of the window's samples)
        if not self.learn.gradient_accumulation.padding.on: self.cur += self.learn.xb[0][:, 0].round().long().tolist()
    def closed(self, stepped):
        if stepped: self.windows.append(self.cur)
        self.cur = []
    def before_validate(self): raise CancelValidException()

def data(n, seed=0):
    "`n` samples whose first input column is the sample's id (the model sees it, scaled down: a real input)"
    x,y = regression_data(n, seed=seed, dtype=torch.float64).tensors
    return TensorDataset(torch.cat([torch.arange(n, dtype=torch.float64)[:, None], x], 1), y)

def train(rank=0, world=1, n=96, bs=4, window=32, n_epoch=2, partial='step', seed=0, global_window=True, ckpt=None, cut=None,
          fsdp=False, by_hand=False, drop_last=False, adam=False, layer=None, bn=None, precise=None, noise=False):
    """`ckpt`: (folder, Checkpoint keyword arguments): checkpointed, and resumed from there if it holds one; `cut`: this
    rank's micro-batch at whose end the run dies (returned: the windows until then); `fsdp`: FSDP2 (`learn.fsdp_ctx()`)
    instead of DDP on several processes; `adam`: fastai's Adam (its state sharded under FSDP2), else SGD; `layer`: 'batchnorm' or 'dropout' after the first layer, with `bn` a `BatchNormAccumulation` mode; `drop_last`: fastai's default for a shuffled training loader; `by_hand`: the model wrapped in DDP by hand, the loader fastai's plain one"""
    from accum_callback import Checkpoint
    ds = data(n, seed)
    torch.manual_seed(seed); import random; random.seed(seed)
    model = torch.nn.Sequential(Scale(), MLP(n_in=ds.tensors[0].shape[1], n_out=ds.tensors[1].shape[1], seed=seed)).double()
    if layer is not None:
        torch.manual_seed(seed)
        extra = torch.nn.BatchNorm1d(16) if layer == 'batchnorm' else torch.nn.Dropout(0.2)
        model = torch.nn.Sequential(Scale(), torch.nn.Linear(ds.tensors[0].shape[1], 16), extra, torch.nn.Tanh(),
                                    torch.nn.Linear(16, ds.tensors[1].shape[1])).double()
    spy = WindowIds()
    cbs = [GradientAccumulation(target_bs=window, partial=partial, global_window=global_window), spy]
    if bn is not None:
        from accum_callback import BatchNormAccumulation
        cbs.append(BatchNormAccumulation(bn, **({} if precise is None else dict(precise=precise))))
    if noise:
        from accum_callback import GradientNoiseScale
        cbs.append(gns := GradientNoiseScale())
    if ckpt is not None: cbs.append(Checkpoint(ckpt[0], **ckpt[1]))
    if cut is not None: cbs.append(CutAt(cut))
    from fastai.optimizer import Adam, SGD
    learn = make_learner(ds, bs, cbs=cbs, model=model, lr=LR, dtype=torch.float64, shuffle=True, drop_last=drop_last,
                         opt_func=Adam if adam else SGD)
    try:
        with warnings.catch_warnings(record=True) as caught, learn.no_logging():
            warnings.simplefilter('always')
            lr = LR/10 if adam else LR
            if world == 1: learn.fit_one_cycle(n_epoch, lr)
            elif by_hand:
                from torch.nn.parallel import DistributedDataParallel as DDP
                learn.model = DDP(learn.model); learn.fit_one_cycle(n_epoch, lr)
            else:
                from accum_callback.core.distributed import gloo_distributed_dl
                with gloo_distributed_dl(), (learn.fsdp_ctx() if fsdp else learn.distrib_ctx(sync_bn=False, cpu=True)):
                    learn.fit_one_cycle(n_epoch, lr)
    except _Cut: return dict(windows=spy.windows, cut=True)
    said = [str(w.message) for w in caught if 'Checkpoint: resumed on' in str(w.message)]
    ck = next((c for c in learn.cbs if isinstance(c, Checkpoint)), None)
    full = lambda p: (p.full_tensor() if hasattr(p, 'full_tensor') else p).detach().reshape(-1).double()
    return dict(params=torch.cat([full(p) for p in learn.model.parameters()]), windows=spy.windows,
                buffers=torch.cat([full(b) for b in learn.model.buffers() if b.is_floating_point()] or [torch.zeros(0)]),
                steps=learn.gradient_accumulation.steps, resumed=str(ck.resumed_from) if ck is not None else None, said=said,
                noise={k: gns.values(k) for k in ('g_small2', 'g_big2', 'b', 'B')} if noise else None)

class Scale(torch.nn.Module):
    "The id column scaled to the others' size"
    def forward(self, x): return torch.cat([x[:, :1]/100., x[:, 1:]], 1)
