"""Training scenarios for 2 CPU processes over gloo (`accum_callback.testing.launch_gloo(fn, ...)` runs them).

Every scenario returns, per rank: the final weights, the optimizer steps, each step's window (the rank's own samples),
and the gradient all-reduces each micro-batch made (counted by a DDP communication hook)."""
import contextlib, time, traceback, warnings
from pathlib import Path
import torch, torch.nn as nn, torch.nn.functional as F
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import TensorDataset
from fastai.callback.core import Callback, CancelBatchException, CancelFitException, CancelValidException
from fastai.callback.training import GradientAccumulation as FastaiGradientAccumulation

from accum_callback import GradientAccumulation
from accum_callback.core.distributed import count_allreduces, count_collectives, fsdp_group_count, held_grad_bytes
from accum_callback.testing import OutOfMemoryAbove, regression_data
from helpers import accumulation, MLP, Float64Smoothing, make_learner

LR = 0.1

# -- data -----------------------------------------------------------------------------------------------------------
def make_data(n, seed=0): return regression_data(n, seed=seed, dtype=torch.float64).tensors

def shard(sizes, rank, seed=0, tokens=None):
    "Rank `rank`'s slice of one data set cut into `sizes`; `tokens[r]`: the fraction of rank r's targets that count"
    x,y = make_data(sum(sizes), seed=seed)
    if tokens is not None:   # targets get a 0/1 mask as many columns again (tokens that count in the loss)
        g = torch.Generator().manual_seed(seed+1)
        m = torch.cat([(torch.rand(n, y.shape[1], generator=g) < p).double() for n,p in zip(sizes, tokens)])
        m[:, 0] = 1.   # every sample has a token
        y = torch.cat([y, m], 1)
    lo = sum(sizes[:rank])
    return TensorDataset(x[lo:lo+sizes[rank]], y[lo:lo+sizes[rank]])

def masked_mse(out, targ):
    "Mean squared error over the tokens the mask keeps (a token-mean loss: each sample weighs by its tokens)"
    y,m = targ[:, :out.shape[1]],targ[:, out.shape[1]:]
    return ((out-y)**2*m).sum()/m.sum()

def n_tokens(learn): return learn.yb[0][:, learn.yb[0].shape[1]//2:].sum()

# -- spies ----------------------------------------------------------------------------------------------------------
class BNMLP(nn.Module):
    "MLP with a BatchNorm after a frozen first layer: the BatchNorm's input depends on the data alone"
    def __init__(self, n_in=5, n_hidden=16, n_out=3, seed=0):
        super().__init__()
        torch.manual_seed(seed)
        self.l1,self.bn,self.l2 = nn.Linear(n_in, n_hidden),nn.BatchNorm1d(n_hidden),nn.Linear(n_hidden, n_out)
        self.l1.requires_grad_(False)
    def forward(self, x): return self.l2(torch.tanh(self.bn(self.l1(x))))

class SyncEveryDDP(DDP):
    "DDP that all-reduces after every backward, even inside `no_sync` (the reference that synchronises every micro-batch)"
    def no_sync(self): return contextlib.nullcontext()

class Float64Run(Float64Smoothing):
    "Skip validation (not under test), and let the Recorder's loss smoothing take float64 losses"
    def before_validate(self): raise CancelValidException()

class DDPSpy(Callback):
    "After `GradientAccumulation`: record each micro-batch's all-reduces and each optimizer step's window"
    order = GradientAccumulation.order+1
    run_valid = False
    def __init__(self, counter): self.counter,self.micro,self.windows,self.buf = counter,[],[],[]
    @property
    def ga(self):
        ga = getattr(self.learn, 'gradient_accumulation', None)   # fastai's own callback takes the same name
        return ga if isinstance(ga, GradientAccumulation) else None
    def before_fit(self): self.fit_steps = 0
    def before_batch(self):
        self.n0,self.r0 = self.counter.n_calls,self.counter.n_rounds
        self.action = self.ga.window.action if self.ga is not None else None
    def after_backward(self): self.buf.append((self.xb[0].detach().clone(), self.yb[0].detach().clone()))
    def after_batch(self):
        ga = self.ga
        self.micro.append(dict(epoch=self.epoch, iter=self.iter, bs=len(self.yb[0]), action=self.action,
                               buckets=self.counter.buckets[self.n0:], rounds=self.counter.n_rounds-self.r0))
        if ga is None: return
        if not ga.window.is_open:   # the window closed: stepped (GradientAccumulation logged it) or dropped
            if ga.steps > self.fit_steps:   # (its logs start again with each fit)
                self.fit_steps = ga.steps
                self.windows.append((torch.cat([b[0] for b in self.buf]), torch.cat([b[1] for b in self.buf])))
            self.buf = []

# -- one scenario ---------------------------------------------------------------------------------------------------
class CancelOnRank(Callback):
    "On rank `rank` only, cancel the `at`-th training micro-batch (counting attempts) before its backward, in `after_loss`"
    def __init__(self, rank, my_rank, at): self.on,self.at,self.k = rank == my_rank,at,0
    def after_loss(self):
        if not (self.on and self.training): return
        self.k += 1
        if self.k == self.at: raise CancelBatchException()

class FSDPCounter:
    "The DDP counter's interface over `count_collectives`: a round is one reduce-scatter per FSDP2 group"
    def __init__(self, c, n_groups): self.c,self.n_groups = c,n_groups
    @property
    def n_calls(self): return self.c.reduce_scatter
    @property
    def n_rounds(self): return self.c.reduce_scatter/self.n_groups
    @property
    def buckets(self): return []

def fsdp_shard(model, world_size, reshard_after_forward=True, root=True):
    "FSDP2 over an explicit CPU mesh: each Linear its own group, then the root (BatchNorm and the rest in the root's)"
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.device_mesh import init_device_mesh
    mesh = init_device_mesh('cpu', (world_size,))
    for m in (model.l1, model.l2): fully_shard(m, mesh=mesh, reshard_after_forward=reshard_after_forward)
    return fully_shard(model, mesh=mesh, reshard_after_forward=reshard_after_forward) if root else model

def full_params(model): return torch.cat([(p.full_tensor() if hasattr(p, 'full_tensor') else p).detach().reshape(-1) for p in model.parameters()])

def train(rank, world_size, sizes, bs=4, n_epoch=2, ga=None, ddp=DDP, tokens=None, bucket_cap_mb=1e-4,
          seed=0, bn=None, shift=0., oom=None, cancel=None, check=False, fsdp=False, cbs_extra=(), nan_at=None,
          fp32=False, cancel_fit_at=None):
    """Train an MLP (float64) on this rank's shard of `sizes` samples under `ddp` (or FSDP2 with `fsdp`); `ga`: kwargs
    for `GradientAccumulation`"""
    ds = shard(sizes, rank, seed=seed, tokens=tokens)
    if shift: ds = TensorDataset(ds.tensors[0]+shift*rank, ds.tensors[1])   # ranks' data (and BatchNorm statistics) differ
    ga = dict(ga or {})
    builtin = ga.pop('fastai_builtin', None)
    # FSDP2's options: the Learner's (`learn.fsdp_options`)
    opts = {k: ga.pop(k) for k in ('sharded_grads', 'gathered_params') if k in ga}
    if tokens is not None: ga.setdefault('n_items', n_tokens)
    cbs = [Float64Run()] + ([FastaiGradientAccumulation(builtin)] if builtin else [*accumulation(**ga)] if ga else [])
    if bn is not None:
        from accum_callback.batchnorm.callback import BatchNormAccumulation
        cbs.append(BatchNormAccumulation(bn))
    n_out = ds.tensors[1].shape[1]//(2 if tokens is not None else 1)
    model = (MLP if bn is None else BNMLP)(n_in=5, n_out=n_out, seed=seed)
    model = model if fp32 else model.double()
    if fp32: ds = TensorDataset(*[t.float() for t in ds.tensors]); cbs = [c for c in cbs if not isinstance(c, Float64Run)] + [NoValid()]
    if nan_at is not None and rank == nan_at[0]: ds.tensors[0][nan_at[1]] = float('nan')   # (rank, sample)
    cbs += [c() if callable(c) and not isinstance(c, Callback) else c for c in cbs_extra]
    if cancel_fit_at is not None: cbs.append(CancelFitAt(cancel_fit_at))
    loss = masked_mse if tokens is not None else F.mse_loss
    if oom is not None: loss = OutOfMemoryAbove(oom[1], loss, rank=oom[0])   # (rank, items above which it runs out of memory)
    if cancel is not None: cbs.append(CancelOnRank(cancel[0], rank, cancel[1]))   # (rank, which micro-batch)
    learn = make_learner(ds, bs, cbs=cbs, model=model, loss_func=loss, lr=LR)
    if fsdp:
        fsdp_shard(model, world_size, **(fsdp if isinstance(fsdp, dict) else {}))
        learn.create_opt()   # on the sharded (DTensor) parameters
        if opts:
            from accum_callback.core.distributed import FSDPOptions
            learn.fsdp_options = FSDPOptions(**opts)
        stack = contextlib.ExitStack(); counter = FSDPCounter(stack.enter_context(count_collectives()), fsdp_group_count(model))
    else:
        # a tiny bucket cap: every parameter its own bucket, so the counts check "once per bucket", not just "once"
        learn.model = ddp(model, bucket_cap_mb=bucket_cap_mb) if ddp is not None else model
        counter = count_allreduces(learn.model) if ddp is not None else None
        stack = contextlib.ExitStack()
    spy = DDPSpy(counter or _NullCounter())
    learn.add_cb(spy)
    report = learn.check_accumulation() if check else None   # each rank on its own samples, no collective
    with stack, learn.no_bar(), learn.no_logging(), warnings.catch_warnings():
        warnings.simplefilter('ignore'); learn.fit(n_epoch, lr=LR)
        if cancel_fit_at is not None:   # a second fit after one cancelled mid-window: nothing of the first may leak
            held = held_grad_bytes(model)[0] if fsdp else 0   # unsharded bytes FSDP2 still holds
            spy.buf = []; learn.fit(1, lr=LR); spy.held_after_cancel = held
    ga_cb = getattr(learn, 'gradient_accumulation', None)
    params = full_params(model)
    bn_stats = [model.bn.running_mean.clone(), model.bn.running_var.clone(), model.bn.num_batches_tracked.item()] if bn else None
    return dict(params=params, bn_stats=bn_stats, micro=spy.micro, windows=spy.windows, rounds=counter.n_rounds if counter else 0,
                calls=counter.n_calls if counter else 0, n_buckets=len(set(counter.buckets)) if counter else 0,
                steps=ga_cb.steps if isinstance(ga_cb, GradientAccumulation) else None,
                window_items=list(ga_cb.window_items) if isinstance(ga_cb, GradientAccumulation) else None,
                n_dropped=ga_cb.n_dropped if isinstance(ga_cb, GradientAccumulation) else None,
                micro_bs=learn.micro_batching.size if hasattr(learn, 'micro_batching') else None,
                n_skipped=ga_cb.n_skipped if isinstance(ga_cb, GradientAccumulation) else None,
                held_after_cancel=getattr(spy, 'held_after_cancel', None),
                collectives=None if not fsdp else dict(rs=counter.c.reduce_scatter, ag=counter.c.all_gather, groups=counter.n_groups),
                check=None if report is None else dict(exact=report.exact, sizes=report.micro_sizes, causes=report.causes))

class CountOnceWrapped(Callback):
    "Register the counting hook once fastai's `DistributedTrainer` (order 11) has wrapped the model"
    order = 12
    def __init__(self, spy): self.spy = spy
    def before_fit(self): self.spy.counter = count_allreduces(self.learn.model)

def train_fastai(rank, world_size, n=32, bs=4, n_epoch=2, ga=None, seed=0, drop_last=False):
    "fastai's own path, `learn.distrib_ctx()` (Accelerate wraps the model, `DistributedDL` shards the data), on CPU"
    from accum_callback.core.distributed import gloo_distributed_dl
    x,y = make_data(n, seed=seed)
    spy = DDPSpy(_NullCounter())
    learn = make_learner(TensorDataset(x, y), bs, cbs=[Float64Run(), *accumulation(**ga), spy],
                         model=MLP(n_in=5, n_out=3, seed=seed).double(), lr=LR, drop_last=drop_last)
    learn.add_cb(CountOnceWrapped(spy))
    with gloo_distributed_dl(), learn.distrib_ctx(sync_bn=False, cpu=True), learn.no_bar(), learn.no_logging():
        learn.fit(n_epoch, lr=LR)
    return dict(params=torch.cat([p.detach().reshape(-1) for p in learn.model.parameters()]), micro=spy.micro,
                windows=spy.windows, rounds=spy.counter.n_rounds, steps=learn.gradient_accumulation.steps,
                window_items=list(learn.gradient_accumulation.window_items), n_dropped=learn.gradient_accumulation.n_dropped)

class _NullCounter: n_calls,n_rounds,buckets = 0,0,[]

def clip():
    from fastai.callback.training import GradientClip
    return GradientClip(0.05)   # small enough to clip (the test compares with DDP, whose clipping is exact)

def fp16():
    from fastai.callback.fp16 import MixedPrecision
    return MixedPrecision(amp_mode='fp16')

def bf16():
    from fastai.callback.fp16 import MixedPrecision
    return MixedPrecision(amp_mode='bf16')

class NoValid(Callback):
    def before_validate(self): raise CancelValidException()

class CancelFitAt(Callback):
    "Cancel the (first) fit at training micro-batch `at` (in `after_batch`): its window is left half-accumulated"
    def __init__(self, at): self.at,self.k,self.done = at,0,False
    def after_batch(self):
        if not self.training or self.done: return
        self.k += 1
        if self.k == self.at: self.done = True; raise CancelFitException()

def run_many(rank, world_size, scenarios):
    "Run several named scenarios in one spawn (process start and fastai's import dominate a scenario's cost)"
    out = {}
    for name,kw in scenarios.items():
        t = time.perf_counter()
        kw = dict(kw); fn = train_fastai if kw.pop('fastai_path', False) else train
        try: out[name] = fn(rank, world_size, **kw)
        except Exception as e: out[name] = dict(error=f"{type(e).__name__}: {e}\n{traceback.format_exc()}")
        dist.barrier()
        out[name]['time'] = time.perf_counter()-t
    return out

# -- the reference: one large batch per step over every rank's window -----------------------------------------------
def bn_pool_reference(windows, seed=0, momentum=0.1):
    "Running statistics of `BNMLP`'s BatchNorm after one update per window from all the window's samples at once"
    model = BNMLP(seed=seed).double()
    rm,rv = model.bn.running_mean.clone(),model.bn.running_var.clone()
    for x,_ in windows:
        h = model.l1(x).detach()
        rm,rv = (1-momentum)*rm + momentum*h.mean(0),(1-momentum)*rv + momentum*h.var(0, unbiased=True)
    return rm,rv

def large_batch_reference(windows_per_rank, n_out=3, tokens=False, seed=0, lr=LR):
    "Plain SGD, one step per window on the union of all ranks' samples of that window"
    model = MLP(n_in=5, n_out=n_out, seed=seed).double()
    loss_func = masked_mse if tokens else F.mse_loss
    for ws in zip(*windows_per_rank):
        x,y = torch.cat([w[0] for w in ws]),torch.cat([w[1] for w in ws])
        model.zero_grad(); loss_func(model(x), y).backward()
        with torch.no_grad():
            for p in model.parameters(): p -= lr*p.grad
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()])

# -- FSDP2: save/load, the fastai way in, export --------------------------------------------------------------------
def fsdp_save_load(rank, world_size, d, seed=0):
    """Train a sharded float64 MLP, `learn.save`; a fresh sharded Learner `learn.load`s it. Returns the weights of both
    and what the file holds (whole tensors, not rank 0's shards)"""
    from accum_callback import GradientAccumulation
    from fastai.optimizer import Adam
    ds = shard([32, 32], rank, seed=seed)
    def mk(s):
        model = MLP(n_in=5, n_out=3, seed=s).double()
        learn = make_learner(ds, 4, cbs=[Float64Run(), GradientAccumulation(n_step=2)], model=model, opt_func=Adam, lr=1e-2)
        learn.path = Path(d); fsdp_shard(model, world_size); learn.create_opt(); return learn.fsdp_checkpoints()   # sharded by hand
    a = mk(seed)
    with a.no_bar(), a.no_logging(), warnings.catch_warnings():
        warnings.simplefilter('ignore'); a.fit(1)
    f = a.save('m')
    saved = torch.load(f, map_location='cpu', weights_only=False)
    b = mk(seed+1)   # other weights, and an optimizer to fill
    b.load('m')
    # a planted file in fastai's place (`models/evil.pth`) whose unpickling would write a marker: refused, nothing run
    marker = Path(d)/'ran'
    if rank == 0: torch.save({'model': _Payload(str(marker))}, Path(d)/'models'/'evil.pth')
    dist.barrier()
    try: b.load('evil'); planted = 'loaded'
    except ValueError as e: planted = 'refused' if 'without running code' in str(e) else str(e)
    planted = (planted, marker.exists())
    st_a = [(k, full_params_of(v)) for k,v in sorted(_adam_state(a).items())]
    st_b = [(k, full_params_of(v)) for k,v in sorted(_adam_state(b).items())]
    return dict(a=full_params(a.model), b=full_params(b.model), file_shapes=[tuple(v.shape) for v in saved['model'].values()], planted=planted,
                full_shapes=[tuple(p.shape) for p in MLP(n_in=5, n_out=3).state_dict().values()],
                opt_equal=all(torch.equal(x, y) for (_,x),(_,y) in zip(st_a, st_b)) and len(st_a) > 0)

class _Payload:
    "Unpickled, it writes a file: what a planted checkpoint would do with `torch.load(weights_only=False)`"
    def __init__(self, marker): self.marker = marker
    def __reduce__(self): return (Path.write_text, (Path(self.marker), 'the file ran code'))

def full_params_of(v): return v.full_tensor() if hasattr(v, 'full_tensor') else v

def _adam_state(learn):
    out = {}
    for i,(p,*_) in enumerate(learn.opt.all_params()):
        for k,v in learn.opt.state[p].items():
            if isinstance(v, torch.Tensor) and v.ndim: out[f'{i}.{k}'] = v
    return out

class ExportableDataset(TensorDataset):
    "fastai's `export` empties the datasets (`new_empty`)"
    def new_empty(self): return type(self)(*[t[:0] for t in self.tensors])

def fsdp_way_in(rank, world_size, d, n=64, bs=4, n_epoch=2, seed=0, path='fsdp'):
    """The same Learner, all samples on every rank, trained through `learn.to_fsdp()` (FSDP2, DistributedDL) or through
    fastai's `distrib_ctx` (Accelerate's DDP, DistributedDL): the weights, and `learn.export` under FSDP2"""
    from accum_callback import GradientAccumulation
    from accum_callback.core.distributed import gloo_distributed_dl
    x,y = make_data(n, seed=seed)
    learn = make_learner(ExportableDataset(x, y), bs, cbs=[Float64Run(), GradientAccumulation(n_step=2)],
                         model=MLP(n_in=5, n_out=3, seed=seed).double(), lr=LR, valid=ExportableDataset(x[:8], y[:8]))
    learn.path = Path(d)
    with learn.no_bar(), learn.no_logging(), warnings.catch_warnings():
        warnings.simplefilter('ignore')
        if path == 'fsdp':
            with learn.fsdp_ctx():
                sharded = type(learn.model).__name__
                learn.fit(n_epoch, lr=LR)
                learn.export('exported.pkl')
        else:
            with gloo_distributed_dl(), learn.distrib_ctx(sync_bn=False, cpu=True): learn.fit(n_epoch, lr=LR)
            sharded = None
    return dict(params=torch.cat([p.detach().reshape(-1) for p in learn.model.parameters()]), sharded=sharded,
                plain=type(learn.model).__name__, steps=learn.gradient_accumulation.steps)

# -- the application matrix's distributed cells (tests/test_matrix.py) ---------------------------------------------
def app_cells(rank, world_size, names):
    """fastai's `distrib_ctx` (Accelerate's DDP, `DistributedDL`) on the matrix's applications: every step's gradient
    against one batch of every rank's window (`apps.Oracle`, which all-reduces its reference under DDP)"""
    from accum_callback.batchnorm.callback import BatchNormAccumulation
    from accum_callback.core.distributed import gloo_distributed_dl
    from apps import ROWS, Oracle
    out = {}
    for name in names:
        row = ROWS[name]
        oracle = Oracle(row)
        learn = row.make([GradientAccumulation(n_step=2), oracle, oracle.start] + ([BatchNormAccumulation('freeze')] if row.bn else []),
                         **row.spans_kw)
        check = learn.check_accumulation().exact   # each rank, before sharding: no collective
        with gloo_distributed_dl(), learn.distrib_ctx(sync_bn=False, cpu=True), learn.no_bar(), learn.no_logging():
            learn.fit(1)
        out[name] = dict(errs=oracle.errs, tol=oracle.tol, steps=learn.gradient_accumulation.steps, check=check, ddp_steps=oracle.ddp_steps,
                         sizes=list(learn.gradient_accumulation.window_sizes))
        dist.barrier()
    return out

# -- the gradient noise scale under DDP and FSDP2 (tests/test_noise.py) ---------------------------------------------
def noise_scale_ranks(rank, world_size):
    "Each rank half of `test_noise.data()`, GradientNoiseScale's per-step estimates under DDP, then FSDP2"
    from accum_callback.noise.scale import GradientNoiseScale
    from test_noise import data, linear_loss, D
    out = {}
    for kind in ('ddp', 'fsdp'):
        try:
            x,y = data().tensors
            ds = TensorDataset(x[rank::world_size], y[rank::world_size])
            model = nn.Linear(D, 1, bias=False).double(); nn.init.zeros_(model.weight)
            noise = GradientNoiseScale()
            learn = make_learner(ds, 8, cbs=[GradientAccumulation(n_step=8), noise, Float64Run()], model=model, lr=0.,
                                 loss_func=linear_loss, shuffle=True)
            if kind == 'ddp': learn.model = DDP(model)
            else:
                from torch.distributed.fsdp import fully_shard
                from torch.distributed.device_mesh import init_device_mesh
                fully_shard(model, mesh=init_device_mesh('cpu', (world_size,))); learn.create_opt()
            torch.manual_seed(rank); import random; random.seed(rank)
            with learn.no_bar(), learn.no_logging(), warnings.catch_warnings():
                warnings.simplefilter('ignore'); learn.fit(16)
            out[kind] = {k: noise.values(k) for k in ('g2', 'trace', 'b', 'B')}
        except Exception as e: out[kind] = dict(error=f"{type(e).__name__}: {e}\n{traceback.format_exc()}")
        dist.barrier()
    return out

# -- precise BatchNorm statistics under DDP and FSDP2 (tests/test_precise.py) ---------------------------------------
def precise_ranks(rank, world_size):
    "Each rank its 20 items (rank 1's shifted): `update_bn_stats` of a DDP, then an FSDP2 model, in micro-batches of 5"
    from accum_callback.batchnorm.precise import update_bn_stats
    from test_precise import BNNet, images
    out = {}
    x = images(seed=rank, shift=float(rank)).tensors[0][:20]
    for kind in ('ddp', 'fsdp'):
        try:
            model = BNNet().double()
            if kind == 'ddp': wrapped = DDP(model)
            else:
                from torch.distributed.fsdp import fully_shard
                from torch.distributed.device_mesh import init_device_mesh
                wrapped = fully_shard(model, mesh=init_device_mesh('cpu', (world_size,)))
            n = update_bn_stats(wrapped, [(x[i:i+5],) for i in range(0, 20, 5)])
            out[kind] = dict(n=n, stats=[(m.running_mean.clone(), m.running_var.clone()) for m in model.modules()
                                         if isinstance(m, nn.modules.batchnorm._BatchNorm)])
        except Exception as e: out[kind] = dict(error=f"{type(e).__name__}: {e}\n{traceback.format_exc()}")
        dist.barrier()
    return out

class RaiseOnRank(Callback):
    "On rank `rank` only, raise a ValueError at training micro-batch `at` (in `after_backward`)"
    def __init__(self, rank, my_rank, at): self.rank,self.on,self.at,self.k = rank,rank == my_rank,at,0
    def after_backward(self):
        if not self.on: return
        self.k += 1
        if self.k == self.at: raise ValueError(f'boom on rank {self.rank}')

def fsdp_raise_on_one_rank(rank, world_size, n=64, bs=4, seed=0):
    "Issue 43: rank 1 raises in the middle of a fit inside `learn.fsdp_ctx()` while rank 0 trains on"
    from accum_callback import GradientAccumulation
    x,y = make_data(n, seed=seed)
    learn = make_learner(TensorDataset(x, y), bs, cbs=[Float64Run(), GradientAccumulation(n_step=2), RaiseOnRank(1, rank, 3)],
                         model=MLP(n_in=5, n_out=3, seed=seed).double(), lr=LR)
    with learn.no_bar(), learn.no_logging(), warnings.catch_warnings():
        warnings.simplefilter('ignore')
        with learn.fsdp_ctx(): learn.fit(2, lr=LR)
    return {}

# -- BatchNormAccumulation('window') under DDP (tests/test_bn_window.py) --------------------------------------------
class WindowSpy(Callback):
    "Each window's loader batch and the weights at its start; each training micro-batch's predictions"
    def before_fit(self): self.batches,self.starts,self.preds = [],[],[]
    def before_batch(self):
        if not self.training or self.learn.micro_batching.piece.start != 0: return
        self.batches.append(tuple(t.clone() for t in self.learn.micro_batching.loader.batch))
        self.starts.append({k: v.clone() for k,v in self.learn.model.module.state_dict().items()})
        self.preds.append([])
    def after_loss(self):
        if self.training: self.preds[-1].append(self.learn.pred.detach().clone())

def bn_window_ranks(rank, world_size, scenarios):
    """`BatchNormAccumulation(mode)` on test_bn_window's `Net` (float64, 3 BatchNorm layers) under DDP, each rank its
    shard of `sizes` (rank r's inputs shifted by r: the ranks' statistics differ), loader batches of `bs` cut into
    micro-batches of `size`; `cut`: (folder, micro-batch) a first fit raising there, checkpointed each batch, then
    resumed"""
    from accum_callback import BatchNormAccumulation, Checkpoint, MicroBatching
    from test_bn_window import Net, Boom, RaiseAt
    out = {}
    for name,kw in scenarios.items():
        try:
            sizes,bs,size,mode,lr = kw['sizes'],kw['bs'],kw['size'],kw.get('mode', 'window'),kw.get('lr', 0.05)
            ds = shard(sizes, rank)
            ds = TensorDataset(ds.tensors[0] + float(rank), ds.tensors[1])
            def fit(*extra):
                spy = WindowSpy()
                cbs = [Float64Run(), GradientAccumulation(n_step=1), MicroBatching(size), BatchNormAccumulation(mode),
                       spy, *extra]
                learn = make_learner(ds, bs, cbs=cbs, model=Net().double(), lr=lr)
                learn.model = DDP(learn.model)
                with learn.no_bar(), learn.no_logging(), warnings.catch_warnings():
                    warnings.simplefilter('ignore'); learn.fit(kw.get('n_epoch', 2), lr=lr)
                return learn,spy
            cut = False
            if 'cut' in kw:
                d,at = kw['cut']
                try: fit(Checkpoint(f'{d}/ck', every=('1ep', '1ba')), RaiseAt(at))
                except Boom: cut = True
                dist.barrier()
                learn,spy = fit(Checkpoint(f'{d}/ck', every=('1ep', '1ba')))
            else: learn,spy = fit()
            m = learn.model.module
            stats = {k: v.clone() for k,v in m.state_dict().items() if 'running' in k or 'num_batches' in k}
            out[name] = dict(params=torch.cat([p.detach().reshape(-1) for p in m.parameters()]), stats=stats,
                             batches=spy.batches, starts=spy.starts, preds=spy.preds,
                             variant=learn.batch_norm_accumulation.window_variant, cut=cut)
        except Exception as e: out[name] = dict(error=f"{type(e).__name__}: {e}\n{traceback.format_exc()}")
        dist.barrier()
    return out
