"""What the bench scripts share: the model, data and Learner factory, the hand-written loop, the alternating timer and its
statistics, the table, the machine line; the gloo launcher and synthetic images are `accum_callback.testing`'s. Public accum_callback API only."""
import multiprocessing, os, platform, statistics, sys, time
import torch, torch.nn as nn, torch.nn.functional as F
from torch.utils.data import TensorDataset
from torch.utils.data import DataLoader as TorchDataLoader
import fastai
from fastai.callback.core import Callback
from fastai.data.core import DataLoaders
from fastai.data.load import DataLoader
from fastai.learner import Learner
from fastai.optimizer import OptimWrapper

from accum_callback.batchnorm.modes import BN_MODES   # noqa: F401  (the one list of mode names)
from accum_callback.testing import image_data, launch_gloo as _launch_gloo

LR,MOM = 0.01,0.9

# -- model, data, learners ------------------------------------------------------------------------------------------
def conv_net(width=16, n_out=10, seed=0):
    "A small BatchNorm conv net: compute (convolutions) dominates the per-batch Python overhead"
    torch.manual_seed(seed)
    def blk(ni, nf, stride): return nn.Sequential(nn.Conv2d(ni, nf, 3, stride, 1, bias=False), nn.BatchNorm2d(nf), nn.ReLU())
    w = width
    return nn.Sequential(blk(3, w, 1), blk(w, 2*w, 2), blk(2*w, 4*w, 2), blk(4*w, 4*w, 2),
                         nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(4*w, n_out))

images = image_data   # `n` random `px` x `px` images and labels

def opt_func(params, lr=LR, **kw): return OptimWrapper(params, torch.optim.SGD, lr=lr, momentum=MOM)

class TrainTimer(Callback):
    "Wall time of each epoch's training phase (validation excluded)"
    def before_fit(self): self.times = []
    def before_train(self): self.t0 = time.perf_counter()
    def after_train(self): self.times.append(time.perf_counter()-self.t0)

def device_batches(ds, bs:int, device)->list:
    "`ds` cut into batches of `bs` already on `device`: a loader with no per-item work (on a GPU the collation of a few "
    "hundred images on the host, not the training, would be timed)"
    x,y = ds.tensors
    return [(x[i:i+bs].to(device), y[i:i+bs].to(device)) for i in range(0, len(y), bs)]

def learner(model, ds, bs, cbs=(), device=None, prebatched=False):
    """A quiet Learner over `ds` (one micro-batch of validation), torch's SGD through `OptimWrapper` like the hand loop.
    `prebatched`: the batches are cut and moved to `device` once (fastai's `DataLoader(bs=None)`), for GPU timings"""
    if prebatched:
        mk = lambda d: DataLoader(device_batches(d, bs, device), bs=None, shuffle=False)
        dls = DataLoaders(mk(ds), mk(TensorDataset(*[t[:bs] for t in ds.tensors])), device=device)
    else:
        valid = TensorDataset(*[t[:bs] for t in ds.tensors])
        dls = DataLoaders(DataLoader(ds, bs=bs, shuffle=False), DataLoader(valid, bs=bs), device=device or 'cpu')
    learn = Learner(dls, model, loss_func=F.cross_entropy, opt_func=opt_func, lr=LR, cbs=[TrainTimer(), *cbs])
    learn.recorder.train_metrics = False
    return learn

def bn_cut(mode:str, b:int, k:int)->tuple:
    """(loader batch size, accumulation callbacks) of BatchNorm mode `mode` at micro-batch b x k: the window modes
    measure a window at its start, so each window is one loader batch of b*k cut by `MicroBatching(b)` (the same
    samples a step as `GradientAccumulation(n_step=k)` over batches of b)"""
    from accum_callback import GradientAccumulation, MicroBatching
    from accum_callback.batchnorm.window_stats import WINDOW_MODES
    if mode in WINDOW_MODES: return b*k,[GradientAccumulation(n_step=1), MicroBatching(b)]
    return b,[GradientAccumulation(n_step=k)]

def fit_time(learn)->float:
    with learn.no_bar(), learn.no_logging(): learn.fit(1)
    return learn.train_timer.times[-1]

def hand_loop(model, ds, b, k, device='cpu', amp=False, prebatched=False):
    """The classic forum answer: loss/n_acc; backward; step + zero_grad every n_acc micro-batches. On a GPU with `amp`:
    fp16 autocast + GradScaler, the batches moved to `device` (on the CPU those are no-ops); `prebatched` as `learner`'s"""
    device = torch.device(device)
    opt = torch.optim.SGD(model.parameters(), lr=LR, momentum=MOM)
    dl = device_batches(ds, b, device) if prebatched else TorchDataLoader(ds, batch_size=b, shuffle=False)
    scaler = torch.amp.GradScaler(device.type, enabled=amp)
    def run():
        _sync(device); t0 = time.perf_counter()
        model.train(); opt.zero_grad()
        for i,(x,y) in enumerate(dl):
            x,y = x.to(device, non_blocking=True),y.to(device, non_blocking=True)
            with torch.autocast(device.type, dtype=torch.float16, enabled=amp): loss = F.cross_entropy(model(x), y)/k
            scaler.scale(loss).backward()
            if (i+1) % k == 0: scaler.step(opt); scaler.update(); opt.zero_grad()
        _sync(device)
        return time.perf_counter()-t0
    return run

def _sync(device):
    if torch.device(device).type == 'cuda': torch.cuda.synchronize()

# -- statistics and table rows ----------------------------------------------------------------------------------------
def rounds(contenders:dict, repeats:int, warmup=True)->tuple[dict,dict]:
    "Time every contender once per round, rotating the order; a warm-up round is dropped. Returns times and errors"
    names,out,errs = list(contenders),{n:[] for n in contenders},{}
    for r in range(repeats+warmup):
        for n in names[r % len(names):] + names[:r % len(names)]:
            if n in errs: continue
            try: t = contenders[n]()
            except Exception as e: errs[n] = f'error: {type(e).__name__}: {str(e)[:150]}'; continue
            if r or not warmup: out[n].append(t)
    return out,errs

def summary(xs):
    "Median and a robust spread (1.4826 x median absolute deviation; 0 with one value)"
    m = statistics.median(xs)
    return m, 1.4826*statistics.median(abs(x-m) for x in xs) if len(xs) > 1 else 0.

_T95 = {1: 12.71, 2: 4.30, 3: 3.18, 4: 2.78, 5: 2.57, 6: 2.45, 7: 2.36, 8: 2.31, 9: 2.26, 10: 2.23, 15: 2.13, 20: 2.09, 30: 2.04}

def mean_ci(xs)->tuple[float,float,float]:
    "Mean and its 95% interval (Student's t; the interval is the mean's when len(xs) < 2)"
    m = statistics.fmean(xs)
    if len(xs) < 2: return m,m,m
    df = len(xs)-1
    t = _T95.get(df) or _T95[max(k for k in _T95 if k <= df)] if df <= 30 else 1.96
    h = t*statistics.stdev(xs)/len(xs)**0.5
    return m,m-h,m+h

def verdict(r, noise, goal, le=True)->str:
    if r is None: return '—'
    if (r <= goal) if le else (r >= goal): return 'yes'
    return 'within noise' if ((r-noise <= goal) if le else (r+noise >= goal)) else 'no'

def time_row(measure, num, den, goal):
    "A row from paired per-round ratios num[i]/den[i]"
    r,noise = summary([a/b for a,b in zip(num, den)])
    return [measure, f'{r:.3f} ± {noise:.3f}', f'<= {goal:.2f}', verdict(r, noise, goal)]

def na_row(measure, goal, why): return [measure, why, goal, '—']
class CudaSync(Callback):
    "Wait for the GPU at the end of the training phase, so `TrainTimer` times the work, not its launch"
    order = -1
    def after_train(self): torch.cuda.synchronize()

# -- report -----------------------------------------------------------------------------------------------------------
def machine()->str:
    cpu = platform.processor() or platform.machine()
    try:
        with open('/proc/cpuinfo') as f: cpu = next(l.split(':', 1)[1].strip() for l in f if l.startswith('model name'))
    except (OSError, StopIteration): pass
    gpu = f', GPU {torch.cuda.get_device_name()}' if torch.cuda.is_available() else ''
    load = f', load average {os.getloadavg()[0]:.2f} at start' if hasattr(os, 'getloadavg') else ''
    return (f'{cpu}, {os.cpu_count()} cores, {torch.get_num_threads()} torch threads{gpu}; torch {torch.__version__}, '
            f'fastai {fastai.__version__}, Python {platform.python_version()}, {platform.system()}{load}')

def _cell(c)->str: return ' '.join(str(c).split()).replace('|', '/')   # one line, no column break (error texts have both)

def table(rows)->str:
    return '\n'.join(['| measure | ratio | goal | met? |', '|---|---|---|---|'] + ['| ' + ' | '.join(map(_cell, r)) + ' |' for r in rows])

def resnet_args(doc:str, rounds:int, argv=None, extra=None):
    "The arguments of a bench that times resnet18 windows in alternating rounds (`--rounds --windows --device --threads`)"
    import argparse
    p = argparse.ArgumentParser(description=doc.split('\n')[0])
    p.add_argument('--rounds', type=int, default=rounds)
    p.add_argument('--windows', type=int, default=8, help='optimizer steps per timed fit (default 8)')
    p.add_argument('--device', default='cuda' if torch.cuda.is_available() else 'cpu')
    p.add_argument('--threads', type=int, default=1)
    if extra is not None: extra(p)
    a = p.parse_args(argv)
    torch.set_num_threads(a.threads)
    return a

# -- processes ------------------------------------------------------------------------------------------------------
def _context():
    """Fork where the OS can (no second import, and any module-level function can run), else spawn; spawn too once this
    process has initialised CUDA (a forked child cannot use it)"""
    cuda = torch.cuda.is_available() and torch.cuda.is_initialized()
    return multiprocessing.get_context('fork' if 'fork' in multiprocessing.get_all_start_methods() and not cuda else 'spawn')

def forked(target, *args):
    "Run `target(*args, conn)` in a fresh process and return what it sends through `conn`"
    ctx = _context()
    recv,send = ctx.Pipe(duplex=False)
    p = ctx.Process(target=target, args=(*args, send)); p.start(); send.close()
    try: res = recv.recv()
    except EOFError: res = dict(error=f'worker died (exit code {p.join() or p.exitcode})')
    p.join()
    return res

def launch_gloo(fn, world:int=2, args=(), threads:int=1, timeout:float=600):
    """`accum_callback.testing.launch_gloo`, forked where the OS can (so `fn` may be any module-level function of a
    script): rank 0's result, or None if a rank failed (its traceback printed)"""
    try: return _launch_gloo(fn, world, args, threads=threads, timeout=timeout, start='fork')[0]
    except RuntimeError as e: print(e, file=sys.stderr); return None
