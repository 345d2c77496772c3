"""Run training scenarios in 2 CPU processes over gloo (spawned from the tests and `bench/ddp_bench.py`).

Every scenario returns, per rank: the final weights, the optimizer steps, each step's window (the rank's own samples),
and the gradient all-reduces each micro-batch made (counted by a DDP communication hook)."""
import contextlib, datetime, os, tempfile, time, traceback, warnings
import torch, torch.nn as nn, torch.nn.functional as F
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import TensorDataset
from fastai.callback.core import Callback, CancelBatchException, CancelValidException
from fastai.callback.training import GradientAccumulation as FastaiGradientAccumulation

from accum_callback import GradientAccumulation
from accum_callback.distributed import count_allreduces
from helpers import MLP, Float64Smoothing, make_learner
from conftest import free_port

LR = 0.1

def spawn(fn, world_size=2, timeout=60, **kwargs):
    "Run `fn(rank, world_size, **kwargs)` in `world_size` fresh processes over gloo; return each rank's result"
    with tempfile.TemporaryDirectory() as d:
        mp.spawn(_entry, args=(world_size, free_port(), timeout, d, fn, kwargs), nprocs=world_size, join=True)
        return [torch.load(os.path.join(d, f'{r}.pt'), weights_only=False) for r in range(world_size)]

def _entry(rank, world_size, port, timeout, d, fn, kwargs):
    os.environ.update(MASTER_ADDR='127.0.0.1', MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world_size),
                      LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world_size))
    torch.set_num_threads(1)
    # A short timeout: a rank that skips a collective the other makes fails the test instead of hanging it
    dist.init_process_group('gloo', rank=rank, world_size=world_size, timeout=datetime.timedelta(seconds=timeout))
    try: torch.save(fn(rank, world_size, **kwargs), os.path.join(d, f'{rank}.pt'))
    finally: dist.destroy_process_group()

# -- data -----------------------------------------------------------------------------------------------------------
def make_data(n, n_in=5, n_out=3, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, n_in, generator=g, dtype=torch.float64)
    y = x @ torch.randn(n_in, n_out, generator=g, dtype=torch.float64) + 0.1*torch.randn(n, n_out, generator=g, dtype=torch.float64)
    return x,y

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
            if len(ga.window_sizes) > len(self.windows):
                self.windows.append((torch.cat([b[0] for b in self.buf]), torch.cat([b[1] for b in self.buf])))
            self.buf = []

# -- one scenario ---------------------------------------------------------------------------------------------------
class SimulatedOOM:
    "A training loss that raises `torch.OutOfMemoryError` above `n` items on rank `rank` only"
    def __init__(self, loss, rank, my_rank, n): self.loss,self.on,self.n = loss,rank == my_rank,n
    def __call__(self, out, targ):
        if self.on and torch.is_grad_enabled() and len(out) > self.n: raise torch.OutOfMemoryError('CUDA out of memory (simulated)')
        return self.loss(out, targ)

class CancelOnRank(Callback):
    "On rank `rank` only, cancel the `at`-th training micro-batch (counting attempts) before its backward, in `after_loss`"
    def __init__(self, rank, my_rank, at): self.on,self.at,self.k = rank == my_rank,at,0
    def after_loss(self):
        if not (self.on and self.training): return
        self.k += 1
        if self.k == self.at: raise CancelBatchException()

def train(rank, world_size, sizes, bs=4, n_epoch=2, ga=None, ddp=DDP, tokens=None, bucket_cap_mb=1e-4,
          seed=0, bn=None, shift=0., oom=None, cancel=None, check=False):
    "Train an MLP (float64) on this rank's shard of `sizes` samples under `ddp`; `ga`: kwargs for `GradientAccumulation`"
    ds = shard(sizes, rank, seed=seed, tokens=tokens)
    if shift: ds = TensorDataset(ds.tensors[0]+shift*rank, ds.tensors[1])   # ranks' data (and BatchNorm statistics) differ
    ga = dict(ga or {})
    builtin = ga.pop('fastai_builtin', None)
    if tokens is not None: ga.setdefault('n_items', n_tokens)
    cbs = [Float64Run()] + ([FastaiGradientAccumulation(builtin)] if builtin else [GradientAccumulation(**ga)] if ga else [])
    if bn is not None:
        from accum_callback.batchnorm import BatchNormAccumulation
        cbs.append(BatchNormAccumulation(bn))
    n_out = ds.tensors[1].shape[1]//(2 if tokens is not None else 1)
    model = (MLP if bn is None else BNMLP)(n_in=5, n_out=n_out, seed=seed).double()
    loss = masked_mse if tokens is not None else F.mse_loss
    if oom is not None: loss = SimulatedOOM(loss, oom[0], rank, oom[1])   # (rank, items above which it runs out of memory)
    if cancel is not None: cbs.append(CancelOnRank(cancel[0], rank, cancel[1]))   # (rank, which micro-batch)
    learn = make_learner(ds, bs, cbs=cbs, model=model, loss_func=loss, lr=LR)
    # a tiny bucket cap: every parameter its own bucket, so the counts check "once per bucket", not just "once"
    learn.model = ddp(model, bucket_cap_mb=bucket_cap_mb) if ddp is not None else model
    counter = count_allreduces(learn.model) if ddp is not None else None
    spy = DDPSpy(counter or _NullCounter())
    learn.add_cb(spy)
    report = learn.check_accumulation() if check else None   # each rank on its own samples, no collective
    with learn.no_bar(), learn.no_logging(), warnings.catch_warnings():
        warnings.simplefilter('ignore'); learn.fit(n_epoch, lr=LR)
    ga_cb = getattr(learn, 'gradient_accumulation', None)
    params = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    bn_stats = [model.bn.running_mean.clone(), model.bn.running_var.clone(), model.bn.num_batches_tracked.item()] if bn else None
    return dict(params=params, bn_stats=bn_stats, micro=spy.micro, windows=spy.windows, rounds=counter.n_rounds if counter else 0,
                calls=counter.n_calls if counter else 0, n_buckets=len(set(counter.buckets)) if counter else 0,
                steps=ga_cb.steps if isinstance(ga_cb, GradientAccumulation) else None,
                window_items=list(ga_cb.window_items) if isinstance(ga_cb, GradientAccumulation) else None,
                n_dropped=ga_cb.n_dropped if isinstance(ga_cb, GradientAccumulation) else None,
                micro_bs=ga_cb.micro_bs if isinstance(ga_cb, GradientAccumulation) else None,
                check=None if report is None else dict(exact=report.exact, sizes=report.micro_sizes, causes=report.causes))

class CountOnceWrapped(Callback):
    "Register the counting hook once fastai's `DistributedTrainer` (order 11) has wrapped the model"
    order = 12
    def __init__(self, spy): self.spy = spy
    def before_fit(self): self.spy.counter = count_allreduces(self.learn.model)

def train_fastai(rank, world_size, n=32, bs=4, n_epoch=2, ga=None, seed=0):
    "fastai's own path, `learn.distrib_ctx()` (Accelerate wraps the model, `DistributedDL` shards the data), on CPU"
    from accum_callback.distributed import gloo_distributed_dl
    x,y = make_data(n, seed=seed)
    spy = DDPSpy(_NullCounter())
    learn = make_learner(TensorDataset(x, y), bs, cbs=[Float64Run(), GradientAccumulation(**ga), spy],
                         model=MLP(n_in=5, n_out=3, seed=seed).double(), lr=LR)
    learn.add_cb(CountOnceWrapped(spy))
    with gloo_distributed_dl(), learn.distrib_ctx(sync_bn=False, cpu=True), learn.no_bar(), learn.no_logging():
        learn.fit(n_epoch, lr=LR)
    return dict(params=torch.cat([p.detach().reshape(-1) for p in learn.model.parameters()]), micro=spy.micro,
                windows=spy.windows, rounds=spy.counter.n_rounds, steps=learn.gradient_accumulation.steps,
                window_items=list(learn.gradient_accumulation.window_items))

class _NullCounter: n_calls,n_rounds,buckets = 0,0,[]

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
